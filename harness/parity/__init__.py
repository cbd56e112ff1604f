"""HF parity: SGLang's real models against transformers' reference, on the CPU.

The stand-in suites (``tests/patches``, ``tests/multirank``) compare a model with its
own TP = 1 stand-in, so they cannot see a wrong expression that every rank shares or
a setter the engine calls and the tests do not. This tier takes its truth from
outside the harness:

* :mod:`harness.parity.reference` (the controller side): a tiny random-weight
  transformers checkpoint, written with ``save_pretrained`` at test time, and what
  transformers computes on it: ``output_hidden_states`` (entry ``i`` is the stream
  entering layer ``i``, what EAGLE3/DFlash drafts are trained on), the stream entering
  the final norm (the ``pre_norm`` last-layer capture), the final hidden states and
  the logits.
* :mod:`harness.parity.runner` (the rank side): SGLang loads the same directory
  through its own ``ModelConfig`` and model loader (architecture resolution,
  ``load_weights`` with real TP sharding), runs its real linear layers, norms,
  rotary embedding and the ``torch_native`` attention backend in SGLang's CPU engine
  mode, and requests captures through ``ModelRunner.init_aux_hidden_state_capture``,
  the method the engine calls (so the model's own ``set_eagle3_layers_to_capture`` /
  ``set_dflash_layers_to_capture``, wrappers included).
* :mod:`harness.parity.families`: one :class:`~harness.parity.families.Family` per
  capturing model family that transformers implements.

Stdlib-only at import time.
"""

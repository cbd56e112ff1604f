"""Stand-ins for SGLang 0.5.23 (``HARNESS_BASE=0.5.23``).

0.5.23 replaced the pin's ``LayerCommunicator`` by ``layers/layer_boundary`` (the
residual lives in ``forward_batch.residual_stream``; the stage boundaries own every
all-reduce) and the server-args globals by ``sglang.srt.runtime_context``. What
touches those internals lives here, chosen by :mod:`harness.standins.bases`:

* :mod:`.dist`: SGLang's distributed state in a rank (``init_sglang_distributed``);
* :mod:`.kernels`: ``fusion_mode`` (FlashInfer / aiter all-reduce fusion decision
  and CPU reference kernels with the GPU kernels' aliasing);
* :mod:`.models`: the model specs (``SPECS``) for 0.5.23's capturing models.

The base-independent parts (``blocks.standin_class``, ``kernels.install_cpu_norm``,
``models.ModelSpec`` / ``build``, ``batch.make_forward_batch``) are shared with the pin.
Stdlib-only at import time.
"""

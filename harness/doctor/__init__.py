"""The convention doctor: which features a draft was trained on, and whether this server
feeds them (``python -m harness doctor``; ``doctor-demo`` for planted checkpoints).

A draft reads K aux hidden states of its target. What each of the K slots holds is a
convention that no checkpoint states in full: which layer an id names (SGLang adds one
to explicit EAGLE3 ids, vLLM does not), which side of the final norm the last layer's
slot is taken (``pre_norm`` / ``post_norm``), which side of Qwen3-VL's deepstack
addition (``pre_deepstack`` / ``post_deepstack``), whether the residual stream is in it.
A draft served another convention than it was trained on raises no error; it only
accepts less. The doctor says, slot by slot, in transformers' terms:

1. what the draft declares (:mod:`harness.doctor.declared`: every key servers and
   trainers use, its ``fc`` width against the id count, norm keys against norm tensors);
2. what this server feeds (:mod:`harness.doctor.served`): the ids and settings resolved
   by the patched SGLang's own code, then SGLang's real model on a shrunk copy of the
   target's config, matched against transformers' real classes on the same weights
   (:mod:`harness.doctor.terms`); beside it what pristine SGLang of the same base and
   vLLM would feed (:mod:`harness.doctor.rules`, each rule with its source file);
3. what the draft was trained on, when a features file is given
   (:mod:`harness.doctor.features`): every slot matched against every candidate that
   transformers computes on the target's real weights over the file's ``input_ids``;
4. a verdict per slot and the one change that fixes a mismatch
   (:mod:`harness.doctor.verdict`), printed as a table and written as JSON.

Modules the CLI imports use only the standard library at import time.
"""

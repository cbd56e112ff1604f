"""Captures under ``--rl-on-policy-target``: bfloat16 weights, a float32 stream.

With ``rl_on_policy_target`` set, SGLang's Qwen3 models keep their embeddings,
residual stream and norms in float32 (``fp32_residual``, ``override_orig_dtype``) while
their projections run in the model dtype, so a layer hands on a bfloat16 output beside
a float32 residual. A capture ``hidden_states + residual`` is then float32, and the
final norm's output (a ``post_norm`` capture) is float32. :func:`run` loads a tiny
transformers checkpoint of such a family in bfloat16 the engine's way, with the
setting on, requests captures through the model runner's start-up function in both
final-layer settings, runs one extend batch, and returns what reached the logits
processor: the packed captures (dtype and values) and the final hidden states.
Stdlib-only at import time.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Sequence

TARGET = "fsdp"  # an rl_on_policy_target choice of both bases


@contextlib.contextmanager
def _cuda_moves_stay_on_cpu():
    """``Tensor.cuda()`` as the identity while the model is built on a machine without
    CUDA: with the setting on, the rotary embedding computes its inverse frequencies
    on the host and moves them to the GPU unconditionally (``rotary_embedding/base.py``
    ``_compute_inv_freq``); on the CPU the tensor already is where it runs."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _set_rl_on_policy_target(value) -> None:
    """The setting, where the base's models read it at construction: the pin's
    global server arguments, 0.5.23's resolved runtime context."""
    import importlib.util

    if importlib.util.find_spec("sglang.srt.runtime_context") is None:
        from sglang.srt.server_args import get_global_server_args

        get_global_server_args().rl_on_policy_target = value
        return
    from sglang.srt.runtime_context import get_context

    get_context().override("harness", rl_on_policy_target=value)


def run_case(checkpoint: str, prompts, tp: int, requests: Sequence[dict]) -> list:
    """One result per request (``runner.request_captures`` keywords): ``aux`` (the
    packed captures), ``final`` and ``layers_to_capture``, or ``error``."""
    from harness.parity import runner

    _set_rl_on_policy_target(TARGET)
    try:
        try:
            with _cuda_moves_stay_on_cpu():
                model_config, model = runner.load(checkpoint, dtype="bfloat16")
        except Exception:
            return [{"error": traceback.format_exc()} for _ in requests]
        results = []
        for request in requests:
            try:
                runner.request_captures(model, **request)
                res = runner.run_requests(model, model_config, prompts, tp)
                res["layers_to_capture"] = runner._layers_to_capture(model)
                results.append(res)
            except Exception:
                results.append({"error": traceback.format_exc()})
        return results
    finally:
        _set_rl_on_policy_target(None)


def run(rank: int, world_size: int, cases: Sequence[dict]) -> list:
    """Rank task: every case (``checkpoint``, ``prompts``, ``requests``)."""
    return [run_case(c["checkpoint"], c["prompts"], world_size, c["requests"]) for c in cases]

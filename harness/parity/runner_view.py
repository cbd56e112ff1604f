"""What SGLang's attention backends read of the model runner, as one object
(:func:`runner_view`), for the parity tier's backends (:mod:`harness.parity.runner`,
:mod:`harness.parity.triton_attention`, :mod:`harness.parity.hybrid`). A leaf: it imports
no other parity module, so those import it without a circle.

Stdlib-only at import time.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any


def on_0_5_23() -> bool:
    return importlib.util.find_spec("sglang.srt.runtime_context") is not None


def _server_args():
    if on_0_5_23():
        from sglang.srt.runtime_context import get_context

        return get_context().server_args
    from sglang.srt.server_args import get_global_server_args

    return get_global_server_args()


def runner_view(model_config, req_to_token, kv):
    """What ``attn_backend_wrapper``, the GDN backend and the triton backend read of the
    model runner. At
    the pin the hybrid-config lookups are ``ModelRunner`` properties: they run here as
    SGLang wrote them, on this object; 0.5.23 has them as functions of the model
    config (``configs/hybrid_arch.py``)."""
    attrs = dict(
        model_config=model_config, device="cpu", gpu_id=0, server_args=_server_args(),
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, is_draft_worker=False,
        use_mla_backend=False, page_size=1,
        prefill_attention_backend_str="torch_native", decode_attention_backend_str="torch_native",
        _linear_attn_registry_cache=None,
    )
    props: dict[str, Any] = {}
    if not on_0_5_23():
        from sglang.srt.model_executor.model_runner import ModelRunner

        for name in ("hybrid_gdn_config", "mamba2_config", "kimi_linear_config",
                     "hybrid_lightning_config", "mambaish_config", "linear_attn_model_spec"):
            prop = inspect.getattr_static(ModelRunner, name, None)
            if isinstance(prop, property):
                props[name] = prop
        props["_get_linear_attn_registry_result"] = ModelRunner._get_linear_attn_registry_result
    runner = type("ParityHybridRunner", (), props)()
    runner.__dict__.update(attrs)
    return runner

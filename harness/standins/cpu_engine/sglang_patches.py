"""Where SGLang's CPU engine path has a gap, the stand-in op goes in, per module.

Each hook runs right after its module executed (``hooks.when_imported``) and decides
from the module's own code which gap it has, so one set serves both bases:

- ``speculative.eagle_utils``
  - pin: ``build_tree_kernel_efficient`` calls ``sgl_build_tree_kernel_efficient``,
    which is imported only on CUDA/HIP/MUSA (a NameError on the CPU): set to
    ``tree.build_tree_kernel_efficient``.
  - pin: ``verify_tree_greedy_func`` has no CPU branch and returns its inputs untouched
    (no token is ever accepted, silently): a CPU branch calling
    ``tree.verify_tree_greedy``, the original otherwise.
  - 0.5.23: ``default_tree_mask_mode()`` returns QLEN_ONLY on every CPU, the layout of
    the intel_amx verify kernel, but the CPU engine here runs the triton attention
    backend (the AMX one needs sgl-kernel's CPU build), which reads FULL_MASK; with
    QLEN_ONLY it attends wrongly (wrong tokens, batched output unlike single). FULL_MASK.
- ``speculative.triton_ops.cache_locs`` (pin): ``assign_extend_cache_locs_func`` has no
  CPU branch and returns None (a shape error at the KV write later): the CPU branch
  0.5.23 has, over ``cache_locs.assign_extend_cache_locs``.
- ``mem_cache.memory_pool`` (pin): the pool launches the Triton kernel
  ``copy_all_layer_kv_cache_tiled`` itself (warm-up and ``move_kv_cache``), which the
  interpreter cannot run on raw addresses: ``kv_copy.TiledCopyLauncher``. 0.5.23 calls
  sgl-kernel's ``copy_all_layer_kv_cache_cpu`` there instead (the stand-in module).

- ``distributed.parallel_state`` (both bases): ``init_model_parallel_group`` turns
  pynccl on whenever the caller leaves ``use_pynccl`` unset (not on NPU/XPU), and
  ``PyNcclCommunicator`` then enters ``torch.cuda.device("cpu")``, which raises at TP > 1
  (0.5.23 ``parallel_state.py:2180-2185``, ``pynccl.py:116``). A CPU build of torch has
  no libnccl, so pynccl disables itself there before that line; the CUDA build installed
  here has one. The wrapper passes ``use_pynccl=False`` for a gloo group; the group's
  ``all_reduce`` on CPU tensors is then ``torch.distributed.all_reduce`` over gloo, as
  SGLang's CPU path has it (``parallel_state.py:695-699``).

A hook that finds none of the gaps it knows raises, naming the module: the stand-in no
longer matches that SGLang, and running on would hide it.
"""

from __future__ import annotations

from types import ModuleType

from harness.standins.cpu_engine import hooks

_SRT = "sglang.srt"
_MARK = "__harness_cpu_engine__"


class StandinMismatch(RuntimeError):
    """The SGLang module has none of the CPU gaps this stand-in fills."""


def _names(fn) -> set[str]:
    code = getattr(fn, "__code__", None)
    return set(code.co_names) if code is not None else set()


def _own(module: ModuleType, name: str):
    """``module.name`` if defined in ``module`` itself (not imported into it), else None."""
    fn = getattr(module, name, None)
    return fn if fn is not None and getattr(fn, "__module__", None) == module.__name__ else None


def _done(module: ModuleType, applied: list[str]) -> None:
    if not applied:
        raise StandinMismatch(
            f"harness.standins.cpu_engine: {module.__name__} has none of the CPU gaps the "
            "stand-in fills; update harness/standins/cpu_engine/sglang_patches.py for this SGLang"
        )
    setattr(module, _MARK, tuple(applied))


def patch_eagle_utils(module: ModuleType) -> None:
    from harness.standins.cpu_engine import tree

    applied: list[str] = []
    build = _own(module, "build_tree_kernel_efficient")
    if build is not None and "sgl_build_tree_kernel_efficient" in _names(build) and not hasattr(
        module, "sgl_build_tree_kernel_efficient"
    ):
        module.sgl_build_tree_kernel_efficient = tree.build_tree_kernel_efficient
        applied.append("sgl_build_tree_kernel_efficient")

    verify = _own(module, "verify_tree_greedy_func")
    if verify is not None and not ({"_is_cpu", "is_cpu"} & _names(verify)):
        original = verify

        def verify_tree_greedy_func(
            predicts, accept_index, accept_token_num, candidates, retrieve_index,
            retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1,
        ):
            if predicts.device.type != "cpu":
                return original(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                retrieve_next_token, retrieve_next_sibling, target_predict, topk)
            tree.verify_tree_greedy(
                predicts, accept_index, accept_token_num, candidates, retrieve_index,
                retrieve_next_token, retrieve_next_sibling, target_predict,
            )
            return predicts, accept_index, accept_token_num

        verify_tree_greedy_func.__wrapped__ = original
        module.verify_tree_greedy_func = verify_tree_greedy_func
        applied.append("verify_tree_greedy_func")

    if _own(module, "default_tree_mask_mode") is not None and hasattr(module, "TreeMaskMode"):
        full = module.TreeMaskMode.FULL_MASK

        def default_tree_mask_mode():
            """FULL_MASK: the CPU engine here verifies with the triton attention backend."""
            return full

        module.default_tree_mask_mode = default_tree_mask_mode
        applied.append("default_tree_mask_mode")
    _done(module, applied)


def patch_cache_locs(module: ModuleType) -> None:
    from harness.standins.cpu_engine import cache_locs

    applied: list[str] = []
    original = _own(module, "assign_extend_cache_locs_func")
    if original is not None and not ({"_is_cpu", "is_cpu"} & _names(original)):
        import torch

        def assign_extend_cache_locs_func(
            req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device,
        ):
            if torch.device(device).type != "cpu":
                return original(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                                draft_token_num, device)
            out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
            cache_locs.assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset,
                                                out, req_to_token.shape[1])
            return out

        assign_extend_cache_locs_func.__wrapped__ = original
        module.assign_extend_cache_locs_func = assign_extend_cache_locs_func
        applied.append("assign_extend_cache_locs_func")
    _done(module, applied)


def patch_memory_pool(module: ModuleType) -> None:
    from harness.standins.cpu_engine import kv_copy

    applied: list[str] = []
    if hasattr(module, "copy_all_layer_kv_cache_tiled"):
        module.copy_all_layer_kv_cache_tiled = kv_copy.TiledCopyLauncher()
        applied.append("copy_all_layer_kv_cache_tiled")
    elif hasattr(module, "copy_all_layer_kv_cache_func"):
        applied.append("none needed: copy_all_layer_kv_cache_func calls sgl_kernel's CPU op")
    _done(module, applied)


def patch_parallel_state(module: ModuleType) -> None:
    import functools
    import inspect

    applied: list[str] = []
    original = _own(module, "init_model_parallel_group")
    if original is not None and "use_pynccl" in inspect.signature(original).parameters:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init_model_parallel_group(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            if bound.arguments.get("backend") == "gloo" and bound.arguments.get("use_pynccl") is None:
                kwargs = dict(bound.arguments, use_pynccl=False)
                return original(**kwargs)
            return original(*args, **kwargs)

        module.init_model_parallel_group = init_model_parallel_group
        applied.append("init_model_parallel_group: use_pynccl=False over gloo")
    _done(module, applied)


HOOKS = {
    f"{_SRT}.speculative.eagle_utils": patch_eagle_utils,
    f"{_SRT}.speculative.triton_ops.cache_locs": patch_cache_locs,
    f"{_SRT}.mem_cache.memory_pool": patch_memory_pool,
    f"{_SRT}.distributed.parallel_state": patch_parallel_state,
}


def register() -> None:
    for name, hook in HOOKS.items():
        hooks.when_imported(name, hook)


def applied() -> dict[str, tuple[str, ...]]:
    """What each patched module received (for tests and failure messages)."""
    import sys

    return {name: getattr(sys.modules[name], _MARK) for name in HOOKS
            if name in sys.modules and hasattr(sys.modules[name], _MARK)}

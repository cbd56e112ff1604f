"""CPU stand-ins for SGLang's GPU-only kernels, with the GPU kernels' aliasing.

Only these are replaced, and only on a machine without the real kernels:

* the CUDA ``fused_add_rmsnorm`` (RMSNorm with a residual), by a CPU version with
  the same aliasing: ``residual`` and ``x`` are updated in place and returned;
* FlashInfer's fused all-reduce + residual + RMSNorm, by a CPU reference that
  all-reduces over the real TP group and returns a *fresh* ``residual_out`` and
  ``norm_out`` (the kernel's aliasing);
* the aiter fused all-reduce + RMSNorm, by a CPU reference that updates its inputs
  in place (its aliasing), for the "aiter-like" fusion mode;
* CUDA's custom all-reduce (out of place: a fresh output, its input untouched), by a
  CPU ``CustomAllreduce`` whose kernel sums over the group's gloo group
  (:func:`allreduce_mode`).

:func:`fusion_mode` switches SGLang's own fusion decision and kernels for a block of
code, :func:`allreduce_mode` the all-reduce SGLang's ``GroupCoordinator`` picks. What
ran is counted in :data:`PATHS` (:func:`record`), so a test can assert which path a
forward took. Stdlib-only at import time; torch and sglang are imported inside
functions.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterator

# "flashinfer_declined": SGLang's decision says fuse, and the real FlashInfer wrapper
# declines (returns ``(None, None)``), so SGLang's own fallback runs.
FUSION_MODES = ("off", "flashinfer", "flashinfer_declined", "aiter")
# "inplace": the CPU all-reduce (gloo, in place); "custom": CUDA's custom all-reduce,
# out of place, wherever SGLang's GroupCoordinator would pick it on CUDA.
ALLREDUCE_MODES = ("inplace", "custom")

# What ran in this process, by path: the FlashInfer wrapper's outcome
# ("flashinfer_fused", "flashinfer_declined"), "custom_all_reduce", and the CPU versions
# of the CUDA norm kernels (harness.standins.cpu_kernels.cuda_norm).
PATHS: "collections.Counter[str]" = collections.Counter()


def record(path: str, n: int = 1) -> None:
    """Count one run of ``path`` in :data:`PATHS`."""
    PATHS[path] += n


def paths_since(before: Any) -> dict:
    """What :data:`PATHS` counted after the snapshot ``before`` (``Counter(PATHS)``)."""
    return {k: v - before.get(k, 0) for k, v in PATHS.items() if v != before.get(k, 0)}


def recording_flashinfer(fn: Callable) -> Callable:
    """``fn`` (a FlashInfer ``allreduce_residual_rmsnorm`` wrapper or its CPU reference),
    counting each call's outcome: ``flashinfer_fused`` when it returned the fused result,
    ``flashinfer_declined`` when it returned ``(None, None)`` and SGLang falls back."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        record("flashinfer_declined" if result[0] is None else "flashinfer_fused")
        return result

    return wrapper


def op_body(fn: Callable, module: Any, name: str) -> Callable:
    """The Python body of ``module.name``, which SGLang registers as a torch custom op
    (``register_custom_op``: the module attribute is ``torch.ops.sglang.<name>`` at the
    pin, a caller of it in ``utils/custom_op.py`` on 0.5.23; the op's only kernel is the
    CUDA one, so a CPU tensor cannot go through it). The body is the function object
    the op's kernel holds: found once by its module and name among the live functions.
    ``fn`` itself when it is that module's own plain function."""
    import inspect
    import types

    fn = inspect.unwrap(fn)  # 0.5.23's caller wraps the body (functools.wraps)
    if type(fn) is types.FunctionType and fn.__module__ == module.__name__:
        return fn
    return _op_function(module.__name__, name)


@functools.lru_cache(maxsize=None)
def _op_function(module: str, name: str) -> Callable:
    import gc
    import types

    found = [o for o in gc.get_objects()
             if type(o) is types.FunctionType and o.__module__ == module
             and o.__name__ == name and not hasattr(o, "__wrapped__")]
    if len(found) != 1:
        raise RuntimeError(f"{module}.{name}: {len(found)} Python bodies found, not 1")
    return found[0]


def _torch():
    import torch

    return torch


def has_real_kernels() -> bool:
    """True on a CUDA machine: stand-ins switch off and the real kernels run."""
    return device().startswith("cuda")


def device() -> str:
    """``$HARNESS_DEVICE``, else ``cuda`` (the rank's current device) when available."""
    import os

    torch = _torch()
    want = os.environ.get("HARNESS_DEVICE")
    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return want


def model_dtype(cfg):
    """float64 on CPU; CUDA kernels (RMSNorm, FlashInfer) take float32, still exact for
    the small integers these tests produce."""
    torch = _torch()
    dtype = getattr(torch, cfg.dtype)
    if has_real_kernels() and dtype == torch.float64:
        return torch.float32
    return dtype


# --------------------------------------------------------------------------
# kernel stand-ins
# --------------------------------------------------------------------------


def _rms(x, weight, eps):
    torch = _torch()
    orig = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(orig) * weight.to(orig)


def cpu_rmsnorm_forward(norm, x, residual=None, post_residual_addition=None, *, gemma=False):
    """RMSNorm with the CUDA kernels' aliasing (``fused_add_rmsnorm`` is in place).

    ``gemma``: GemmaRMSNorm's ``x * (1 + w)`` (``gemma_fused_add_rmsnorm``, also in place).
    """
    weight = norm.weight.data
    if gemma:
        weight = 1.0 + weight
    if x.shape[0] == 0:
        return x if residual is None else (x, residual)
    if residual is None:
        return _rms(x, weight, norm.variance_epsilon)
    if post_residual_addition is not None:
        residual = residual + post_residual_addition
    # fused_add_rmsnorm(x, residual, w, eps): residual += x; x = rmsnorm(residual) * w
    residual.add_(x)
    x.copy_(_rms(residual, weight, norm.variance_epsilon))
    return x, residual


def install_cpu_norm(module) -> int:
    """Route every SGLang RMSNorm / GemmaRMSNorm under ``module`` to the in-place CPU kernel."""
    import functools

    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    n = 0
    for sub in module.modules():
        if isinstance(sub, (RMSNorm, GemmaRMSNorm)):
            sub._forward_method = functools.partial(
                cpu_rmsnorm_forward, sub, gemma=isinstance(sub, GemmaRMSNorm)
            )
            n += 1
    return n


def _reduce_group(use_attn_tp_group: bool):
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.layers.dp_attention import get_attention_tp_group

    return get_attention_tp_group() if use_attn_tp_group else get_tp_group()


def cpu_flashinfer_allreduce_residual_rmsnorm(
    input_tensor,
    residual,
    weight,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot=None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = False,
    use_attn_tp_group: bool = True,
):
    """CPU reference of FlashInfer's kARResidualRMSNorm: fresh outputs, inputs untouched."""
    group = _reduce_group(use_attn_tp_group)
    if group.world_size <= 1:
        return None, None
    if not (input_tensor.is_contiguous() and residual.is_contiguous()):
        return None, None
    assert input_tensor.shape[0] <= max_token_num
    return allreduce_add_rmsnorm_fresh(group, input_tensor, residual, weight, eps)


def cpu_aiter_fused_allreduce_rmsnorm(x, residual, weight, eps):
    """CPU reference of an in-place fused all-reduce + add + RMSNorm (aiter-like)."""
    return allreduce_add_rmsnorm_inplace(_reduce_group(True), x, residual, weight, eps)


def allreduce_add_rmsnorm_fresh(group, x, residual, weight, eps):
    """FlashInfer's aliasing: ``norm(all_reduce(x) + residual)`` and the sum, both in
    fresh storage; ``x`` and ``residual`` untouched. Every base's FlashInfer stand-in."""
    torch = _torch()
    reduced = group.all_reduce(x.clone())
    residual_out = torch.empty_like(residual)
    torch.add(reduced, residual, out=residual_out)
    norm_out = torch.empty_like(x)
    norm_out.copy_(_rms(residual_out, weight, eps))
    return norm_out, residual_out


def allreduce_add_rmsnorm_inplace(group, x, residual, weight, eps):
    """aiter's aliasing: the sum into ``residual`` and the norm into ``x``, in place."""
    reduced = group.all_reduce(x.clone())
    residual.add_(reduced)
    x.copy_(_rms(residual, weight, eps))
    return x, residual


@contextlib.contextmanager
def fusion_mode(mode: str) -> Iterator[None]:
    """Switch SGLang's all-reduce fusion decision and kernels for the duration.

    ``off``: the pin's CPU behaviour (no fusion). ``flashinfer``: SGLang's own
    FlashInfer decision logic runs with the hardware check answered yes, and the
    kernel is the CPU reference (fresh ``residual_out``). ``flashinfer_declined``: the
    same decision, and the real FlashInfer wrapper, which declines (``(None, None)``):
    SGLang's own fallback runs (all-reduce, then the norm into a residual of its own).
    Both count each wrapper call's outcome in :data:`PATHS`. ``aiter``: SGLang's aiter
    fusion branch, with an in-place CPU reference kernel.
    """
    if mode not in FUSION_MODES:
        raise ValueError(f"fusion mode {mode!r} not in {FUSION_MODES}")
    from harness.standins import bases

    other = bases.module("kernels")
    if other is not None:  # another base decides and fuses elsewhere
        with other.fusion_mode(mode):
            yield
        return
    from sglang.srt.layers import communicator, flashinfer_comm_fusion, layernorm
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.server_args import get_global_server_args

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    sa = get_global_server_args()
    fuses = mode in ("flashinfer", "flashinfer_declined")
    patch(sa, "enable_flashinfer_allreduce_fusion", fuses)
    patch(sa, "enable_aiter_allreduce_fusion", mode == "aiter")
    if fuses:
        if mode == "flashinfer_declined":
            # The real wrapper, its first check answered no (FlashInfer unavailable, as
            # on a CPU): it returns (None, None) on any device and SGLang falls back.
            patch(flashinfer_comm_fusion, "is_flashinfer_available", lambda: False)
            kernel = op_body(flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm,
                             flashinfer_comm_fusion, "flashinfer_allreduce_residual_rmsnorm")
        elif has_real_kernels():
            kernel = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm
        else:
            kernel = cpu_flashinfer_allreduce_residual_rmsnorm
        patch(flashinfer_comm_fusion, "flashinfer_allreduce_residual_rmsnorm",
              recording_flashinfer(kernel))
    if fuses and (mode == "flashinfer_declined" or not has_real_kernels()):
        max_bs = communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE

        def apply_flashinfer_allreduce_fusion(batch_size: int):
            # The pin's predicate with the sm90/sm100 + flashinfer check answered yes.
            return (
                batch_size > 0
                and batch_size <= max_bs
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_flashinfer_allreduce_fusion
            )

        patch(communicator, "apply_flashinfer_allreduce_fusion", apply_flashinfer_allreduce_fusion)
    elif mode == "aiter":
        patch(communicator, "_use_aiter", True)
        patch(layernorm, "_use_aiter", True)

        def apply_aiter_all_reduce_fusion(input_tensor):
            return (
                input_tensor.numel() > 0
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_aiter_allreduce_fusion
            )

        patch(communicator, "apply_aiter_all_reduce_fusion", apply_aiter_all_reduce_fusion)
        import sglang.srt.distributed as dist_pkg

        patch(
            dist_pkg,
            "tensor_model_parallel_fused_allreduce_rmsnorm",
            cpu_aiter_fused_allreduce_rmsnorm,
        )
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# --------------------------------------------------------------------------
# all-reduce: CUDA's custom all-reduce, out of place
# --------------------------------------------------------------------------

# ops handle (CustomAllreduce._ptr) -> the ProcessGroup its CPU kernel sums over.
_CUSTOM_AR_GROUPS: dict = {}
_CUSTOM_AR: dict = {}  # GroupCoordinator unique_name -> its CPU CustomAllreduce


def _cpu_custom_all_reduce_kernel(fa, inp, out, reg_buffer, reg_buffer_sz) -> None:
    """CPU version of sgl-kernel's ``custom_ar`` ``all_reduce(fa, inp, out, ...)``: the
    sum of every rank's ``inp`` written into ``out``; ``inp`` untouched."""
    import torch.distributed as dist

    out.copy_(inp)
    dist.all_reduce(out, group=_CUSTOM_AR_GROUPS[fa])
    record("custom_all_reduce")


@functools.lru_cache(maxsize=None)
def _cpu_custom_allreduce_class():
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    class CpuCustomAllreduce(CustomAllreduce):
        """SGLang's ``CustomAllreduce`` over a CPU group: its own ``should_custom_ar``
        (the size and layout checks), ``custom_all_reduce`` and ``_all_reduce_impl``
        (a fresh ``out``, the kernel writes it); no IPC buffers, and the kernel is
        :func:`_cpu_custom_all_reduce_kernel` (:func:`allreduce_mode` binds it)."""

        def __init__(self, group, max_size: int = 8192 * 1024) -> None:  # noqa: D107
            import torch.distributed as dist

            self.disabled = False
            self.group = group
            self.rank = dist.get_rank(group=group)
            self.world_size = dist.get_world_size(group=group)
            self.full_nvlink = True
            self.max_size = max_size
            self._IS_CAPTURING = False
            self.tms_cudagraph = False
            self.use_amd_deterministic_impl = False
            self.buffer_ptrs = [0] * self.world_size
            self._ptr = len(_CUSTOM_AR_GROUPS) + 1
            _CUSTOM_AR_GROUPS[self._ptr] = group

        def close(self) -> None:
            pass

    return CpuCustomAllreduce


@contextlib.contextmanager
def allreduce_mode(mode: str) -> Iterator[None]:
    """Which all-reduce SGLang's ``GroupCoordinator.all_reduce`` runs, for the duration.

    ``inplace``: the CPU path (``torch.distributed.all_reduce`` over gloo, in place: the
    input holds the sum and is returned), NCCL's semantics. ``custom``: CUDA's custom
    all-reduce, which SGLang picks on CUDA for every input ``ca_comm.should_custom_ar``
    accepts (up to 8 MiB at TP 2, or with full NVLink): a *fresh* output, the input left
    as it was. Every TP group of more than one rank gets a CPU ``CustomAllreduce``
    (SGLang's class, its kernel summing over gloo) as its ``ca_comm``, and ``all_reduce``
    takes, for a CPU tensor, the branch it takes on CUDA: SGLang's
    ``outplace_all_reduce(..., "ca")`` (the op's body, ``_all_reduce_out_place``; the
    op itself is registered for CUDA only) when ``ca_comm.should_custom_ar`` accepts the
    input (the CPU branch, ``input_.is_cpu``, is the only one left out); anything else
    runs SGLang's own ``all_reduce``. Each custom all-reduce counts in :data:`PATHS`."""
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"all-reduce mode {mode!r} not in {ALLREDUCE_MODES}")
    if mode == "inplace" or has_real_kernels():
        yield
        return
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.device_communicators import custom_all_reduce

    cls = _cpu_custom_allreduce_class()
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for name, ref in list(ps._groups.items()):
        group = ref()
        if group is None or group.world_size <= 1:
            continue
        if name not in _CUSTOM_AR:
            _CUSTOM_AR[name] = cls(group.device_group)
        patch(group, "ca_comm", _CUSTOM_AR[name])
    original = ps.GroupCoordinator.all_reduce

    def all_reduce(self, input_):
        ca = self.ca_comm
        if (self.world_size > 1 and input_.is_cpu and isinstance(ca, cls)
                and not ca.disabled and ca.should_custom_ar(input_)):
            # The body of SGLang's ``outplace_all_reduce`` op (its torch op is
            # registered for CUDA only): ``_all_reduce_out_place(input_, "ca")``.
            return self._all_reduce_out_place(input_, "ca")
        return original(self, input_)

    patch(ps.GroupCoordinator, "all_reduce", all_reduce)
    patch(custom_all_reduce, "ops",
          type("CpuCustomAllReduceOps", (), {"all_reduce": staticmethod(
              _cpu_custom_all_reduce_kernel)}))
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)

"""The rotary-embedding stand-ins against the definition of RoPE.

* ``harness.standins.cpu_kernels.mla_rope``: ``get_rope_cpu`` with ``rope_scaling=None``
  (which SGLang's CPU factory refuses) gives SGLang's own plain ``RotaryEmbedding``,
  whose CPU path rotates pairs ``(x[2i], x[2i+1])`` (interleaved, MLA's layout) or
  ``(x[i], x[i + d/2])`` (neox) by ``pos * base^(-2i/d)``; every other call is SGLang's.
* ``harness.standins.cpu_kernels.rope_inplace``: the CUDA kernel's aliasing, ``query``
  and ``key`` rotated in place (strided views of one buffer included) and returned.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from harness.standins.cpu_kernels import rope_inplace

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _rope(x, positions, base, neox):
    """RoPE by its definition, over the last dim of ``x: [tokens, heads, d]``."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for t, p in enumerate(positions.tolist()):
        for i in range(d // 2):
            theta = p * base ** (-2.0 * i / d)
            c, s = torch.cos(torch.tensor(theta)), torch.sin(torch.tensor(theta))
            a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


# ---- mla_rope -----------------------------------------------------------------------

# Run in the stand-ins' shared CPU engine process (conftest.py's ``engine_process``).
ENGINE_CHECK = """
import json, sys
from harness.parity.runner import init
init(0, 1)  # a parity rank: SGLang's CPU engine mode and its state at TP 1
import torch
from sglang.srt.layers.rotary_embedding import factory
from harness.standins.cpu_kernels import mla_rope
from test_cpu_kernels_rope import _rope

out = {}
try:
    factory.get_rope_cpu(16, 16, 64, 10000, False, None, torch.float32, 1.0, "cpu")
    out["refused"] = False
except AssertionError:
    out["refused"] = True
yarn = {"rope_type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
own_yarn = factory.get_rope_cpu(16, 16, 64, 10000, False, dict(yarn), torch.float32, 1.0, "cpu")
mla_rope.install(); mla_rope.install()
out["yarn_is_sglangs"] = factory.get_rope_cpu(
    16, 16, 64, 10000, False, dict(yarn), torch.float32, 1.0, "cpu") is own_yarn
for neox in (False, True):
    rope = factory.get_rope_wrapper(16, 16, 64, 10000, is_neox_style=neox, rope_scaling=None,
                                    dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(int(neox))
    q, k = torch.randn(5, 3, 16, generator=g), torch.randn(5, 1, 16, generator=g)
    pos = torch.tensor([0, 1, 2, 7, 30])
    q_out, k_out = rope(pos, q.clone(), k.clone())
    out[f"class_{neox}"] = type(rope).__name__
    out[f"q_{neox}"] = float((q_out.reshape(q.shape) - _rope(q, pos, 10000, neox)).abs().max())
    out[f"k_{neox}"] = float((k_out.reshape(k.shape) - _rope(k, pos, 10000, neox)).abs().max())
mla_rope.uninstall()
out["restored"] = factory.get_rope_cpu is not mla_rope.get_rope_cpu
"""


@pytest.mark.xdist_group("engine-process")
def test_plain_rope_for_mla_on_the_cpu(engine_process):
    """In a fresh process in SGLang's CPU engine mode (SGLang decides its platform at
    import): refused without the stand-in, SGLang's RotaryEmbedding with it (interleaved
    and neox pairs by the definition), scaled RoPE left to SGLang, restored after."""
    pytest.importorskip("sglang")
    out = engine_process(__name__)
    assert out["refused"] and out["yarn_is_sglangs"] and out["restored"]
    for neox in ("False", "True"):
        assert out[f"class_{neox}"] == "RotaryEmbedding"
        assert out[f"q_{neox}"] < 1e-5 and out[f"k_{neox}"] < 1e-5, out


# ---- rope_inplace -------------------------------------------------------------------

class OutOfPlace(torch.nn.Module):
    """A rotary module with SGLang's CPU aliasing: new tensors, inputs untouched."""

    head_size = 8
    is_neox_style = True

    def forward(self, positions, query, key):
        t = positions.numel()
        q = _rope(query.reshape(t, -1, 8), positions, 100.0, True).reshape(query.shape)
        k = _rope(key.reshape(t, -1, 8), positions, 100.0, True).reshape(key.shape)
        return q, k


def test_in_place_on_views_of_one_buffer():
    inner = OutOfPlace()
    rope = rope_inplace.in_place(inner)
    assert rope.head_size == 8 and rope.is_neox_style  # the inner module's attributes
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(4, 3 * 8, generator=g)
    pos = torch.tensor([0, 3, 5, 9])
    q_view, k_view = qk.split([16, 8], dim=-1)  # strided views, as Llama4Attention's
    want_q, want_k = inner(pos, q_view.clone(), k_view.clone())
    ptr = qk.data_ptr()
    q_out, k_out = rope(pos, q_view, k_view)
    assert q_out is q_view and k_out is k_view
    assert qk.data_ptr() == ptr
    torch.testing.assert_close(qk[:, :16], want_q)
    torch.testing.assert_close(qk[:, 16:], want_k)
    assert torch.equal(qk[0], torch.cat([want_q[0], want_k[0]]))  # position 0: unchanged values


def test_none_stays_none():
    assert rope_inplace.in_place(None) is None


def test_install_llama4_wraps_only_that_module(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a no-op with CUDA")
    built = []

    def get_rope(*args, **kwargs):
        built.append((args, kwargs))
        return OutOfPlace()

    fake = types.ModuleType(rope_inplace.LLAMA4)
    fake.get_rope = get_rope
    monkeypatch.setitem(sys.modules, rope_inplace.LLAMA4, fake)
    try:
        rope_inplace.install_llama4()
        rope_inplace.install_llama4()  # idempotent: wrapped once
        rope = fake.get_rope(8, rotary_dim=8)
        assert built == [((8,), {"rotary_dim": 8})]
        assert isinstance(rope.inner, OutOfPlace)
        q, k = torch.randn(2, 8), torch.randn(2, 8)
        want = OutOfPlace()(torch.tensor([1, 2]), q.clone(), k.clone())
        rope(torch.tensor([1, 2]), q, k)
        torch.testing.assert_close((q, k), want)
    finally:
        rope_inplace.uninstall_llama4()
    assert fake.get_rope is get_rope

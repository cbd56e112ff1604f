"""AuxHiddenStatePacker semantics and every error (patch aux-packer)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.guards("aux-packer"), pytest.mark.bases("0.5.13.post1")]


@pytest.fixture(scope="module")
def aux():
    from sglang.srt.layers import aux_hidden_states

    return aux_hidden_states


def _caps(k, leading=(5,), hidden=4, dtype=torch.float32):
    return [torch.randn(*leading, hidden).to(dtype) for _ in range(k)]


@pytest.mark.parametrize("leading", [(5,), (0,), (2, 3)])
def test_packs_like_cat(aux, leading):
    caps = _caps(3, leading)
    packer = aux.AuxHiddenStatePacker(3)
    for i, c in enumerate(caps):
        assert len(packer) == i
        packer.append(c)
    out = packer.finalize()
    assert out.shape == (*leading, 12)
    assert torch.equal(out, torch.cat(caps, dim=-1))


def test_buffer_allocated_once_on_first_append_with_its_dtype_and_device(aux):
    packer = aux.AuxHiddenStatePacker(2)
    c0, c1 = _caps(2, dtype=torch.float64)
    packer.append(c0)
    buf = packer._buffer if hasattr(packer, "_buffer") else None
    packer.append(c1)
    out = packer.finalize()
    assert out.dtype == torch.float64 and out.device == c0.device
    if buf is not None:
        assert out.data_ptr() == buf.data_ptr()


def test_append_copies(aux):
    assert aux.AuxHiddenStatePacker.copies_on_append is True
    c = torch.ones(3, 4)
    packer = aux.AuxHiddenStatePacker(1)
    packer.append(c)
    c.add_(5)  # a later in-place update of the captured tensor
    out = packer.finalize()
    assert torch.equal(out, torch.ones(3, 4))
    assert out.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()


def test_accepts_non_contiguous_capture(aux):
    base = torch.randn(4, 8)
    view = base[:, ::2]
    packer = aux.AuxHiddenStatePacker(2)
    packer.append(view)
    packer.append(view * 2)
    assert torch.equal(packer.finalize(), torch.cat([view, view * 2], dim=-1))


@pytest.mark.parametrize(
    "bad, what",
    [
        (torch.zeros(6, 4), "leading shape"),
        (torch.zeros(5, 3), "hidden size"),
        (torch.zeros(5, 4, dtype=torch.float16), "dtype"),
        (torch.zeros(5, 4, device="meta"), "device"),
    ],
)
def test_mismatched_append_is_refused_naming_expected_and_got(aux, bad, what):
    packer = aux.AuxHiddenStatePacker(3)
    packer.append(torch.zeros(5, 4))
    with pytest.raises((ValueError, RuntimeError)) as exc:
        packer.append(bad)
    msg = str(exc.value)
    assert what in msg
    assert "expected" in msg
    assert len(packer) == 1  # nothing half-appended


def test_too_many_appends(aux):
    packer = aux.AuxHiddenStatePacker(2)
    packer.append(torch.zeros(2, 4))
    packer.append(torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="expected 2"):
        packer.append(torch.zeros(2, 4))
    assert len(packer) == 2


@pytest.mark.parametrize("appended", [0, 1, 2])
def test_finalize_with_wrong_count(aux, appended):
    packer = aux.AuxHiddenStatePacker(3)
    for _ in range(appended):
        packer.append(torch.zeros(2, 4))
    with pytest.raises(RuntimeError) as exc:
        packer.finalize()
    assert "expected 3" in str(exc.value) and f"captured {appended}" in str(exc.value)


def test_zero_captures_is_refused(aux):
    with pytest.raises(ValueError):
        aux.AuxHiddenStatePacker(0)


def test_pack_aux_hidden_states(aux):
    caps = _caps(3)
    packed = aux.pack_aux_hidden_states(caps)
    assert torch.equal(packed, torch.cat(caps, dim=-1))
    assert aux.pack_aux_hidden_states(packed) is packed


def test_aliases_match_later_upstream_api(aux):
    import typing

    assert torch.Tensor in typing.get_args(aux.AuxHiddenStates)
    assert aux.AuxHiddenStatePacker in typing.get_args(aux.AuxHiddenStateAccumulator)


def test_communicator_skips_clone_for_a_collector_that_copies(sglang_tp1, tiny_model, aux):
    """The communicator hands the residual itself to a copying collector."""
    comm = tiny_model.layers[1].layer_communicator
    appended = []

    class Spy(aux.AuxHiddenStatePacker):
        def append(self, t):
            appended.append(t)
            super().append(t)

    hidden = torch.randn(4, 16, dtype=torch.float64)
    residual = torch.randn(4, 16, dtype=torch.float64)
    fb = _fb(4)
    spy = Spy(1)
    _, res = comm.prepare_attn_and_capture_last_layer_outputs(
        hidden, residual, fb, captured_last_layer_outputs=spy
    )
    assert appended[0] is res
    expected = res.clone()
    res.mul_(3)  # the in-place post-attention norm that follows on GPU
    assert torch.equal(spy.finalize(), expected)


def _fb(n):
    from harness.standins.batch import make_forward_batch

    return make_forward_batch(torch.arange(n))

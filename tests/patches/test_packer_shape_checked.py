"""0.5.23's ``AuxHiddenStatePacker.slot`` checks every capture against the first
(patch packer-capture-checked; issue 28, bug 3).

Upstream's packer checked shape and dtype on the first capture only, so a later
capture with one leading row (``[1, H]`` after ``[T, H]``) broadcast into every token's
slot without a word, and 36 models of the series collect into it. The pin's own packer
(``aux-packer``) has always checked each capture (``tests/patches/test_packer.py``).
Checked on SGLang's class: the mismatch is refused with one error naming the capture,
before anything is written; a capture too many is refused; a consistent run still packs
like ``torch.cat`` and traces with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("packer-capture-checked")

T, H, K = 5, 4, 3


@pytest.fixture(scope="module")
def packer_cls():
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker

    return AuxHiddenStatePacker


@GUARD
@pytest.mark.parametrize("later", [(1, H), (T - 1, H), (T, H + 1), (2, T, H)],
                         ids=["one-row", "fewer-rows", "wider", "extra-dim"])
@pytest.mark.parametrize("how", ["append", "slot"])
def test_later_capture_unlike_the_first_refused(packer_cls, later, how):
    packer = packer_cls(K)
    packer.append(torch.randn(T, H))
    before = packer._buffer.clone()
    bad = torch.randn(*later)
    message = f"capture 1 is {tuple(later)}, the first was {(T, H)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        packer.append(bad) if how == "append" else packer.slot(bad)
    # Bitwise: the slots not yet written are uninitialised memory, which may hold NaN.
    assert torch.equal(packer._buffer.view(torch.int32), before.view(torch.int32)), \
        "the refused capture wrote into the buffer"
    assert len(packer) == 1


@GUARD
@pytest.mark.parametrize("out", [False, True], ids=["own-buffer", "graph-buffer"])
def test_one_capture_too_many_refused(packer_cls, out):
    """Refused before it counts: the K captures taken stay a whole result (upstream's
    count went on to K + 1 and ``finalize`` then raised)."""
    buffer = torch.empty(T, K * H) if out else None
    packer = packer_cls(K, out=buffer)
    caps = [torch.randn(T, H) for _ in range(K)]
    for c in caps:
        packer.append(c)
    with pytest.raises(RuntimeError, match=f"capture {K + 1}: only {K} expected"):
        packer.append(torch.randn(T, H))
    assert torch.equal(packer.finalize(), torch.cat(caps, dim=-1))


def test_consistent_captures_pack_like_cat_and_trace_fullgraph(packer_cls):
    caps = [torch.randn(T, H) for _ in range(K)]

    def pack(a, b, c):
        packer = packer_cls(K)
        for x in (a, b, c):
            packer.append(x * 2)
        return packer.finalize()

    # Dynamo is on only for this compile (the suites' rank processes run with it off).
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(pack, backend="eager", fullgraph=True)
        got = compiled(*caps)
        torch._dynamo.reset()
    assert torch.equal(got, torch.cat([c * 2 for c in caps], dim=-1))
    assert torch.equal(pack(*caps), got)

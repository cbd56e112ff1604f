"""The parity checkpoints' common prepare step can see a wrong value.

transformers initialises every norm weight to 1 (Gemma's to 0), every bias to 0 and
Gemma 4's layer scalars to 1, where a capture taken through the wrong norm, a norm weight
that failed to load or a bias left out give the same numbers as the right ones.
``harness.parity.reference.perturb`` moves every 1-D tensor of every family's checkpoint
off those values before the family's own ``prepare``. Per family (transformers only, no
SGLang):

* ``test_every_1d_tensor_moves``: the checkpoint ``make_checkpoint`` writes differs from
  the one it writes without the step in every element of every 1-D tensor it holds;
* ``test_pre_and_post_norm_differ``: on the perturbed checkpoint, the stream entering
  transformers' final norm (a ``pre_norm`` last-layer capture) and the norm's output
  (``hidden_states[L]``, a ``post_norm`` one) differ, at every forward's rows, by far
  more than the tolerance the parity tier compares with (``MARGIN`` times it): a last
  capture taken on the wrong side of the final norm fails there, in every family.
"""

from __future__ import annotations

import pytest

from harness.parity import reference
from harness.parity.families import BOTH_BASES, families

pytestmark = [pytest.mark.bases(*BOTH_BASES), pytest.mark.parity]

# How many times the parity tier's tolerance the pre- and post-norm references must be
# apart, at least, in every family.
MARGIN = 100


def _family(name: str):
    from harness.patchset.layout import layout

    fam = families()[name]
    if layout().label not in fam.bases:
        pytest.skip(f"{name}: not on this base")
    return fam


def _saved(directory) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.parametrize("name", sorted(families()))
def test_every_1d_tensor_moves(name, tmp_path):
    fam = _family(name)
    reference.make_checkpoint(fam, tmp_path / "perturbed")
    reference.make_checkpoint(fam, tmp_path / "init", perturbed=False)
    moved, kept = _saved(tmp_path / "perturbed"), _saved(tmp_path / "init")
    assert moved.keys() == kept.keys()
    one_d = [k for k, t in moved.items() if t.dim() == 1 and t.is_floating_point()]
    assert one_d, f"{name}: the checkpoint holds no 1-D tensor"
    same = {k: int((moved[k] == kept[k]).sum()) for k in one_d if (moved[k] == kept[k]).any()}
    assert not same, (
        f"{name}: elements left at transformers' init by the common perturbation: {same}"
    )


@pytest.mark.parametrize("name", sorted(families()))
def test_pre_and_post_norm_differ(name):
    fam = _family(name)
    model = reference.hf_model(fam)
    vocab_size = fam.config()["vocab_size"]
    ref = reference.reference(fam, model, reference.prompts(vocab_size),
                              reference.appended_tokens(vocab_size))
    L = ref["num_layers"]
    for mode, forward in (("extend", ref), *ref["modes"].items()):
        post = forward["hidden_states"][L]
        tolerance = fam.atol * max(float(post.abs().max()), 1.0)
        apart = float((forward["pre_norm"] - post).abs().max())
        assert apart > MARGIN * tolerance, (
            f"{name} {mode}: the pre_norm and post_norm references differ by {apart:.3g}, "
            f"not more than {MARGIN} x the tier's tolerance {tolerance:.3g}"
        )

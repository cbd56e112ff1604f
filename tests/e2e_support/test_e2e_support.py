"""The real-engine tier's pure helpers, without an Engine (in ``make test``): the
perturbation of constant-initialised tensors, the verify-tree reading of the probe and
the rows of ``meta_info["hidden_states"]``."""

from __future__ import annotations

import torch

from harness.e2e import checkpoints, features, probe


def test_perturb_changes_every_constant_tensor_and_nothing_else():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with torch.no_grad():
        model[0].bias.zero_()
        model[1].weight.fill_(1.0)
        model[1].bias.zero_()
    weight = model[0].weight.detach().clone()
    done = checkpoints.perturb(model, seed=1)
    assert sorted(done) == ["0.bias", "1.bias", "1.weight"]
    assert torch.equal(model[0].weight, weight)  # random already: left alone
    for t in (model[0].bias, model[1].weight, model[1].bias):
        assert t.unique().numel() == t.numel()  # no constant left
    again = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with torch.no_grad():
        again[0].weight.copy_(weight)
        again[0].bias.zero_()
    checkpoints.perturb(again, seed=1)
    assert torch.equal(again[0].bias, model[0].bias)  # seeded


def _full_mask(prefix: int, paths: list[list[int]]) -> list[bool]:
    n = len(paths)
    rows = []
    for path in paths:
        rows += [True] * prefix + [c in path for c in range(n)]
    return rows


def test_tree_ancestors_reads_each_request_block():
    # request 0: a chain of 3 after 5 tokens; request 1: a tree (root, two children,
    # a grandchild of the second) after 2 tokens
    chain = [[0], [0, 1], [0, 1, 2]]
    tree = [[0], [0, 1], [0, 2], [0, 2, 3]]
    n = 4
    chain4 = chain + [[0, 1, 2, 3]]
    mask = torch.tensor(_full_mask(5, chain4) + _full_mask(2, tree) + [False] * 3)  # a longer buffer
    positions = [5, 6, 7, 8, 2, 3, 3, 4]
    assert probe._tree_ancestors(mask, positions, n, 2) == chain4 + tree
    assert probe._tree_ancestors(None, positions, n, 2) is None
    # read with a wrong prefix, rows no longer attend to themselves: not this layout
    assert probe._tree_ancestors(mask, [4, 5, 6, 7, 2, 3, 3, 4], n, 2) is None


def test_rows_of_flattens_prefill_lists_and_decode_rows():
    rows = features.rows_of([[[1.0, 2.0], [3.0, 4.0]], [5.0, 6.0], [7.0, 8.0]])
    assert rows.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
    assert features.rows_of(None).shape[0] == 0


def test_compare_rows_scales_with_the_row_and_names_the_slot():
    want = torch.tensor([[100.0, 1.0, 1.0, 1.0]])
    ok = want + torch.tensor([[0.0, 0.01, 0.0, 0.0]])  # 1e-2 beside 100: float32 noise there
    assert features.compare_rows(ok, want, 2, ["a", "b"], 2e-4, 2e-4) is None
    bad = want + torch.tensor([[0.0, 0.0, 0.0, 0.5]])
    problem = features.compare_rows(bad, want, 2, ["a", "the last layer's"], 2e-4, 2e-4)
    assert problem.startswith("slot 1 (the last layer's): max error 0.5")
    assert features.compare_rows(want[:, :2], want, 2, ["a"], 2e-4, 2e-4).startswith("shape")

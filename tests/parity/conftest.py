"""Shared by the parity modules: which of their cases this session runs."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def selected_cases(request):
    """``selected_cases(module)``: {family: the TPs of its selected cases} among this
    session's tests in ``module`` (after ``-k`` and ``--guards``). Only those families
    get transformers references and rank runs, and only those TPs get rank pools: an
    ablation run that guards one family does not pay for all of them."""

    def select(module: str) -> dict:
        out: dict = {}
        for item in request.session.items:
            spec = getattr(item, "callspec", None)
            if spec is not None and item.nodeid.split("::", 1)[0].endswith(module):
                out.setdefault(spec.params["name"], set()).add(spec.params["tp"])
        return out

    return select

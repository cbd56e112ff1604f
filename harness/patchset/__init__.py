"""Patch tooling: the pin and the series (domain), git and PyPI (plumbing), and the
verbs that use them: apply-patches, export-patches, check-patches, build-wheel,
install-wheel, lock. Data flows one way: verbs -> layout/pin/series -> git/pypi."""

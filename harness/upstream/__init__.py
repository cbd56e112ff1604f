"""Upstream tracking: which later releases carry our patches (``upstream-status``, static
probes), moving the pin (``rebase``), and PR bundles (``pr-export``, with the upstream
test templates in ``templates/``)."""

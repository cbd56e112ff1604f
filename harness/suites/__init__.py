"""Regression suites: the ``test``, ``test-gpu`` and ``ablation`` verbs, and the capture
cases that ranks run (``capture``)."""

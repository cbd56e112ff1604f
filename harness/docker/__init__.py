"""Docker: the locally built base image (``docker-base``), the CPU image and its test
run (``docker-test``), the engine they need, and the helpers that run inside
``docker build`` (``python -m harness.docker apply-onto DIR``)."""

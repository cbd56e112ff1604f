"""Pure-torch versions of GPU kernels that SGLang's models call with no CPU path.

One module per kernel group, each the same op as the GPU kernel (same arguments, same
outputs, same in-place updates), each with a unit test in ``tests/standins/`` against
the op's definition. The HF parity tier installs them through a family's ``setup``
hook (``harness.parity.families``); nothing here is used on a GPU.
"""

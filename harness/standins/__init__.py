"""CPU stand-ins: GPU-only kernels replaced by CPU versions with the same aliasing, and
tiny real SGLang models whose attention and MLP/MoE compute are TP-sharded stand-ins.

``kernels``: RMSNorm, FlashInfer / aiter fused all-reduce references, ``fusion_mode``.
``blocks``: exact integer-grid sharded compute blocks. ``batch``: real ``ForwardBatch``
objects. One module per model family (``deepseek_v2``, ...).
"""

"""Triton kernels for the rule backwards, shipped as ``pyattr.kernels``.

One module per rule family: ``identity``, ``half``, ``gated``, ``layer_norm``,
``rms_norm``. They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``
(how CI tests them). Every kernel loads, casts to float32 (float64 stays float64),
computes, and casts once on store; offsets are int64; masks cover any size.
"""

KERNELS_READY = True

"""Triton kernels for the rule backwards, shipped as ``pyattr.kernels``.

One module per rule family (``identity``, ``half``, ``gated``, ``layer_norm``,
``rms_norm``) lands here with the Triton backend. Until then ``KERNELS_READY`` is False
and :func:`pyattr.available_backends` reports the ``triton`` backend as unavailable.
"""

KERNELS_READY = False

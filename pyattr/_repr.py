"""A short ``repr`` for the result dataclasses: the generated one printed every tensor in
full (a 2-layer model's layer relevance ran to about 1,400 lines). Tensors show as their
shape and dtype, long sequences and mappings as their size."""

from __future__ import annotations

import dataclasses


def _short(value) -> str:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return f"tensor({value.item():.6g}, {str(value.dtype).replace('torch.', '')})"
        return f"Tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        keys = list(value)
        shown = ", ".join(f"{k!r}: …" for k in keys[:3])
        return "{" + shown + (f", … ({len(keys)} keys)" if len(keys) > 3 else "") + "}"
    if isinstance(value, (list, tuple)) and len(value) > 4:
        return f"[{len(value)} items]"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def summary_repr(self) -> str:
    """``ClassName(field=…, …)`` with tensors as ``Tensor(shape) dtype``."""
    names = [f.name for f in dataclasses.fields(self)] if dataclasses.is_dataclass(self) else list(vars(self))
    return f"{type(self).__name__}(" + ", ".join(f"{n}={_short(getattr(self, n))}" for n in names) + ")"

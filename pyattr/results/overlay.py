"""Patch relevance drawn over the image the model saw (numpy only): the image in muted grey
(its luminance mapped into a light band, so that whatever its own colours the only hues on
the map are the relevance's), red for positive and blue for negative relevance, opacity
``alpha · |v| / max |v|``, one flat block per patch as the model cut the image. The
notebook view and ``plot()`` of an image result draw it, and the CLI's ``--png``."""

from __future__ import annotations

_GREY_LO, _GREY_HI = 96.0, 224.0
_RED, _BLUE = (255.0, 0.0, 0.0), (0.0, 0.0, 255.0)
#: opacity of the colour at the patches' largest |relevance|
ALPHA = 0.85
# the map is drawn at least this many pixels on its shorter side
_MIN_MAP_PIXELS = 192
# each patch is drawn this many pixels wide at least, so that small inputs stay readable
_MIN_PATCH_PIXELS = 16


def _grey(seen):
    """``seen`` (H×W×3 uint8) as muted grey, float."""
    import numpy as np

    lum = seen[..., :3].astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    g = _GREY_LO + (_GREY_HI - _GREY_LO) * lum / 255.0
    return np.repeat(g[..., None], 3, axis=2)


def _blend(base, v, peak: float, alpha: float):
    """``base`` (…×3) under the colour of relevance ``v`` (…): red for positive, blue for
    negative, opacity ``alpha · |v| / peak``."""
    import numpy as np

    a = (np.abs(v) / peak if peak > 0 else np.zeros_like(v)) * alpha
    color = np.where((v >= 0)[..., None], _RED, _BLUE)
    return base * (1 - a[..., None]) + color * a[..., None]


def map_scale(shape, patch, min_side: int = _MIN_MAP_PIXELS) -> int:
    """The whole-pixel upscale of the map: a patch at least 16 pixels wide, the image at
    least ``min_side`` pixels on its shorter side."""
    rows, cols = shape
    ph, pw = patch
    by_patch = -(-_MIN_PATCH_PIXELS // max(1, min(ph, pw)))
    by_image = -(-min_side // max(1, min(rows * ph, cols * pw))) if min_side > 0 else 1
    return max(1, by_patch, by_image)


def overlay_rgb(seen, patch_rel, patch, alpha: float = ALPHA, min_side: int = _MIN_MAP_PIXELS):
    """The overlay as an H×W×3 uint8 array: ``seen`` (H×W×3 uint8) in grey under the patch
    relevance ``patch_rel`` (rows × cols tensor or array), one block per ``patch`` (ph, pw)
    pixels (pixels past the last whole patch are left out), upscaled by
    :func:`map_scale` (``min_side``: the shorter side at least that many pixels; 0: a patch
    at least 16 pixels, no more)."""
    import numpy as np

    v = patch_rel.detach().double().numpy() if hasattr(patch_rel, "detach") else np.asarray(patch_rel, dtype=float)
    rows, cols = v.shape
    ph, pw = patch
    peak = float(np.nanmax(np.abs(v))) if v.size and np.isfinite(np.abs(v)).any() else 0.0
    base = _grey(seen[: rows * ph, : cols * pw])
    out = _blend(base, np.kron(np.nan_to_num(v), np.ones((ph, pw))), peak, alpha)
    rgb = out.round().clip(0, 255).astype(np.uint8)
    k = map_scale((rows, cols), patch, min_side)
    return np.repeat(np.repeat(rgb, k, axis=0), k, axis=1) if k > 1 else rgb


def display_image(pixel_values):
    """An image batch (batch, channels, height, width) as uint8 (batch, height, width, 3)
    for display: each image scaled from its own min..max to 0..255 (the processor's
    normalisation is not known here; the overlay shows it in grey anyway), one channel
    repeated to three."""
    import torch

    x = pixel_values.detach().double()
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    hi = x.amax(dim=(1, 2, 3), keepdim=True)
    x = (x - lo) / (hi - lo).clamp_min(1e-12) * 255.0
    x = x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    if x.shape[-1] == 1:
        x = x.expand(*x.shape[:-1], 3)
    return x[..., :3].contiguous()

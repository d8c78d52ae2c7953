"""``pyattr explain --image``: patch relevance of an image classifier's class logit,
drawn over the image the model saw (Pillow).

The relevance is measured at the patch embeddings as the first block sees them (patch
projection, [CLS] token and position embeddings added), so each patch gets one value
and the [CLS] token one more (:meth:`pyattr.RelevanceResult.patch_relevance`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from pyattr.backends import available_backends
import pyattr.apps.contention as _contention
from pyattr.apps.explain import ExplainError, Explanation, Segment, model_label, one_row_explanation
from pyattr.config import RelevanceRules
from pyattr.methods.relevance import relevance

from pyattr.results.overlay import (  # noqa: F401 - map_scale re-exported
    _GREY_HI, _GREY_LO, _MIN_MAP_PIXELS, ALPHA, _blend, map_scale, overlay_rgb)


# 8 bits per channel: what an image processor's rescale (1/255) expects
_EIGHT_BIT = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")


def _open_image(path: Path, channels: int = 3):
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ExplainError("--image needs Pillow (pip install pillow)") from None
    if not path.is_file():
        raise ExplainError(f"image {str(path)!r} does not exist or is not a file")
    try:
        with Image.open(path) as im:
            if im.mode not in _EIGHT_BIT:
                raise ExplainError(
                    f"image {str(path)!r} has mode {im.mode!r} (more than 8 bits per channel, or floating point); "
                    "converting it to 8-bit RGB would clip it: save it as an 8-bit image first"
                )
            return im.convert("L" if channels == 1 else "RGB")
    except Image.DecompressionBombError as e:
        raise ExplainError(f"image {str(path)!r} is too large to open safely: {' '.join(str(e).split())}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ExplainError(f"cannot read image {str(path)!r}: {' '.join(str(e).split())}") from None


def _load_classifier(path):
    """The image processor and image-classification model of a local directory, the
    bundled ``squares`` or a hub id (:func:`pyattr.hub.load_image_classifier`)."""
    import pyattr.hub as hub
    from pyattr.apps.explain import _source

    _source(path)
    try:
        return hub.load_image_classifier(path)
    except hub.ModelLoadError as e:
        raise ExplainError(str(e)) from None


def class_id(model, target: Optional[str]) -> Optional[int]:
    """``--target``: a class label of ``config.id2label`` (exactly; else ignoring case and
    surrounding spaces, when that names one class), or else a class index."""
    if target is None:
        return None
    labels = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()}
    n = int(getattr(model.config, "num_labels", len(labels)) or len(labels))
    exact = [i for i, name in labels.items() if name == target]
    loose = [i for i, name in labels.items() if name.strip().lower() == target.strip().lower()]
    for hits in (exact, loose):
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ExplainError(f"--target {target!r} names {len(hits)} classes ({', '.join(map(str, sorted(hits)))}); "
                               "give the class index")
    if target.strip().lstrip("-").isdigit():
        cid = int(target)
        if not 0 <= cid < n:
            raise ExplainError(f"--target class index {cid} is outside the model's {n} classes [0, {n})")
        return cid
    some = ", ".join(repr(labels[i]) for i in sorted(labels)[:5])
    raise ExplainError(f"--target {target!r} is not one of the model's class labels ({some}{', …' if n > 5 else ''}) "
                       "nor a class index")


def _seen_image(proc, pixel_values: torch.Tensor):
    """The image the model saw (after resize and crop), as 8-bit RGB, by undoing the
    processor's normalisation and rescaling."""
    import numpy as np

    x = pixel_values[0].detach().double()
    if getattr(proc, "do_normalize", False):
        mean = torch.as_tensor(proc.image_mean, dtype=x.dtype).view(-1, 1, 1)
        std = torch.as_tensor(proc.image_std, dtype=x.dtype).view(-1, 1, 1)
        x = x * std + mean
    if getattr(proc, "do_rescale", False):
        x = x / float(proc.rescale_factor)
    arr = x.clamp(0, 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    if arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    return arr[:, :, :3]


def overlay(seen, patch_rel: torch.Tensor, patch, alpha: float = ALPHA, min_side: int = _MIN_MAP_PIXELS):
    """:func:`pyattr.results.overlay.overlay_rgb` as a Pillow RGB image (the patch relevance
    drawn over ``seen``, H×W×3 uint8, made muted grey; upscaled by :func:`map_scale`)."""
    from PIL import Image

    return Image.fromarray(overlay_rgb(seen, patch_rel, patch, alpha, min_side), "RGB")


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def relevance_map(seen, patch_rel: torch.Tensor, patch, title: str, alpha: float = ALPHA):
    """The ``--png`` figure: a title, the image as the model saw it, the relevance
    :func:`overlay`, and a colour bar beside it (the overlay's colours over the mid grey,
    ticks at -max, 0 and +max of |relevance|), with a caption that says how to read it.
    Returns ``(image, box)``: a Pillow RGB image and the overlay's ``(x, y, width,
    height)`` in it (also stored in the PNG as the text chunk ``pyattr-overlay``)."""
    import numpy as np
    from PIL import Image, ImageDraw

    from pyattr.apps.render import num

    over = overlay(seen, patch_rel, patch, alpha)
    w, h = over.size
    rows, cols = patch_rel.shape
    ph, pw = patch
    shown = Image.fromarray(np.ascontiguousarray(seen[: rows * ph, : cols * pw]), "RGB").resize((w, h), Image.NEAREST)
    peak = float(patch_rel.detach().abs().max()) if patch_rel.numel() else 0.0
    font, small = _font(14), _font(12)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def width(text, f):
        box = probe.textbbox((0, 0), text, font=f)
        return box[2] - box[0]

    pad, gap, bar_w = 12, 12, 16
    ticks = [num(peak, "+.3g"), "0", num(-peak, "+.3g")] if peak > 0 else ["+1", "0", "-1"]
    tick_w = max(width(t, small) for t in ticks) + 6
    caption = ["red: positive relevance, blue: negative; opacity grows with |relevance| (full at the",
               "patches' largest); the image is greyed so that only relevance is coloured"]
    content_w = w + gap + w + gap + bar_w + tick_w
    width_all = max(content_w, width(title, font), *(width(c, small) for c in caption)) + 2 * pad
    head, label_h, cap_h = 24, 18, 16 * len(caption) + 12
    height_all = pad + head + label_h + h + cap_h + pad
    canvas = Image.new("RGB", (width_all, height_all), "white")
    d = ImageDraw.Draw(canvas)
    d.text((pad, pad), title, fill="black", font=font)
    y0 = pad + head + label_h
    x_img, x_over = pad, pad + w + gap
    d.text((x_img, y0 - label_h), "the image the model saw", fill="#333", font=small)
    d.text((x_over, y0 - label_h), "patch relevance", fill="#333", font=small)
    canvas.paste(shown, (x_img, y0))
    canvas.paste(over, (x_over, y0))
    # the bar: top +peak, bottom -peak, each row the overlay's colour over the mid grey
    x_bar = x_over + w + gap
    vals = np.linspace(1.0, -1.0, h)
    mid = np.full((h, 3), (_GREY_LO + _GREY_HI) / 2)
    col = _blend(mid, vals, 1.0, alpha).round().clip(0, 255).astype(np.uint8)
    canvas.paste(Image.fromarray(np.repeat(col[:, None, :], bar_w, axis=1), "RGB"), (x_bar, y0))
    d.rectangle([x_bar - 1, y0 - 1, x_bar + bar_w, y0 + h], outline="#666")
    for t, y in zip(ticks, (y0, y0 + h // 2, y0 + h - 1)):
        d.line([x_bar + bar_w, y, x_bar + bar_w + 3, y], fill="#333")
        box = d.textbbox((0, 0), t, font=small)
        d.text((x_bar + bar_w + 5, y - (box[3] + box[1]) // 2), t, fill="black", font=small)
    for i, c in enumerate(caption):
        d.text((pad, y0 + h + 12 + 16 * i), c, fill="#333", font=small)
    return canvas, (x_over, y0, w, h)


def save_map(path, seen, patch_rel: torch.Tensor, patch, title: str) -> bytes:
    """Write :func:`relevance_map` to ``path`` as PNG (the overlay's box in its text chunk
    ``pyattr-overlay``: ``x,y,width,height``); returns the bare overlay as PNG bytes, a
    patch 16 pixels wide at least (the HTML page draws it larger, in whole multiples, under
    its hover grid)."""
    import io

    from PIL.PngImagePlugin import PngInfo

    fig, box = relevance_map(seen, patch_rel, patch, title)
    info = PngInfo()
    info.add_text("pyattr-overlay", ",".join(map(str, box)))
    fig.save(path, format="PNG", pnginfo=info)
    buf = io.BytesIO()
    overlay(seen, patch_rel, patch, min_side=0).save(buf, format="PNG")
    return buf.getvalue()


def explain_image(
    model_dir: Path,
    image_path: Path,
    target: Optional[str] = None,
    rules: Optional[RelevanceRules] = None,
    png: Optional[Path] = None,
    generic: bool = False,
) -> Explanation:
    """Relevance of each patch of an image (and its [CLS] token) for a class logit of an
    image classifier (top-1, or ``target``: a label or index); the patch map is written
    over the processed image to ``png`` (default: ``<image stem>_relevance.png`` in the
    current directory). ``generic``: a vision transformer without a rule map, through
    structural discovery.

    Raises:
        ExplainError: unreadable image or model directory, a model that is not an image
            classifier, an unknown ``target`` label, an unwritable ``png``.
    """
    monitor = _contention.start()
    proc, model = _load_classifier(model_dir)
    vcfg = getattr(model.config, "vision_config", None) or model.config
    image = _open_image(Path(image_path), int(getattr(vcfg, "num_channels", 3) or 3))
    rules = RelevanceRules.all() if rules is None else rules
    cid = class_id(model, target)
    pixel_values = proc(images=image, return_tensors="pt")["pixel_values"].float()
    available_backends()  # probe (imports, extension load) outside the timed pass
    t0 = time.perf_counter()
    try:
        res = relevance(model, pixel_values, target=cid, rules=rules, generic=generic)
    except ValueError as e:
        if "doesn't match model" not in str(e):
            raise
        raise ExplainError(
            f"the image processor makes {tuple(pixel_values.shape[-2:])} images, the model takes "
            f"{getattr(vcfg, 'image_size', '?')}: set the processor's size to the model's image_size "
            f"({' '.join(str(e).split())})") from None
    wall = time.perf_counter() - t0
    cond = monitor.stop()
    grid = res.patch_relevance()[0]
    rows, cols = res.patch_grid
    out = Path(png) if png is not None else Path(f"{Path(image_path).stem}_relevance.png")
    chosen = int(res.target_ids[0])
    label = (getattr(model.config, "id2label", None) or {}).get(chosen, str(chosen))
    description = f"class logit of {label!r} (class {chosen}{', top-1' if cid is None else ''})"
    try:
        p = getattr(vcfg, "patch_size", 16)
        bare = save_map(out, _seen_image(proc, pixel_values), grid, (p, p) if isinstance(p, int) else tuple(p),
                        f"{model_label(model_dir)}: {description}")
    except OSError as e:
        raise ExplainError(f"cannot write {str(out)!r}: {e.strerror or e}") from None
    tokens = ["[CLS]"] + [f"patch({r},{c})" for r in range(rows) for c in range(cols)]
    return one_row_explanation(
        "image", model_label(model_dir), description,
        res, model, rules, wall, cond, [Segment(str(image_path), tokens, [float(v) for v in res.token_relevance[0]])],
        patch_grid=(rows, cols), image_png=str(out), image_overlay=bare)

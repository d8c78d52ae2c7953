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
from pyattr.apps.explain import (ExplainError, Explanation, Segment, _check_dir, _config_type, _offline,
                            one_row_explanation)
from pyattr.config import RelevanceRules
from pyattr.methods.relevance import relevance

# each patch is drawn this many pixels wide at least, so that small inputs stay readable
_MIN_PATCH_PIXELS = 16


# 8 bits per channel: what an image processor's rescale (1/255) expects
_EIGHT_BIT = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")


def _open_image(path: Path, channels: int = 3):
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ExplainError("--image needs Pillow (pip install -e '.[demo]')") from None
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


def _load_classifier(path: Path):
    """The image processor and image-classification model of a local directory."""
    _offline()
    _check_dir(path)
    try:
        from transformers import AutoImageProcessor, AutoModelForImageClassification
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ExplainError("transformers is not installed (pip install -e '.[hf]')") from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if not (path / "preprocessor_config.json").is_file():
        raise ExplainError(
            f"model directory {str(path)!r} has no preprocessor_config.json; save the image processor next "
            "to the model (image_processor.save_pretrained(DIR))"
        )
    try:
        proc = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        model, info = AutoModelForImageClassification.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for broken dirs
        text = " ".join(str(e).split()) or type(e).__name__
        if "Unrecognized configuration class" in text:
            raise ExplainError(
                f"model directory {str(path)!r} holds a {_config_type(path)!r} model, which is not an image "
                "classifier (transformers has no AutoModelForImageClassification for it); --image needs one "
                "(ViTForImageClassification, CLIPForImageClassification)"
            ) from None
        raise ExplainError(f"cannot load model from {str(path)!r}: {text[:400]}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ExplainError(
            f"model directory {str(path)!r} has no weights for {', '.join(missing[:3])}"
            f"{' …' if len(missing) > 3 else ''}: it is not a complete image classifier, and those weights "
            "would be random"
        )
    return proc, model.eval()


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


def overlay(seen, patch_rel: torch.Tensor, patch, alpha: float = 0.6):
    """Patch relevance drawn over ``seen`` (H×W×3 uint8): red for positive, blue for
    negative, opacity ``alpha · |v| / max |v|``; one flat block per ``patch`` (ph, pw)
    pixels, as the model cut the image (pixels past the last whole patch are left out).
    Returns a Pillow RGB image, upscaled so that a patch is at least 16 pixels wide."""
    import numpy as np
    from PIL import Image

    rows, cols = patch_rel.shape
    ph, pw = patch
    scale = max(1, -(-_MIN_PATCH_PIXELS // max(1, min(ph, pw))))
    v = patch_rel.detach().double()
    peak = float(v.abs().max())
    a = (v.abs() / peak if peak > 0 else torch.zeros_like(v)) * alpha
    layer = np.zeros((rows * ph, cols * pw, 4), dtype=np.float64)
    color = np.where((v >= 0).numpy()[..., None], [255.0, 0.0, 0.0], [0.0, 64.0, 255.0])
    layer[..., :3] = np.kron(color, np.ones((ph, pw, 1)))
    layer[..., 3] = np.kron(a.numpy(), np.ones((ph, pw)))
    base = seen[: rows * ph, : cols * pw].astype(np.float64)
    out = base * (1 - layer[..., 3:]) + layer[..., :3] * layer[..., 3:]
    im = Image.fromarray(out.round().clip(0, 255).astype(np.uint8), "RGB")
    return im.resize((im.width * scale, im.height * scale), Image.NEAREST) if scale > 1 else im


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
    proc, model = _load_classifier(Path(model_dir))
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
    try:
        p = getattr(vcfg, "patch_size", 16)
        overlay(_seen_image(proc, pixel_values), grid, (p, p) if isinstance(p, int) else tuple(p)).save(out, format="PNG")
    except OSError as e:
        raise ExplainError(f"cannot write {str(out)!r}: {e.strerror or e}") from None
    chosen = int(res.target_ids[0])
    label = (getattr(model.config, "id2label", None) or {}).get(chosen, str(chosen))
    tokens = ["[CLS]"] + [f"patch({r},{c})" for r in range(rows) for c in range(cols)]
    return one_row_explanation(
        "image", str(model_dir), f"class logit of {label!r} (class {chosen}{', top-1' if cid is None else ''})",
        res, model, rules, wall, cond, [Segment(str(image_path), tokens, [float(v) for v in res.token_relevance[0]])],
        patch_grid=(rows, cols), image_png=str(out))

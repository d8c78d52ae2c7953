"""A tiny trained image classifier whose evidence is known: the colour of one square.

An image is 32 × 32 pixels of grey noise with one coloured square on it (side 8 to 12
pixels, anywhere, red, green or blue with a little jitter). The class is the square's
colour, so the evidence for the class is the patches the square covers and nothing else:
a person can check an image explanation by eye, and a test can measure it.

The model is a 2-layer, 2-head ``ViTForImageClassification`` (hidden 32, MLP width 64,
patch 8: a 4 × 4 patch grid plus [CLS]) with its ``ViTImageProcessor``, about 0.1 MB.
``python -m pyattr.toy.vision [DIR]`` trains it deterministically on the CPU (one thread,
fixed seed: the same weights) and writes it to ``DIR`` (default: the copy shipped in the
package, :data:`pyattr.toy.SQUARES_DIR`); :func:`pyattr.toy.load_squares` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Tuple

import torch

from pyattr.toy.fit import fit, one_thread, train_main

#: Where the shipped model lives.
SHIPPED = Path(__file__).resolve().parent / "squares"

#: The classes, in label order.
LABELS = ("red", "green", "blue")
#: Image side in pixels, patch side in pixels.
SIZE, PATCH = 32, 8
#: Smallest and largest side of the square, in pixels.
SIDES = (8, 12)
#: RGB of each class before jitter.
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 40), "blue": (40, 60, 220)}

SEED = 0
STEPS = 600
BATCH = 64
LR = 3e-3


def draw(generator: torch.Generator, count: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` images of the task.

    Returns:
        ``(images, labels, boxes)``: ``images`` ByteTensor[count, 3, 32, 32], RGB, grey
        noise in [60, 190] and one square; ``labels`` LongTensor[count], the square's
        colour as an index into ``LABELS``; ``boxes`` LongTensor[count, 4], each square's
        ``(top, left, bottom, right)`` in pixels, bottom and right exclusive.
    """
    grey = torch.randint(60, 191, (count, 1, SIZE, SIZE), generator=generator)
    images = grey.expand(count, 3, SIZE, SIZE).clone()
    labels = torch.randint(len(LABELS), (count,), generator=generator)
    sides = torch.randint(SIDES[0], SIDES[1] + 1, (count,), generator=generator)
    boxes = torch.empty(count, 4, dtype=torch.long)
    jitter = torch.randint(-20, 21, (count, 3), generator=generator)
    for i in range(count):
        s = int(sides[i])
        top = int(torch.randint(SIZE - s + 1, (1,), generator=generator))
        left = int(torch.randint(SIZE - s + 1, (1,), generator=generator))
        rgb = (torch.tensor(COLOURS[LABELS[int(labels[i])]]) + jitter[i]).clamp(0, 255)
        images[i, :, top:top + s, left:left + s] = rgb.view(3, 1, 1)
        boxes[i] = torch.tensor([top, left, top + s, left + s])
    return images.to(torch.uint8), labels, boxes


def image(label: str, top: int, left: int, side: int = 10, seed: int = 0):
    """One image of the task as a ``PIL.Image``: a ``label``-coloured square of ``side``
    pixels at ``(top, left)`` on grey noise drawn with ``seed``."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    grey = torch.randint(60, 191, (SIZE, SIZE), generator=g, dtype=torch.long)
    pixels = grey.unsqueeze(-1).expand(SIZE, SIZE, 3).clone()
    pixels[top:top + side, left:left + side] = torch.tensor(COLOURS[label])
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images → the pixel values the image processor gives (rescale to [0, 1], then
    mean 0.5, std 0.5 per channel)."""
    return (images.float() / 255.0 - 0.5) / 0.5


def config():
    """The ViT's configuration (no dropout; labels from ``LABELS``)."""
    from transformers import ViTConfig

    return ViTConfig(
        image_size=SIZE, patch_size=PATCH, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, id2label=dict(enumerate(LABELS)),
        label2id={l: i for i, l in enumerate(LABELS)},
    )


#: ``preprocessor_config.json``: the ``ViTImageProcessor`` that turns an image into the
#: model's pixel values (resize to 32 × 32, rescale to [0, 1], mean 0.5, std 0.5), written
#: as JSON so that any transformers version reads it (and no image backend is needed to
#: write it).
PROCESSOR = {
    "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "ViTImageProcessor", "image_std": [0.5, 0.5, 0.5], "resample": 2,
    "rescale_factor": 1 / 255, "size": {"height": SIZE, "width": SIZE},
}


def train(steps: int = STEPS, seed: int = SEED, log=None):
    """The trained ``ViTForImageClassification`` (eval mode, float32). AdamW, one-cycle
    learning rate, fresh images every step."""
    from transformers import ViTForImageClassification

    with one_thread():  # the same sums in the same order on every machine
        torch.manual_seed(seed)
        model = ViTForImageClassification(config()).float()
        model.config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(seed)

        def loss():
            images, labels, _ = draw(g, BATCH)
            return torch.nn.functional.cross_entropy(model(pixel_values=normalise(images)).logits, labels)

        return fit(model, loss, steps, LR, log)


@torch.no_grad()
def accuracy(model, count: int = 512, seed: int = 1) -> float:
    """Top-1 accuracy on ``count`` fresh images."""
    images, labels, _ = draw(torch.Generator().manual_seed(seed), count)
    pred = model(pixel_values=normalise(images)).logits.argmax(-1)
    return (pred == labels).float().mean().item()


def square_patches(boxes: torch.Tensor) -> torch.Tensor:
    """BoolTensor[count, 4, 4]: the patches each box overlaps."""
    n = SIZE // PATCH
    edges = torch.arange(n) * PATCH
    rows = (edges + PATCH > boxes[:, None, 0]) & (edges < boxes[:, None, 2])
    cols = (edges + PATCH > boxes[:, None, 1]) & (edges < boxes[:, None, 3])
    return rows[:, :, None] & cols[:, None, :]


def save(model, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None) -> int:
    a, model, meta = train_main(argv, "python -m pyattr.toy.vision", __doc__, SHIPPED, STEPS, SEED, train, accuracy)
    save(model, Path(a.out), {**meta, "batch": BATCH, "lr": LR})
    print(f"saved to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

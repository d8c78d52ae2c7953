"""``pyattr explain --image --png``: the relevance map has a colour bar, and its overlay reads
the same on any image (the image greyed, so that only relevance is coloured); the HTML page
lays its hover grid on the bare overlay."""

import base64
import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_cli
from pyattr.apps.image import ALPHA, map_scale, overlay, relevance_map

pytestmark = pytest.mark.usefixtures("one_thread")

# a 4 × 4 grid of 8-pixel patches: +1, -1, 0 and +0.5 in the first row, zeros elsewhere
REL = torch.zeros(4, 4, dtype=torch.float64)
REL[0, :4] = torch.tensor([1.0, -1.0, 0.0, 0.5])


def _flat(rgb):
    return np.full((32, 32, 3), rgb, dtype=np.uint8)


def _grey(rgb):
    """The muted grey an image colour becomes: luminance mapped into [96, 224]."""
    lum = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return 96 + 128 * lum / 255


@pytest.mark.parametrize("rgb", [(255, 0, 0), (0, 0, 255), (0, 200, 0), (255, 255, 255), (0, 0, 0)])
def test_overlay_reads_the_same_on_any_image(rgb):
    im = np.asarray(overlay(_flat(rgb), REL, (8, 8), min_side=0)).astype(int)
    assert im.shape == (64, 64, 3)  # a patch at least 16 pixels: drawn twice as large
    g = _grey(rgb)
    cell = lambda c: im[8, 16 * c + 8]  # noqa: E731 - the middle of patch (0, c)
    want = {0: (ALPHA * 255 + (1 - ALPHA) * g, (1 - ALPHA) * g, (1 - ALPHA) * g),   # red, whatever the image
            1: ((1 - ALPHA) * g, (1 - ALPHA) * g, ALPHA * 255 + (1 - ALPHA) * g),   # blue
            2: (g, g, g),                                                           # no relevance: grey
            3: (ALPHA / 2 * 255 + (1 - ALPHA / 2) * g, (1 - ALPHA / 2) * g, (1 - ALPHA / 2) * g)}
    for c, rgb_want in want.items():
        np.testing.assert_allclose(cell(c), rgb_want, atol=0.51)
    # no hue of the image itself survives: every pixel without relevance is grey
    assert (im[32:, :, 0] == im[32:, :, 1]).all() and (im[32:, :, 1] == im[32:, :, 2]).all()


def test_map_scale():
    assert map_scale((4, 4), (8, 8)) == 6           # 32 pixels -> at least 192
    assert map_scale((4, 4), (8, 8), min_side=0) == 2  # a patch at least 16 pixels
    assert map_scale((14, 14), (16, 16)) == 1       # a 224-pixel ViT input as it is


def test_relevance_map_has_the_image_the_overlay_and_a_colour_bar():
    seen = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    fig, (x, y, w, h) = relevance_map(seen, REL, (8, 8), "title")
    arr = np.asarray(fig).astype(int)
    assert (w, h) == (192, 192) and fig.size[0] > x + w + 16 and fig.size[1] > y + h
    np.testing.assert_array_equal(arr[y:y + h, x:x + w], np.asarray(overlay(seen, REL, (8, 8))))
    # left of the overlay: the image as the model saw it, 6 times as large
    np.testing.assert_array_equal(arr[y:y + h, x - 12 - w:x - 12], np.kron(seen, np.ones((6, 6, 1))).astype(int))
    # the bar, 12 pixels right of the overlay: +max red at the top, grey in the middle, -max blue at the bottom
    bar = arr[y:y + h, x + w + 12 + 8]
    mid = 160.0
    np.testing.assert_allclose(bar[0], (ALPHA * 255 + (1 - ALPHA) * mid, (1 - ALPHA) * mid, (1 - ALPHA) * mid),
                               atol=0.51)
    np.testing.assert_allclose(bar[-1], ((1 - ALPHA) * mid, (1 - ALPHA) * mid, ALPHA * 255 + (1 - ALPHA) * mid),
                               atol=0.51)
    assert abs(bar[h // 2] - mid).max() <= 2  # about zero: the mid grey
    assert (np.diff(bar[:, 0]) <= 0).all() and (np.diff(bar[:, 2]) >= 0).all()  # red fades, blue grows


def test_cli_png_and_html(tmp_path):
    from pyattr.toy.vision import image

    img, png, page = tmp_path / "red.png", tmp_path / "map.png", tmp_path / "map.html"
    image("red", 4, 14).save(img)
    r = run_cli("explain", "--model", "squares", "--image", img, "--png", png, "--html", page, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "squares (bundled)" and out["image_png"] == str(png)
    assert out["target_description"] == "class logit of 'red' (class 0, top-1)"
    fig = Image.open(png)
    x, y, w, h = map(int, fig.info["pyattr-overlay"].split(","))
    assert (w, h) == (192, 192)
    # the page: the bare overlay (a patch 16 pixels) under the hover grid, not the figure
    html = page.read_text()
    data = re.search(r'<img alt="patch relevance over the image" src="data:image/png;base64,([^"]+)"', html).group(1)
    bare = Image.open(io.BytesIO(base64.b64decode(data)))
    assert bare.size == (64, 64) and "pyattr-overlay" not in bare.info
    # the same overlay at another scale: the figure's overlay is the bare one, 3 times as large
    np.testing.assert_array_equal(np.asarray(fig)[y:y + h:3, x:x + w:3], np.asarray(bare))
    assert "Over the image, greyed so that only relevance is coloured" in html
    # the terminal: the grid, its legend, the top patches
    r = run_cli("explain", "--model", "squares", "--image", img, "--png", png)
    assert r.returncode == 0, r.stderr
    assert "legend  blue -" in r.stdout and "(full colour at the patches' largest |relevance|)" in r.stdout
    assert "top patches by |relevance|: patch(" in r.stdout

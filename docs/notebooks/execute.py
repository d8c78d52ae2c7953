"""Execute the example notebooks and store them with their outputs (the documentation
shows the stored outputs, ``render.py`` turns them into pages).

    .venv/bin/python docs/notebooks/execute.py                 # every notebook, outputs written in place
    .venv/bin/python docs/notebooks/execute.py relevance       # one (by name, without .ipynb)
    .venv/bin/python docs/notebooks/execute.py --check         # execute, compare with what is stored, write nothing

Each notebook runs from top to bottom in a fresh kernel of this Python (ipykernel; the
kernel is the interpreter running this script, e.g. ``.venv/bin/python``), offline
(``HF_HUB_OFFLINE=1``: only the bundled models), on one intra-op thread, in a temporary
working directory (what a notebook saves goes there). Needs ``nbclient``, ``nbformat``
and ``ipykernel``; pyattr itself is imported by the kernel only.

What is stored is what ran, less what depends on the machine rather than on pyattr: the
progress bars and import notices other packages print on stderr (:data:`NOISE`), the
cells' timing metadata. Anything else on stderr stays, and ``problems`` reports it.

:func:`differences` compares a stored notebook with a new execution: the same cells and
sources, the same outputs (kinds, MIME types, stream names), the same text with the
volatile parts set aside (execution counts, memory addresses, the per-view element ids of
pyattr's HTML, the name of the backend that ran, images' bytes) and every number within
one unit of its last printed digit, or within :data:`ATOL` (float32 noise: a
conservation delta of 1e-07 on one machine is 3e-07 on another).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent

#: stderr lines that are not the notebook's: the notice torchao's import makes torch print,
#: transformers' weight-loading progress bar, tqdm's complaint that ipywidgets is missing
NOISE = (
    re.compile(r"^W\d{4} [\d:.]+ +\d+ torch/utils/_pytree\.py:\d+\] .*is an Enum subclass.*$"),
    re.compile(r"^Loading weights:.*$"),
    re.compile(r"^.*TqdmWarning: IProgress not found.*$"),
    re.compile(r"^\s*from \.autonotebook import tqdm as notebook_tqdm\s*$"),
    re.compile(r"^\s*$"),
)

#: numbers closer than this compare equal whatever their printed precision (float32 noise:
#: an exact patching effect, a difference of two float32 logits near 14, moved by 1.5e-5 with
#: MKL's SSE4.2 kernels instead of this CPU's)
ATOL = 1e-4

#: the classes whose value as a cell's last expression must show pyattr's HTML view
RESULT_REPR = re.compile(r"^(RelevanceResult|LayerRelevanceResult|AttributionResult|GenerationRelevanceResult|"
                         r"PatchingResult|PerturbationCurve|GradientCapture|Captured|RelevanceAudit)\(")


def notebooks() -> List[Path]:
    """Every example notebook, by name."""
    return sorted(HERE.glob("*.ipynb"))


def find(name: str) -> Path:
    path = HERE / (name if name.endswith(".ipynb") else f"{name}.ipynb")
    if not path.is_file():
        raise SystemExit(f"no notebook {path.name} in {HERE} (have: {', '.join(p.stem for p in notebooks())})")
    return path


def kernel_env() -> dict:
    env = dict(os.environ)
    env.pop("PYATTR_BACKEND", None)  # the backend pyattr picks, as for a user
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0", PYDEVD_DISABLE_FILE_VALIDATION="1")
    return env


def execute(nb, timeout: int = 600, cwd: Optional[str] = None):
    """A copy of notebook ``nb`` (a path or a ``NotebookNode``) executed top to bottom in
    a fresh kernel, cleaned (:func:`clean`). Errors do not stop it: they stay in the
    outputs, and :func:`problems` lists them."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(nb), as_version=4) if isinstance(nb, (str, Path)) else copy.deepcopy(nb)
    from jupyter_client import KernelManager

    with tempfile.TemporaryDirectory(prefix="pyattr-notebook-") as tmp:
        # kernel "python3" is this interpreter: jupyter_client starts a kernel spec whose
        # command is "python" with sys.executable, and ipykernel's own spec is sys.executable;
        # its sockets are files in the temporary directory (no TCP port)
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(tmp, "kernel"))
        client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, record_timing=False,
                                resources={"metadata": {"path": cwd or tmp}})
        try:
            client.execute(env=kernel_env())
        finally:  # a kernel manager given to the client is not the client's to stop
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata.get("language_info", {}).pop("version", None)  # the patch release of the machine's Python
    return clean(nb)


def _noise(line: str) -> bool:
    return any(p.match(line) for p in NOISE)


def clean(nb):
    """``nb`` less the machine's noise on stderr (:data:`NOISE`) and the cells' timing
    metadata, consecutive outputs of one stream merged (in place; returned)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stderr":
                lines = re.split(r"(?<=\n)|\r", out.text)
                kept = "".join(s for s in lines if not _noise(s.rstrip("\n")))
                if not kept.strip():
                    continue
                out.text = kept
            if (out.output_type == "stream" and outputs and outputs[-1].output_type == "stream"
                    and outputs[-1].name == out.name):
                outputs[-1].text += out.text
                continue
            outputs.append(out)
        cell.outputs = outputs
    return nb


def problems(nb) -> List[str]:
    """What is wrong with an executed notebook: an error output, anything left on stderr,
    a code cell that did not run, a result shown without its HTML view."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None:
            out.append(f"cell {i}: not executed")
        for o in cell.outputs:
            if o.output_type == "error":
                out.append(f"cell {i}: {o.ename}: {o.evalue}")
            elif o.output_type == "stream" and o.name == "stderr":
                out.append(f"cell {i}: printed on stderr: {o.text.strip()[:500]}")
            elif o.output_type == "execute_result":
                plain = o.data.get("text/plain", "")
                if RESULT_REPR.match(plain) and "pyattr-result" not in o.data.get("text/html", ""):
                    out.append(f"cell {i}: a {plain.split('(')[0]} shown without its HTML view")
    return out


def result_views(nb) -> List[tuple]:
    """``(cell index, html)`` of every pyattr HTML view among the notebook's outputs."""
    views = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            html = o.get("data", {}).get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            if "pyattr-result" in html:
                views.append((i, html))
    return views


# ------------------------------------------------------------------------------ comparison

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_VOLATILE = (
    (re.compile(r"\bpyattr-[0-9a-f]{10}-"), "pyattr-ID-"),  # element ids of a view: a hash of its titles
    (re.compile(r"0x[0-9a-fA-F]{6,}"), "0xADDR"),           # memory addresses in reprs
    (re.compile(r"backend(=| )(&#x27;|')?(cpp|torch|triton|cuda)\b"), r"backend\1\2BACKEND"),  # which ran
    # an inline picture (an image result's overlay): its pixels follow the relevance, whose
    # last bits differ by CPU; the picture's presence and size are compared, the pixels
    # by the tests (tests/test_image_views.py)
    (re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+"), "data:image/png;base64,PNG"),
)
_RGB = re.compile(r"rgb\((\d+), ?(\d+), ?(\d+)\)")


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def _outputs(cell) -> list:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append((f"stream {o.name}", {"text": _text(o.text)}))
        elif o.output_type in ("execute_result", "display_data"):
            data = {k: ("<image>" if k.startswith("image/") else _text(v)) for k, v in o.data.items()}
            out.append((o.output_type, data))
        elif o.output_type == "error":
            out.append(("error", {"text": f"{o.ename}: {o.evalue}"}))
    return out


def _unit(written: str) -> float:
    """One unit of the last printed digit of a number as written (0 for an integer)."""
    mantissa, _, exponent = written.lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    return 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def _split(text: str):
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    colours = [tuple(int(c) for c in m) for m in _RGB.findall(text)]
    text = _RGB.sub("rgb(#)", text)
    numbers = _NUMBER.findall(text)
    skeleton = re.sub(r"\s+", " ", _NUMBER.sub("#", text)).strip()
    return skeleton, numbers, colours


def compare_text(stored: str, fresh: str) -> Optional[str]:
    """None where ``fresh`` shows what ``stored`` shows (volatile parts aside, numbers to
    their printed precision, colours within 2 of 255 per channel), else why not."""
    s_text, s_nums, s_rgb = _split(stored)
    f_text, f_nums, f_rgb = _split(fresh)
    if s_text != f_text:
        at = next((i for i, (a, b) in enumerate(zip(s_text, f_text)) if a != b), min(len(s_text), len(f_text)))
        return f"the text differs at character {at}: stored …{s_text[max(0, at - 80):at + 80]}… " \
               f"new …{f_text[max(0, at - 80):at + 80]}…"
    for k, (s, f) in enumerate(zip(s_nums, f_nums)):
        unit = max(_unit(s), _unit(f))
        if unit == 0.0:
            if int(s) != int(f):
                return f"number {k}: stored {s}, new {f}"
        elif abs(float(s) - float(f)) > max(unit * (1 + 1e-9), ATOL):
            return f"number {k}: stored {s}, new {f} (more than one unit of its last digit apart)"
    for k, (s, f) in enumerate(zip(s_rgb, f_rgb)):
        if max(abs(a - b) for a, b in zip(s, f)) > 2:
            return f"colour {k}: stored rgb{s}, new rgb{f}"
    return None


def differences(stored, fresh) -> List[str]:
    """Where executed notebook ``fresh`` does not show what ``stored`` shows (empty: the
    same), as sentences naming the cell."""
    out = []
    if len(stored.cells) != len(fresh.cells):
        return [f"{len(stored.cells)} cells stored, {len(fresh.cells)} executed"]
    for i, (a, b) in enumerate(zip(stored.cells, fresh.cells)):
        if a.cell_type != b.cell_type or _text(a.source) != _text(b.source):
            out.append(f"cell {i}: the source differs")
            continue
        oa, ob = _outputs(a), _outputs(b)
        if [(k, sorted(d)) for k, d in oa] != [(k, sorted(d)) for k, d in ob]:
            out.append(f"cell {i}: stored outputs {[(k, sorted(d)) for k, d in oa]}, "
                       f"new {[(k, sorted(d)) for k, d in ob]}")
            continue
        for (kind, da), (_, db) in zip(oa, ob):
            for mime in da:
                why = compare_text(da[mime], db[mime])
                if why:
                    out.append(f"cell {i} ({kind}, {mime}): {why}")
    return out


def main(argv=None) -> int:
    import nbformat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with the stored outputs; write nothing")
    args = ap.parse_args(argv)
    paths = [find(n) for n in args.names] or notebooks()
    status = 0
    for path in paths:
        t0 = time.monotonic()
        stored = nbformat.read(str(path), as_version=4)
        fresh = execute(stored)
        took = time.monotonic() - t0
        bad = problems(fresh)
        diff = differences(stored, fresh) if args.check else []
        for line in bad + diff:
            print(f"{path.name}: {line}", file=sys.stderr)
        if bad or diff:
            status = 1
        if not args.check and not bad:
            nbformat.write(fresh, str(path))
        verdict = "problems" if bad else "differs from what is stored" if diff else \
            "as stored" if args.check else "written"
        print(f"{path.name}: {took:.1f} s, {verdict}")
    return status


if __name__ == "__main__":
    sys.exit(main())

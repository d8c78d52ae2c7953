"""DESIGN §13: nothing in the checkout's root shadows an installed package. transformers
(>= 5.25) imports the ``kernels`` distribution; the checkout's ``kernels/`` folder holds
pyattr's Triton kernels, shipped as ``pyattr.kernels``. A process started in the root has
the root first on ``sys.path`` (``python -c``, ``python -m``, a notebook, ``torchrun -m``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _in_root(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # the root stays on sys.path
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_no_folder_of_the_root_is_a_regular_package_but_pyattr():
    packages = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert packages == ["pyattr"], packages


@pytest.mark.slow
def test_transformers_and_pyattr_import_from_the_checkout_root_with_the_root_first_on_sys_path():
    code = """
import os, sys
root = os.path.realpath(os.getcwd())
assert os.path.realpath(sys.path[0] or os.getcwd()) == root, sys.path[:2]
import transformers, pyattr
from transformers import LlamaConfig, LlamaForCausalLM
import torch
model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, num_hidden_layers=1, vocab_size=40))
r = pyattr.relevance(model, torch.tensor([[1, 5, 7, 9]]), target=3)
import importlib.util
spec = importlib.util.find_spec("kernels")
where = None if spec is None else (spec.origin or list(spec.submodule_search_locations))
import pyattr.kernels
print("kernels:", where)
print("pyattr.kernels:", list(pyattr.kernels.__path__))
print("delta:", float(r.conservation_delta.abs().max()))
"""
    p = _in_root(code)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)
    # the `kernels` distribution transformers depends on, not the checkout's folder
    assert str(ROOT / "kernels") not in lines["kernels"], lines
    assert str(ROOT / "kernels") in lines["pyattr.kernels"], lines
    assert float(lines["delta"]) < 1e-4, lines


@pytest.mark.slow
def test_torchrun_of_pyattr_from_the_checkout_root():
    """``torchrun -m pyattr`` (how ``pyattr run`` spreads over ranks) started in the checkout
    root, where ``-m`` puts the root first on sys.path."""
    import shutil

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None, "torchrun is installed with torch"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    p = subprocess.run([torchrun, "--nproc_per_node", "1", "-m", "pyattr", "--version"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().startswith("pyattr "), p.stdout

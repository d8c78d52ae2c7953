import functools
import os
import sys

# The checkout's root stays on sys.path where Python puts it (`python -m pytest`, and `python
# -c` in a child process started there), as it does for a contributor: nothing in the root
# may shadow an installed package (kernels/ has no __init__.py; tests/test_layout.py).

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors; the flag
# must be set before triton.jit decorates them (before pyattr.kernels is imported).
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
import torch

from pyattr import available_backends

# Under pytest-xdist each worker is one process on a 2-core machine: one intra-op thread
# each, or the workers' OpenMP threads fight over the cores (many times slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tiers: ``make test`` runs every test not marked ``slow``, ``make test-slow`` the rest
    (CI runs the two), ``make test-all`` them all. Besides the tests marked in their files
    (torch.compile, subprocess runs, benchmark harness runs), every case of a Triton kernel
    on CPU tensors is slow: it runs in Triton's Python interpreter (about 83 s of the
    suite's 416 s, one process)."""
    slow = pytest.mark.slow
    for item in items:
        if "triton" in item.nodeid.lower() and not torch.cuda.is_available():
            item.add_marker(slow)

# (atol, rtol) against a float64 oracle, per input dtype: the result is cast once to the
# dtype, so the budget is about one rounding of that dtype plus float32 accumulation.
TOL = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cpu_backends():
    st = available_backends()
    return [n for n, s in st.items() if s.available and "cpu" in s.devices]


@pytest.fixture(params=cpu_backends())
def backend_name(request):
    """Every backend that runs on CPU tensors here; each is compared against float64 oracles."""
    from pyattr import backend

    with backend(request.param):
        yield request.param


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=True)


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("PYATTR_BACKEND", raising=False)


SEED = 0


@pytest.fixture(autouse=True)
def _seed_rngs():
    """Every test starts from the same state of torch's, Python's and NumPy's global
    random generators (torch's seeds every CUDA device's too), whatever ran before it in
    the process: what a test draws in its body and its function-scoped fixtures (autouse
    fixtures run first within their scope) depends on the test alone, never on the order.
    Module- and session-scoped fixtures are built before this runs and seed themselves
    (tests/models.py's builders do); builders cached across tests leave the state as they
    found it (``keeps_rng_state``)."""
    import random

    import numpy as np

    torch.manual_seed(SEED)  # also every CUDA device's generator
    random.seed(SEED)
    np.random.seed(SEED)


def keeps_rng_state(builder):
    """For a builder cached across tests, under its cache (``@functools.lru_cache`` then
    ``@keeps_rng_state``): the call that builds (the first, in whichever test runs first)
    leaves torch's, Python's and NumPy's global generators as it found them, as the cached
    calls do, so what a test draws after it does not depend on the order."""
    import random

    import numpy as np

    @functools.wraps(builder)
    def build(*args, **kwargs):
        py, npy = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                return builder(*args, **kwargs)
        finally:
            random.setstate(py)
            np.random.set_state(npy)

    return build


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: a second thread gains nothing
    there, and on a busy machine OpenMP's spinning threads make each pass many times
    slower. Restored afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama():
    """A tiny random Llama (tests/models.py), float32, eval mode, with ``pad_token_id`` 0
    (``baseline="pad"``); one per test module."""
    from models import tiny_causal_lm

    m = tiny_causal_lm("llama")
    m.config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def llama64():
    """The same in float64 (bias-free: with the four rules, Σ relevance equals the target
    up to the float32 rounding of the relevance fields)."""
    from models import tiny_causal_lm

    return tiny_causal_lm("llama", dtype=torch.float64)


def save_tiny_llama(path, vocab_size: int, tokenizer=None, **overrides):
    """A tiny random Llama saved with ``save_pretrained`` (and ``tokenizer`` beside it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def save_tiny_vit(path):
    """A tiny random ViT image classifier (classes cat, dog, bird) with its image processor."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    labels = {0: "cat", 1: "dog", 2: "bird"}
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                    num_hidden_layers=2, id2label=labels, label2id={v: k for k, v in labels.items()})
    ViTForImageClassification(cfg).save_pretrained(path)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def save_image(path, height=48, width=64):
    """A random RGB image file (PNG)."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    """A local causal LM directory for the command line: a tiny Llama with the bundled
    MiniLM's tokenizer."""
    from models import minilm

    tok, _ = minilm()
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), len(tok), tok)


def run_cli(*args, env=None):
    """``pyattr ARGS`` in this process through the console script's entry point
    (``pyattr.cli:main``), with ``env`` added to the environment: what a subprocess would
    give (exit status, stdout, stderr) without paying for a fresh interpreter, torch and
    transformers imports on every call. Tests of the installed script itself spawn it."""
    import contextlib
    import io
    import types

    from pyattr.cli import main

    saved = dict(os.environ)
    os.environ.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "100", **(env or {})})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's errors, --help and --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def assert_scope_hygiene(m, other):
    """A scope on ``m`` leaves ``other`` untouched and, on exit (also through an exception),
    leaves ``m``'s modules exactly as it found them (nothing left to deep-copy)."""
    import copy

    import pyattr
    from pyattr.integration.install import state_of

    before = {n: dict(mod.__dict__) for n, mod in m.named_modules()}
    with pyattr.use_relevance_rules(m):
        assert all(state_of(mod) is None for mod in other.modules())
        assert any(state_of(mod) is not None for mod in m.modules())
    with pytest.raises(RuntimeError, match="boom"):
        with pyattr.use_relevance_rules(m):
            raise RuntimeError("boom")
    for n, mod in m.named_modules():
        assert "forward" not in mod.__dict__ and state_of(mod) is None, n
        assert set(mod.__dict__) == set(before[n]), n
    copy.deepcopy(m)


def graph_names(t) -> set:
    """Class names of every autograd node behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.fixture(scope="module")
def toy():
    """``(tokenizer, model)`` of the bundled toy induction decoder (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pyattr.toy

    tok = AutoTokenizer.from_pretrained(pyattr.toy.INDUCTION_DIR)
    model = AutoModelForCausalLM.from_pretrained(pyattr.toy.INDUCTION_DIR).eval()
    return tok, model


def need_torchao(module: bool = False):
    """torchao, or a skip saying why not: torchao 0.18 (the dev extra's) imports only under
    torch 2.10 or newer, and pyattr's floor is 2.6. CI sets PYATTR_REQUIRE_TORCHAO=1, where a
    missing torchao fails instead. ``module``: called at a test file's import (skips it all)."""
    import os

    try:
        import torchao  # noqa: F401
    except ImportError as e:
        why = f"torchao cannot be imported under torch {torch.__version__} ({type(e).__name__}: {e})"
        if os.environ.get("PYATTR_REQUIRE_TORCHAO") == "1":
            pytest.fail(f"PYATTR_REQUIRE_TORCHAO=1 but {why}")
        pytest.skip(why, allow_module_level=module)


def node_name(fn) -> str:
    """An autograd node's name: ``fn.name()``, or its class name where torch (2.6) refuses
    ``name()`` on a Python Function's node."""
    try:
        return fn.name()
    except RuntimeError:
        return type(fn).__name__

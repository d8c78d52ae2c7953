"""Installing anywhere (README, Install): which pyattr._C is loaded, the first-use compile,
its cache key, and the torch backend with one notice where the kernels cannot be had.

The real first-use compile of pyattr._C takes minutes; .ci/run does it from a wheel built
with build isolation. Here the compile runs for real on tiny sources: one that fails at
its first line, and a Python module without torch's headers, in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pyattr
import pyattr.backends as backends
import pyattr.backends.build as build
import pyattr.backends.extension as extension
import pyattr.backends.reference as reference
from pyattr.rules import identity_rule

ROOT = Path(__file__).resolve().parents[1]
HERE = sys.implementation.cache_tag
V = torch.__version__
HOW_REBUILD = f"`python -m pyattr.backends.build` compiles them for torch {V}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty first-use cache, first use allowed, and the loader's caches reset around
    the test (so that the process's real pyattr._C comes back after it)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("PYATTR_CACHE_DIR", str(d))
    monkeypatch.delenv("PYATTR_JIT", raising=False)
    monkeypatch.setattr(extension, "_noticed", False)

    def clear():
        extension.load.cache_clear()
        backends._probe_all.cache_clear()
        backends._selected.clear()

    clear()
    yield d
    clear()


# what the loader says where the prebuilt stable-ABI kernels do not fit (tests/test_stable.py
# covers them)
NO_STABLE = "the prebuilt kernels need torch >= 2.10 (this is 2.9.1)"


@pytest.fixture
def not_loaded(monkeypatch):
    """As in a process that has not loaded pyattr._C yet, under a torch too old for the
    prebuilt kernels."""
    monkeypatch.delitem(sys.modules, "pyattr._C", raising=False)
    monkeypatch.setattr(extension, "_load_stable", lambda torch: (None, NO_STABLE))


def _csrc_copy(tmp_path) -> Path:
    dst = tmp_path / "csrc"
    shutil.copytree(build.source_dir(), dst)
    return dst


def _lib_with_info(tmp_path, info) -> Path:
    d = tmp_path / "site" / "pyattr"
    d.mkdir(parents=True)
    if info is not None:
        (d / "_C_build.json").write_text(json.dumps(info))
    return d / f"_C.{HERE}-x86_64-linux-gnu.so"  # never imported: the check comes first


# --- a pyattr._C built against another torch --------------------------------------------

def test_a_library_built_against_another_torch_is_told_apart_by_version_build_and_python():
    now = build.torch_info(torch)
    assert now == {"torch": V, "torch_git": torch.version.git_version, "python": HERE}
    assert build.mismatch(now, torch) == ""
    assert build.mismatch(dict(now, torch="2.0.0+cpu"), torch) == (
        f"pyattr._C was built against torch 2.0.0+cpu, this is torch {V}")
    # the same version string from another commit (a nightly, a local build)
    assert build.mismatch(dict(now, torch_git="0" * 40), torch) == (
        f"pyattr._C was built against torch {V}, this is torch {V}")
    assert build.mismatch(dict(now, python="cpython-39"), torch) == (
        f"pyattr._C was built for cpython-39, this is {HERE}")


def test_the_installed_library_is_checked_by_the_file_beside_it(tmp_path):
    assert extension.check_installed(_lib_with_info(tmp_path / "a", None), torch) == (
        "pyattr._C has no _C_build.json beside it (built by an older setup.py), so the torch "
        "it was built against is unknown")
    assert extension.check_installed(_lib_with_info(tmp_path / "b", dict(build.torch_info(torch))), torch) == ""
    lib = _lib_with_info(tmp_path / "c", dict(build.torch_info(torch), torch="2.4.1"))
    assert extension.check_installed(lib, torch) == f"pyattr._C was built against torch 2.4.1, this is torch {V}"
    lib.with_name("_C_build.json").write_text("{not json")
    assert extension.check_installed(lib, torch).startswith("pyattr._C's _C_build.json is unreadable (")


def test_a_mismatched_library_is_never_imported_and_without_first_use_the_cpp_backend_is_off(
        tmp_path, cache, not_loaded, monkeypatch, capsys):
    lib = _lib_with_info(tmp_path, dict(build.torch_info(torch), torch="2.0.0"))
    monkeypatch.setattr(extension, "installed_library", lambda: lib)
    monkeypatch.setenv("PYATTR_JIT", "0")
    why = (f"pyattr._C was built against torch 2.0.0, this is torch {V}; {NO_STABLE}, and compiling it on first "
           "use is off (PYATTR_JIT=0)")
    how = f"{HOW_REBUILD}, or unset PYATTR_JIT"
    assert extension._find() == (None, "", why, how)
    assert extension.load() == (None, why)
    st = pyattr.available_backends()["cpp"]
    assert (st.available, st.reason) == (False, why)
    assert capsys.readouterr().err == (
        f"pyattr: the C++ kernels are off, running on the torch backend: {why}. To get them: {how}.\n")


def test_the_first_use_build_in_the_cache_is_loaded_even_with_first_use_compiles_off(
        tmp_path, cache, not_loaded, monkeypatch):
    """PYATTR_JIT=0 stops the compile, not the use of a build made before (by the build
    command): here a cache entry whose library fails to load is reported as such."""
    monkeypatch.setattr(extension, "installed_library", lambda: None)
    monkeypatch.setenv("PYATTR_JIT", "0")
    plan = build.Plan(torch, build.source_dir())
    plan.dir.mkdir(parents=True)
    plan.library.write_bytes(b"not an ELF file")
    plan.info.write_text("{}")
    mod, origin, why, how = extension._find()
    assert (mod, origin) == (None, "")
    assert why.startswith(f"pyattr._C is not built (a pure-Python install); its cached build {plan.library} "
                          "failed to load (")
    assert how == f"remove {plan.dir}, then {HOW_REBUILD}"


# --- the cache key ----------------------------------------------------------------------

def test_the_cache_key_names_torch_python_and_device_and_hashes_the_rest():
    args = ("2.15.0+cu132", "cpython-311", False, ["-O3", "-mavx2"], "a" * 64, "d0f2af8")
    key = build.cache_key(*args)
    assert re.fullmatch(r"torch-2\.15\.0\+cu132-cpython-311-cpu-[0-9a-f]{12}", key), key
    assert build.cache_key(*args) == key
    assert build.cache_key("2.15.0+cu132", "cpython-311", True, *args[3:]).startswith("torch-2.15.0+cu132-cpython-311-cuda-")
    others = {build.cache_key("2.4.1", *args[1:]), build.cache_key(args[0], "cpython-312", *args[2:]),
              build.cache_key(*args[:3], ["-O3"], *args[4:]), build.cache_key(*args[:4], "b" * 64, args[5]),
              build.cache_key(*args[:5], "5c48869")}
    assert key not in others and len(others) == 5
    assert build.cache_key("2.5.0a0+git/x y", "cpython-311", False, [], "") .startswith("torch-2.5.0a0+git_x_y-")


def test_the_source_hash_follows_every_source_and_header_and_nothing_else(tmp_path):
    src = _csrc_copy(tmp_path)
    h = build.source_hash(src)
    assert h == build.source_hash(build.source_dir())
    (src / "README.txt").write_text("not a source")
    assert build.source_hash(src) == h
    hdr = src / "cpu" / "kernels.h"
    hdr.write_text(hdr.read_text() + "\n// one more line\n")
    assert build.source_hash(src) != h


def test_the_cache_directory_follows_pyattr_cache_dir_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PYATTR_CACHE_DIR", str(tmp_path / "mine"))
    plan = build.Plan(torch, build.source_dir())
    assert plan.dir == tmp_path / "mine" / "ext" / plan.key
    assert plan.library == plan.dir / "_C.so" and plan.info == plan.dir / "_C_build.json"
    assert plan.key.startswith(f"torch-{V}-{HERE}-")
    monkeypatch.delenv("PYATTR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_root() == tmp_path / "xdg" / "pyattr"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == tmp_path / "home" / ".cache" / "pyattr"


def test_the_sources_are_found_in_the_checkout_or_the_wheel_and_all_of_them_compile():
    src = build.source_dir()
    assert src.name in ("csrc", "_csrc") and (src / "ops.cpp").is_file()
    cpu, cuda = build.sources(src)
    assert [Path(p).relative_to(src).as_posix() for p in cpu] == sorted(
        ["ops.cpp", "identity_rule.cpp", "layer_norm_rule.cpp"]
        + [f"cpu/{f}.cpp" for f in ("attention", "gated", "half", "identity", "layer_norm", "rms_norm")])
    assert sorted(Path(p).name for p in cuda) == [f"{f}.cu" for f in ("gated", "half", "identity", "layer_norm", "rms_norm")]


# --- no compiler, no ninja, no Python headers --------------------------------------------

def _bin(tmp_path, *names) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_text("#!/bin/sh\nexit 0\n")
        (d / n).chmod(0o755)
    return str(d)


def test_a_missing_compiler_ninja_or_python_headers_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert build.missing_tool() == "no C++ compiler found ('no-such-c++' is not on PATH; set CXX to name one)"
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(build, "tool_path", lambda: _bin(tmp_path, "c++"))
    assert build.missing_tool() == "ninja is not found (pip install ninja)"
    monkeypatch.setattr(build, "tool_path", lambda: _bin(tmp_path, "c++", "ninja"))
    monkeypatch.setattr(build.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert build.missing_tool() == (
        f"the Python headers are missing ({tmp_path}/Python.h; e.g. apt-get install python3-dev)")


def test_without_a_compiler_pyattr_runs_on_the_torch_backend_after_one_notice(
        cache, not_loaded, monkeypatch, capsys):
    monkeypatch.setattr(extension, "installed_library", lambda: None)
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(build, "compile", lambda *a, **k: pytest.fail("nothing to compile with"))
    why = (f"pyattr._C is not built (a pure-Python install); {NO_STABLE}, and it cannot be compiled here: "
           "no C++ compiler found ('no-such-c++' is not on PATH; set CXX to name one)")
    how = ("a C++ compiler and ninja (pip install ninja), then `python -m pyattr.backends.build` "
           "or the first use compiles them")
    st = pyattr.available_backends()
    assert (st["cpp"].available, st["cpp"].reason) == (False, why)
    assert backends.select(torch.device("cpu"), "identity") == "torch"
    assert backends.implementation(torch.device("cpu"), "identity") is reference
    with pytest.raises(backends.BackendUnavailableError, match=re.escape(f"backend 'cpp' is not available: {why}")):
        with pyattr.backend("cpp"):
            pass
    # a rule's backward on the torch backend, and no second notice
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(identity_rule(x, "gelu").sum(), x)
    torch.testing.assert_close(g, torch.nn.functional.gelu(x.detach()) / x.detach(), rtol=1e-12, atol=0)
    extension.load.cache_clear()
    assert extension.load() == (None, why)
    assert capsys.readouterr().err == (
        f"pyattr: the C++ kernels are off, running on the torch backend: {why}. To get them: {how}.\n")


def test_an_install_without_sources_says_how_to_reinstall(cache, not_loaded, monkeypatch):
    monkeypatch.setattr(extension, "installed_library", lambda: None)
    monkeypatch.setattr(build, "source_dir", lambda: None)
    assert extension._find() == (
        None, "", f"pyattr._C is not built (a pure-Python install); {NO_STABLE}, and this install ships no C++ "
        "sources to compile",
        "reinstall pyattr from its source (pip install --no-build-isolation <checkout or sdist>)")


# --- the compile itself ------------------------------------------------------------------

@pytest.fixture
def toolchain():
    if build.missing_tool():
        pytest.skip(f"no toolchain here: {build.missing_tool()}")


def test_a_failed_compile_is_reported_logged_and_not_retried_by_the_next_process(
        tmp_path, cache, not_loaded, toolchain, monkeypatch):
    src = tmp_path / "broken"
    src.mkdir()
    (src / "ops.cpp").write_text("#error pyattr test: this source does not compile\n")
    plan = build.Plan(torch, src)
    assert plan.cpu_sources == [str(src / "ops.cpp")] and plan.cuda_sources == []
    seen = []
    with pytest.raises(RuntimeError) as e:
        build.compile(plan, torch, notice=seen.append)
    reason = str(e.value)
    assert re.fullmatch(r"compiling pyattr\._C failed \(.*error: #error pyattr test: this source does not compile; "
                        + re.escape(f"full log {plan.log})"), reason), reason
    assert seen == [f"pyattr: compiling the C++ kernels ({build.EXPECTED}) against torch {V} into {plan.dir}, "
                    "once per torch version ..."]
    assert plan.failed.read_text() == reason + "\n"
    assert "this source does not compile" in plan.log.read_text()
    assert not plan.info.exists()
    # the next process: the recorded reason, no compile
    monkeypatch.setattr(extension, "installed_library", lambda: None)
    monkeypatch.setattr(build, "source_dir", lambda: src)
    monkeypatch.setattr(build, "_compile_locked", lambda *a: pytest.fail("compiled again"))
    assert extension._find() == (None, "", f"pyattr._C is not built (a pure-Python install); {NO_STABLE}; {reason}",
                                 f"fix that, then {HOW_REBUILD} (it retries)")
    # the build command retries, in a new process (torch builds an extension once per
    # process), and fails the same way
    plan.log.unlink()
    script = ("import sys, pathlib, pyattr.backends.build as b; "
              "b.source_dir = lambda: pathlib.Path(sys.argv[1]); sys.exit(b.main([]))")
    p = subprocess.run([sys.executable, "-c", script, str(src)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYATTR_CACHE_DIR=str(cache)))
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.splitlines()[-1] == f"pyattr: {reason}"
    assert plan.failed.read_text() == reason + "\n" and plan.log.is_file()


TINY = textwrap.dedent("""\
    // a Python module named _C without torch: what the first-use build compiles, in a second
    #include <Python.h>
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "tiny", -1, nullptr};
    PyMODINIT_FUNC PyInit__C(void) {
      PyObject* m = PyModule_Create(&def);
      if (m) PyModule_AddIntConstant(m, "TINY", 42);
      return m;
    }
    """)

SCRIPT = textwrap.dedent("""\
    import json, sys
    from pathlib import Path
    import pyattr, pyattr.backends.build as build, pyattr.backends.extension as extension
    src = Path(sys.argv[1])
    extension.installed_library = lambda: None
    extension._load_stable = lambda torch: (None, "no prebuilt kernels here")
    build.source_dir = lambda: src
    activated, ready = [], []
    extension._activate = lambda mod, origin: activated.append((mod.TINY, origin))  # TINY has no ops
    extension.ON_READY.append(lambda: ready.append(True))
    first = extension._find()  # starts the compile in the background and returns at once
    extension._find()  # a second probe while it runs starts nothing
    extension.wait(300)
    mod = sys.modules["pyattr._C"]
    loaded = (mod.TINY, pyattr._C is mod, activated, ready)
    del sys.modules["pyattr._C"]
    extension.ORIGIN = ""
    build.compile = None  # a second process: the cache, no compile
    mod, origin, why, how = extension._find()
    print(json.dumps([first, loaded, (mod.TINY, origin, why, how)]))
    """)


def test_the_first_use_compile_runs_in_the_background_goes_to_the_cache_and_is_loaded_as_pyattr_C(
        tmp_path, toolchain):
    """Where no built kernels fit, the first probe starts the compile in a thread and
    returns (pyattr runs on the torch backend meanwhile); when it ends the library is
    pyattr._C, the backends probe again (ON_READY), and a second process loads the cache."""
    src = tmp_path / "tiny"
    src.mkdir()
    (src / "ops.cpp").write_text(TINY)
    env = dict(os.environ, PYATTR_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PYATTR_JIT", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(src)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    plan_dir = next((tmp_path / "cache" / "ext").iterdir())
    assert re.fullmatch(rf"torch-{re.escape(V)}-{HERE}-cpu-[0-9a-f]{{12}}", plan_dir.name)
    origin = f"compiled on first use for torch {V}, {plan_dir}"
    first, loaded, second = json.loads(p.stdout)
    assert first == [None, "", "pyattr._C is not built (a pure-Python install); no prebuilt kernels here; "
                     "compiling pyattr._C in the background",
                     f"wait for the line saying the kernels are ready, or {HOW_REBUILD} and waits"]
    assert loaded == [42, True, [[42, origin]], [True]]
    assert second == [42, origin, "", ""]
    start, done = p.stderr.splitlines()
    assert start == (f"pyattr: compiling the C++ kernels ({build.EXPECTED}) against torch {V} in the background, "
                     f"once per torch version, into {plan_dir}; until they are ready pyattr runs on the torch "
                     "backend (the same numbers, slower)")
    assert re.fullmatch(r"pyattr: the C\+\+ kernels are ready \(compiled in \d+ s\); pyattr uses them from now on",
                        done), done
    info = json.loads((plan_dir / "_C_build.json").read_text())
    assert {k: info[k] for k in ("torch", "torch_git", "python", "with_cuda", "key")} == dict(
        build.torch_info(torch), with_cuda=False, key=plan_dir.name)
    assert build.mismatch(info, torch) == ""


def test_a_pyattr_C_imported_before_the_probe_is_named_by_where_it_lies(tmp_path, monkeypatch):
    monkeypatch.setenv("PYATTR_CACHE_DIR", str(tmp_path / "cache"))
    key = tmp_path / "cache" / "ext" / "torch-x-cpython-311-cpu-0123456789ab"
    key.mkdir(parents=True)
    cached = type(sys)("pyattr._C")
    cached.__file__ = str(key / "_C.so")
    assert extension._origin(cached, torch) == f"compiled on first use for torch {V}, {key}"
    installed = type(sys)("pyattr._C")
    installed.__file__ = str(tmp_path / "site-packages" / "pyattr" / f"_C.{HERE}-x86_64-linux-gnu.so")
    assert extension._origin(installed, torch) == "built at install"


def test_an_interpreter_that_cannot_run_the_kernels_turns_the_triton_backend_off(monkeypatch):
    """torch 2.6 ships Triton 3.2, torch 2.7 Triton 3.3: neither's interpreter runs the
    autotuned kernels without a GPU. The Triton here (a newer one) can."""
    triton = pytest.importorskip("triton")
    real = triton.__version__
    assert backends._interpreter_problem(triton) == ""
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    assert backends._interpreter_problem(triton) == (
        "Triton 3.2.0's interpreter cannot run pyattr's autotuned kernels (a newer Triton can; "
        "on a GPU without TRITON_INTERPRET this one can)")
    monkeypatch.setattr(triton, "__version__", real)
    monkeypatch.delitem(sys.modules, "pyattr.kernels.identity")
    monkeypatch.setattr(triton, "autotune", lambda **kw: (_ for _ in ()).throw(
        RuntimeError("0 active drivers ([]). There should only be one.")))
    assert backends._interpreter_problem(triton) == (
        f"Triton {real}'s autotuner needs a GPU driver, even under TRITON_INTERPRET (0 active drivers ([]). "
        "There should only be one.); a newer Triton runs pyattr's kernels on the CPU")

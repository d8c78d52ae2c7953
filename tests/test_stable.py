"""The CPU kernels prebuilt over torch's stable ABI (README, Install): ``pyattr._C_stable``
is built from the sources as they are, imports nothing of torch but the stable C shim,
gives the torch backend's numbers on each of its three CPU code paths, and is taken only
where no ``pyattr._C`` fits and it can load."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pyattr.backends.extension as extension
import pyattr.backends.stable as stable

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "pyattr" / stable.LIBRARY


def test_the_prebuilt_library_is_built_from_the_sources_as_they_are():
    assert LIB.is_file(), f"{LIB} is missing (make stable builds it)"
    assert stable.stale(ROOT / "csrc", LIB.with_name(stable.INFO)) == ""
    # every file it is compiled from is covered, and only those
    names = [p.relative_to(ROOT / "csrc").as_posix() for p in stable.inputs(ROOT / "csrc")]
    assert "stable/module.cpp" in names and "cpu/kernel_decls.inc" in names and "cpu/identity.cpp" in names
    assert not any(n.startswith("cuda/") or n in ("ops.cpp", "cpu/attention.cpp") for n in names)


def test_a_changed_source_makes_the_record_stale(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", src)
    assert stable.stale(src, LIB.with_name(stable.INFO)) == ""
    with open(src / "cpu" / "half.cpp", "a") as f:
        f.write("// changed\n")
    assert stable.stale(src, LIB.with_name(stable.INFO)) == (
        f"the sources in {src} changed since _C_stable.abi3.so was built (make stable rebuilds it)")


# C library, C++ runtime, compiler support and the interpreter: what every extension imports
_SYSTEM = re.compile(r"@(GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+$")


def test_the_library_imports_nothing_of_torch_but_the_stable_c_shim():
    """The only torch symbols it needs are the stable shim's (aoti_torch_*, torch_*) and
    Sleef's vector math, which libtorch_cpu has exported unchanged since torch 1.x; no
    c10:: or at:: symbol, so no torch version's C++ ABI."""
    nm = shutil.which("nm")
    assert nm is not None, "binutils' nm is needed to read the library's imports"
    out = subprocess.run([nm, "-D", "--undefined-only", str(LIB)], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    foreign = [n for n in names if not (
        _SYSTEM.search(n) or n.startswith(("aoti_torch_", "torch_", "Sleef_", "Py", "_Py"))
        or n in ("__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable"))]
    assert foreign == []
    assert any(n.startswith("torch_parallel_for") for n in names)  # the stable thread pool
    assert not any(n.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch")) for n in names)


def _check(env_extra):
    env = dict(os.environ, **env_extra)
    env.pop("PYATTR_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "pyattr.bench.stable_check", "--prebuilt"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _assert_checked(p, code_path):
    assert p.returncode == 0, p.stdout + p.stderr
    first = p.stdout.splitlines()[0]
    assert first == (f"torch {torch.__version__}; cpp backend: pyattr._C_stable CPU kernels (prebuilt over torch's "
                     f"stable ABI for torch >= 2.10, {code_path} code path; no attention kernels)")
    assert p.stdout.splitlines()[-1] == "40 of 40 checks agree"


def _widest():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if all(f" {x}" in flags for x in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")):
        return "AVX512"
    return "AVX2" if all(f" {x}" in flags for x in ("avx2", "fma")) else "DEFAULT"


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                    reason="the prebuilt library is for Linux x86-64")
def test_the_prebuilt_kernels_give_the_torch_backends_numbers_on_this_cpus_widest_code_path():
    _assert_checked(_check({}), _widest())


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["AVX2", "DEFAULT"])
@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                    reason="the prebuilt library is for Linux x86-64")
def test_the_prebuilt_kernels_give_the_torch_backends_numbers_on_the_narrower_code_paths(cap):
    if cap == "AVX2" and _widest() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    _assert_checked(_check({"PYATTR_CPU_CAPABILITY": cap}), cap)


def test_the_prebuilt_library_is_taken_only_where_it_can_load(monkeypatch):
    old = SimpleNamespace(__version__="2.9.1", ops=torch.ops)
    assert extension._load_stable(old) == (None, "the prebuilt kernels need torch >= 2.10 (this is 2.9.1)")
    assert [stable.supported(v) for v in ("2.6.0", "2.9.1+cpu", "2.10.0", "2.15.0+cu130", "3.0.0")] == [
        False, False, True, True, True]
    monkeypatch.setattr(extension.platform, "machine", lambda: "aarch64")
    assert extension._load_stable(torch) == (
        None, f"the prebuilt kernels are for Linux x86-64 (this is {sys.platform} aarch64)")
    monkeypatch.undo()
    # this process has pyattr._C's ops: a second registration of the namespace is refused
    assert torch.ops.pyattr.identity_backward is not None
    assert extension._load_stable(torch) == (
        None, "another build of pyattr's kernels registered its ops in this process")

"""Building ``pyattr._C_stable``: the CPU kernels over torch's stable ABI.

``pyattr._C`` is compiled for one torch version (its ABI), so a wheel cannot carry it to a
user's torch; ``pyattr._C_stable`` calls torch only through the stable C shim
(``torch/csrc/stable``) and so loads under every torch from :data:`TARGET` on. It is
built once, when the wheel is built (``setup.py``, which reads this file by path), from
the same kernel sources with ``PYATTR_STABLE_ABI`` set, three times over (portable
x86-64, AVX2, AVX-512: the library picks the widest the CPU has when it loads), and
linked with no library of torch's but ``libtorch_cpu`` (for the shim's symbols, found in
the process that imported torch). It has the Identity-, Half-, gated and norm kernels;
the attention kernels run their GEMMs through ATen and stay in ``pyattr._C`` (with the
stable library the attention rules run on the torch backend).

This module imports nothing of pyattr and torch only inside functions.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# the oldest torch whose stable ABI has what the kernels use (torch::stable::parallel_for,
# std::string_view arguments, new_empty with a dtype): 2.10
TARGET = (2, 10)
TARGET_MACRO = f"0x{TARGET[0]:02x}{TARGET[1]:02x}000000000000ULL"
NAME = "pyattr._C_stable"
KERNELS = ("gated.cpp", "half.cpp", "identity.cpp", "layer_norm.cpp", "rms_norm.cpp")
# (namespace, flags) per CPU code path; CPU_CAPABILITY selects at::vec's implementation
CODE_PATHS = (
    ("cap_default", ["-DCPU_CAPABILITY=DEFAULT"]),
    ("cap_avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    ("cap_avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                    "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
)
# -ffp-contract=off as in pyattr._C (results match the reference's rounding);
# -fvisibility=hidden: the library exports its module init only, so no symbol of one
# code path's copy can be bound to another's or to another library's
COMMON = ["-O3", "-fPIC", "-std=c++17", "-ffp-contract=off", "-g0", "-DNDEBUG", "-Wno-unknown-pragmas",
          "-fvisibility=hidden", "-fvisibility-inlines-hidden", f"-DPYATTR_STABLE_ABI={TARGET_MACRO}"]


# the prebuilt library shipped in the package, and what it was built from
LIBRARY = "_C_stable.abi3.so"
INFO = "_C_stable.json"


def inputs(src: Path) -> list:
    """The files the stable library is compiled from (the kernels that both builds have, the
    headers, the module), sorted: what :func:`source_hash` covers."""
    src = Path(src)
    files = [src / "cpu" / k for k in KERNELS] + list(src.glob("*.h")) + list(src.glob("cpu/*.h"))
    files += list(src.glob("cpu/*.inc")) + list(src.glob("stable/*.cpp"))
    return sorted(files)


def source_hash(src: Path) -> str:
    """sha256 over the names and contents of :func:`inputs` and the build flags."""
    h = hashlib.sha256("\0".join(COMMON + [f for _, fl in CODE_PATHS for f in fl]).encode())
    for p in inputs(src):
        h.update(p.relative_to(src).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def stale(src: Path, info_path: Path) -> str:
    """Why the prebuilt library described by ``info_path`` does not match the sources in
    ``src`` ("" when it does)."""
    try:
        info = json.loads(Path(info_path).read_text())
    except (OSError, ValueError) as e:
        return f"{info_path} is unreadable ({e})"
    if info.get("source_hash") != source_hash(src):
        return (f"the sources in {src} changed since {LIBRARY} was built (make stable rebuilds it)")
    return ""


def supported(torch_version: str) -> bool:
    """Whether a torch of this version can load the stable library (>= :data:`TARGET`)."""
    parts = []
    for p in torch_version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= TARGET


def headers_have_stable_abi(torch) -> bool:
    """The build's torch ships the stable headers this build needs."""
    inc = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "stable"
    return supported(torch.__version__) and (inc / "ops.h").is_file()


def commands(src: Path, out: Path, tmp: Path, torch) -> tuple:
    """(compile commands, link command) that build ``out`` from the sources in ``src``."""
    root = Path(torch.__file__).parent
    cxx = (os.environ.get("CXX", "").strip() or "c++").split()
    # __FILE__ in the kernels' error messages relative to the checkout (csrc/...), not the
    # build machine's path
    inc = ["-I", str(root / "include"), "-I", sysconfig.get_paths()["include"],
           f"-ffile-prefix-map={Path(src).resolve().parent}/="]
    compiles, objects = [], []
    for ns, flags in CODE_PATHS:
        for name in KERNELS:
            obj = tmp / ns / (name + ".o")
            compiles.append(cxx + COMMON + flags + [f"-DPYATTR_CAP={ns}"] + inc +
                            ["-c", str(src / "cpu" / name), "-o", str(obj)])
            objects.append(obj)
    obj = tmp / "module.cpp.o"
    compiles.append(cxx + COMMON + inc + ["-c", str(src / "stable" / "module.cpp"), "-o", str(obj)])
    objects.append(obj)
    link = cxx + ["-shared", "-s", "-o", str(out)] + [str(o) for o in objects] + [
        "-L", str(root / "lib"), "-ltorch_cpu"]
    return compiles, link


def build(src: Path, out: Path, tmp: Path, torch, jobs: int = 1, say=None) -> float:
    """Compile and link the stable library at ``out`` (objects under ``tmp``); returns the
    seconds it took. ``say(msg)`` gets a line per finished file. Raises RuntimeError with
    the compiler's first error."""
    say = say or (lambda m: None)
    src, out, tmp = Path(src), Path(out), Path(tmp)
    compiles, link = commands(src, out, tmp, torch)
    for c in compiles:
        Path(c[-1]).parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            err = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:300])
            raise RuntimeError(f"compiling {NAME} failed: {err}\n{r.stderr[-4000:]}")
        return cmd

    done = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for cmd in pool.map(run, compiles):
            done += 1
            rel = os.path.relpath(cmd[cmd.index("-c") + 1], src)
            ns = next((f[len("-DPYATTR_CAP="):] for f in cmd if f.startswith("-DPYATTR_CAP=")), "")
            say(f"[{done}/{len(compiles) + 1}] compiled {rel}{' (' + ns[4:] + ')' if ns else ''}")
    run(link)
    say(f"[{len(compiles) + 1}/{len(compiles) + 1}] linked {out.name}")
    return time.monotonic() - t0


def write_info(path: Path, src: Path, torch, seconds: float) -> None:
    """The record beside the library: the sources' hash, the torch headers it was built
    with, the oldest torch it loads under, the compiler and the C library it needs."""
    import platform

    cxx = (os.environ.get("CXX", "").strip() or "c++").split()
    version = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout.splitlines()
    info = {
        "source_hash": source_hash(src),
        "built_with_torch": torch.__version__.split("+")[0],
        "loads_under_torch": f">={TARGET[0]}.{TARGET[1]}",
        "code_paths": [ns[4:] for ns, _ in CODE_PATHS],
        "compiler": version[0] if version else "?",
        "glibc_of_build": platform.libc_ver()[1],
        "seconds": round(seconds, 1),
    }
    Path(path).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    """``python -m pyattr.backends.stable``: build the stable library (default: the one the
    package ships, pyattr/_C_stable.abi3.so, and its record), or --check that it is fresh."""
    import argparse

    pkg = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(prog="python -m pyattr.backends.stable", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(pkg / LIBRARY), help=f"the library to write (default: pyattr/{LIBRARY})")
    ap.add_argument("--src", default=str(pkg.parent / "csrc"))
    ap.add_argument("--tmp", default=str(pkg.parent / "build" / "stable"))
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--check", action="store_true", help=f"exit 1 when pyattr/{LIBRARY} is older than the sources")
    a = ap.parse_args(argv)
    if a.check:
        why = stale(Path(a.src), Path(a.out).with_name(INFO))
        print(why or f"{a.out} matches the sources in {a.src}", file=sys.stderr if why else sys.stdout)
        return 1 if why else 0
    import torch

    seconds = build(Path(a.src), Path(a.out), Path(a.tmp), torch, a.jobs,
                    say=lambda m: print(m, file=sys.stderr, flush=True))
    write_info(Path(a.out).with_name(INFO), Path(a.src), torch, seconds)
    print(f"{NAME} built in {seconds:.0f} s: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

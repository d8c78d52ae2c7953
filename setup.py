"""Build for pyattr.

Packages: ``pyattr`` and ``kernels/`` shipped as ``pyattr.kernels``. The C++/CUDA
extension ``pyattr._C`` is built from ``csrc/`` with ``torch.utils.cpp_extension`` and
ninja (DESIGN §5); install with ``--no-build-isolation`` so it is built against the torch
that will run it. MANIFEST.in puts every source and header of ``csrc/`` in the sdist.

Environment:
  PYATTR_FORCE_CUDA      1: build the CUDA kernels even without a GPU (CI does, so a CUDA
                         compile or link error fails there); 0: never. Unset: only when
                         torch sees a GPU (and nvcc is found).
  MAX_JOBS               parallel compiles (default: the cores this process may use)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default 8.0;9.0)
  PYATTR_CPU_CAPABILITY  AVX2 or DEFAULT caps the CPU vector width
"""

import glob
import os
import shutil
import sys
import time

from setuptools import find_packages, setup

_ROOT = os.path.dirname(os.path.abspath(__file__))

packages = find_packages(include=["pyattr", "pyattr.*"]) + ["pyattr.kernels"]
ext_modules, cmdclass = [], {}

cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))


def cpu_flags():
    """The widest at::vec code path the build machine has (AVX-512, else AVX2/FMA, else
    the portable one): the extension is built from source on the machine that runs it.
    PYATTR_CPU_CAPABILITY=AVX2 or DEFAULT caps it."""
    # at::parallel_for is header code over OpenMP: without -fopenmp it runs on one thread.
    # The process already holds torch's libgomp.so.1, which the extension then shares.
    # -ffp-contract=off: no silent FMA contraction, so g - mean(g) of a one-element row is
    # exactly 0 and results match the reference's rounding.
    # -g0: Python's CFLAGS add -g, which doubles the compile time of the at::vec-heavy
    # files (debug info changes no generated code). -Wno-unknown-pragmas: torch's vec
    # headers use `#pragma unroll`, one warning per header per file under -Wall.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-g0", "-Wno-unknown-pragmas"]
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    level = os.environ.get("PYATTR_CPU_CAPABILITY", "").upper()
    has = lambda *f: all(f" {x}" in info for x in f)  # noqa: E731
    if level in ("", "AVX512") and has("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif level in ("", "AVX2", "AVX512") and has("avx2", "fma"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return flags


def _cuda_home_hint():
    """Point CUDA_HOME at a full toolkit when `nvcc` on PATH is a wrapper outside it
    (e.g. /usr/local/bin/nvcc with the toolkit in /usr/local/cuda); torch would otherwise
    look for libcudart next to the wrapper."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if not os.path.exists(os.path.join(home, "lib64")) and os.path.exists("/usr/local/cuda/lib64"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def _nvidia_include_dirs():
    """CUDA headers that ship in the nvidia-* wheels torch depends on."""
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for base in getattr(nvidia, "__path__", []):
        dirs += sorted(glob.glob(os.path.join(base, "cu*", "include")))
    return dirs


def _jobs():
    """MAX_JOBS, else the cores this process may use (ninja's own default is cores + 2)."""
    jobs = os.environ.get("MAX_JOBS", "")
    if not jobs.isdigit() or int(jobs) < 1:
        try:
            jobs = str(len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            jobs = str(os.cpu_count() or 1)
        os.environ["MAX_JOBS"] = jobs  # read by torch's ninja build
    return int(jobs)


def _say(msg):
    print(f"pyattr build: {msg}", file=sys.stderr, flush=True)


def _want_cuda(torch, cuda_sources):
    """(build the CUDA kernels?, why). PYATTR_FORCE_CUDA=1 forces them (CI: a CUDA compile
    or link error fails without a GPU), =0 leaves them out; otherwise they are built only
    when torch sees a GPU, since a machine without one can never run them."""
    force = os.environ.get("PYATTR_FORCE_CUDA", "")
    if not cuda_sources:
        return False, "no CUDA sources"
    if force == "1":
        return True, "PYATTR_FORCE_CUDA=1"
    if force == "0":
        return False, "PYATTR_FORCE_CUDA=0"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return False, "no GPU visible (PYATTR_FORCE_CUDA=1 builds them anyway)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which("nvcc") is None:
        return False, "a GPU is visible but nvcc / CUDA_HOME is not found"
    return True, "a GPU is visible"


if cpu_sources:
    _cuda_home_hint()
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    import torch

    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    with_cuda, why = _want_cuda(torch, cuda_sources)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    if with_cuda:
        ext = CUDAExtension(
            "pyattr._C",
            cpu_sources + cuda_sources,
            define_macros=[("PYATTR_WITH_CUDA", "1")],
            include_dirs=_nvidia_include_dirs(),
            extra_compile_args={"cxx": cpu_flags(), "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "pyattr._C", cpu_sources, extra_compile_args={"cxx": cpu_flags()}, extra_link_args=["-fopenmp"]
        )
    ext_modules = [ext]

    class _BuildExt(BuildExtension.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            # An editable install (`make demo` / `make test`) compiles in a temporary folder
            # that pip deletes; keep the objects and ninja's log in build/ instead, so a
            # reinstall after editing one file recompiles that file only.
            if getattr(self, "editable_mode", False):
                self.build_temp = os.path.join(_ROOT, "build", "temp-editable")

        def build_extensions(self):
            jobs = _jobs()
            what = f"{len(cpu_sources)} C++ files"
            if with_cuda:
                arch = os.environ["TORCH_CUDA_ARCH_LIST"]
                what += f" + {len(cuda_sources)} CUDA files (arch {arch}; several minutes)"
            _say(f"CUDA kernels {'on' if with_cuda else 'off'}: {why}")
            _say(f"compiling pyattr._C from {what} with {jobs} parallel job(s) (MAX_JOBS); "
                 "ninja prints [n/N] as each file finishes and skips files already built")
            t0 = time.monotonic()
            super().build_extensions()
            _say(f"pyattr._C built in {time.monotonic() - t0:.0f} s")

    cmdclass = {"build_ext": _BuildExt}

setup(
    packages=packages,
    package_dir={"pyattr.kernels": "kernels"},
    package_data={"pyattr.toy": ["induction/*.json", "induction/*.safetensors"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

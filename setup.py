"""Build for pyattr.

Packages: ``pyattr`` and ``kernels/`` shipped as ``pyattr.kernels``. The C++/CUDA
extension ``pyattr._C`` is built from ``csrc/`` with ``torch.utils.cpp_extension`` once
sources exist there (DESIGN §5); install with ``--no-build-isolation`` so it is built
against the torch that will run it.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

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
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
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


if cpu_sources:
    _cuda_home_hint()
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
    import torch

    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    with_cuda = bool(cuda_sources) and (
        os.environ.get("PYATTR_FORCE_CUDA") == "1"
        or (torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc") is not None)
    )
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
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    packages=packages,
    package_dir={"pyattr.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

"""Build for pyattr.

Packages: ``pyattr`` and ``kernels/`` shipped as ``pyattr.kernels``. The C++/CUDA
extension ``pyattr._C`` is built from ``csrc/`` with ``torch.utils.cpp_extension`` once
sources exist there (DESIGN §5); install with ``--no-build-isolation`` so it is built
against the torch that will run it.
"""

import glob
import os

from setuptools import find_packages, setup

packages = find_packages(include=["pyattr", "pyattr.*"]) + ["pyattr.kernels"]
ext_modules, cmdclass = [], {}

cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))


def cpu_flags():
    """AVX2/FMA code paths of at::vec when the build machine has them (the extension is
    built from source on the machine that runs it; PYATTR_NO_AVX2=1 opts out)."""
    flags = ["-O3"]
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    if os.environ.get("PYATTR_NO_AVX2") != "1" and " avx2" in info and " fma" in info:
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return flags


if cpu_sources:
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
    import torch

    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    with_cuda = bool(cuda_sources) and (
        os.environ.get("PYATTR_FORCE_CUDA") == "1" or (torch.version.cuda is not None and CUDA_HOME is not None)
    )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    if with_cuda:
        ext = CUDAExtension(
            "pyattr._C",
            cpu_sources + cuda_sources,
            define_macros=[("PYATTR_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cpu_flags(), "nvcc": ["-O3"]},
        )
    else:
        ext = CppExtension("pyattr._C", cpu_sources, extra_compile_args={"cxx": cpu_flags()})
    ext_modules = [ext]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    packages=packages,
    package_dir={"pyattr.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

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
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
        )
    else:
        ext = CppExtension("pyattr._C", cpu_sources, extra_compile_args={"cxx": ["-O3"]})
    ext_modules = [ext]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    packages=packages,
    package_dir={"pyattr.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

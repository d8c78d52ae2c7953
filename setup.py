"""Build for pyattr.

Packages: ``pyattr``, with ``kernels/`` copied in as ``pyattr.kernels``; the C++/CUDA sources
of ``csrc/`` ship in every wheel as ``pyattr/_csrc`` (MANIFEST.in puts them in the sdist).

The extension ``pyattr._C`` is compiled here, with ``torch.utils.cpp_extension`` and
ninja (DESIGN §5), only when torch is importable while building: ``pip install
--no-build-isolation`` (``make install`` does that), so that it is built against the torch
that will run it, and ``_C_build.json`` beside it names that torch. With build isolation
(a plain ``pip install``) the build environment has no torch, the wheel is pure Python,
and pyattr compiles the shipped sources against the user's torch on first use
(``pyattr.backends.build``), which leaves the user's torch in place.

The flags live in ``pyattr/backends/build.py`` (one set for both routes), read here by
file path so that nothing of pyattr is imported.

Environment:
  PYATTR_BUILD_EXT       0: never compile here (a pure-Python wheel even with torch);
                         1: compile, and fail when torch is not importable.
                         Unset: compile when torch is importable.
  PYATTR_FORCE_CUDA      1: build the CUDA kernels even without a GPU (CI does, so a CUDA
                         compile or link error fails there); 0: never. Unset: only when
                         torch sees a GPU (and nvcc is found).
  MAX_JOBS               parallel compiles (default: the cores this process may use)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default 8.0;9.0)
  PYATTR_CPU_CAPABILITY  AVX2 or DEFAULT caps the CPU vector width
"""

import importlib.util
import os
import shutil
import sys
import time

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py as _build_py

_ROOT = os.path.dirname(os.path.abspath(__file__))


def _build_module():
    spec = importlib.util.spec_from_file_location(
        "_pyattr_build", os.path.join(_ROOT, "pyattr", "backends", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


B = _build_module()
packages = find_packages(include=["pyattr", "pyattr.*"])
ext_modules = []


def _say(msg):
    print(f"pyattr build: {msg}", file=sys.stderr, flush=True)


class _BuildPy(_build_py):
    """Copies kernels/ into the wheel as pyattr/kernels (the Triton kernels: the folder has
    no __init__.py, so that a checkout's root on sys.path never shadows the `kernels`
    package transformers imports; pyattr/kernels/__init__.py is the package) and csrc/ as
    pyattr/_csrc (every source and header), for the first-use compile, and the Markdown
    pages of docs/ as pyattr/_docs (``pyattr docs``). An editable install reads all three
    from the checkout instead."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        ksrc, kdst = os.path.join(_ROOT, "kernels"), os.path.join(self.build_lib, "pyattr", "kernels")
        names = sorted(f for f in os.listdir(ksrc) if f.endswith(".py"))
        for f in names:
            self.copy_file(os.path.join(ksrc, f), os.path.join(kdst, f))
        _say(f"{len(names)} Triton kernel modules shipped as pyattr.kernels")
        src = os.path.join(_ROOT, "csrc")
        dst = os.path.join(self.build_lib, "pyattr", "_csrc")
        n = 0
        for d, _, files in os.walk(src):
            for f in sorted(files):
                if f.endswith(B.SOURCE_SUFFIXES):
                    rel = os.path.relpath(os.path.join(d, f), src)
                    os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
                    shutil.copyfile(os.path.join(d, f), os.path.join(dst, rel))
                    n += 1
        _say(f"{n} C++/CUDA sources shipped as pyattr/_csrc")
        # the documentation pages, for `pyattr docs` (the site needs no network either)
        dsrc, ddst = os.path.join(_ROOT, "docs"), os.path.join(self.build_lib, "pyattr", "_docs")
        n = 0
        for d, _, files in os.walk(dsrc):
            for f in sorted(files):
                if f.endswith(".md"):
                    rel = os.path.relpath(os.path.join(d, f), dsrc)
                    os.makedirs(os.path.dirname(os.path.join(ddst, rel)), exist_ok=True)
                    shutil.copyfile(os.path.join(d, f), os.path.join(ddst, rel))
                    n += 1
        _say(f"{n} documentation pages shipped as pyattr/_docs (pyattr docs)")


cmdclass = {"build_py": _BuildPy}


def _torch_or_why():
    """(torch, "") when the extension is compiled here, else (None, why not)."""
    want = os.environ.get("PYATTR_BUILD_EXT", "").strip()
    if want == "0":
        return None, "PYATTR_BUILD_EXT=0"
    try:
        import torch
    except ImportError as e:
        if want == "1":
            raise SystemExit(f"pyattr build: PYATTR_BUILD_EXT=1 but torch is not importable ({e}); "
                             "install torch first and build with --no-build-isolation")
        return None, ("torch is not importable in the build environment (build isolation); "
                      "the wheel is pure Python and pyattr compiles pyattr._C against the "
                      "installed torch on first use")
    return torch, ""


cpu_sources, cuda_sources = B.sources(os.path.join(_ROOT, "csrc"))
cpu_sources = [os.path.relpath(p, _ROOT) for p in cpu_sources]
cuda_sources = [os.path.relpath(p, _ROOT) for p in cuda_sources]
torch, why_not = _torch_or_why() if cpu_sources else (None, "no C++ sources")
if torch is None:
    _say(f"pyattr._C is not compiled here: {why_not}")

if torch is not None:
    B.cuda_home_hint()
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    with_cuda, why = B.want_cuda(torch, cuda_sources)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    if with_cuda:
        ext = CUDAExtension(
            "pyattr._C",
            cpu_sources + cuda_sources,
            define_macros=[("PYATTR_WITH_CUDA", "1")],
            include_dirs=B.nvidia_include_dirs(),
            extra_compile_args={"cxx": B.cpu_flags(), "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "pyattr._C", cpu_sources, extra_compile_args={"cxx": B.cpu_flags()}, extra_link_args=["-fopenmp"]
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
            jobs = B.jobs()
            what = f"{len(cpu_sources)} C++ files"
            if with_cuda:
                arch = os.environ["TORCH_CUDA_ARCH_LIST"]
                what += f" + {len(cuda_sources)} CUDA files (arch {arch}; several minutes)"
            _say(f"CUDA kernels {'on' if with_cuda else 'off'}: {why}")
            _say(f"compiling pyattr._C from {what} against torch {torch.__version__} with {jobs} "
                 "parallel job(s) (MAX_JOBS); ninja prints [n/N] as each file finishes and skips "
                 "files already built")
            t0 = time.monotonic()
            super().build_extensions()
            seconds = time.monotonic() - t0
            # beside the library: the torch it is built against, checked before it is imported
            where = {os.path.dirname(self.get_ext_fullpath("pyattr._C"))}
            if self.inplace or getattr(self, "editable_mode", False):  # the library is copied to pyattr/
                where.add(os.path.join(_ROOT, "pyattr"))
            for d in where:
                B.write_info(os.path.join(d, B.INFO_NAME), torch, with_cuda)
            _say(f"pyattr._C built in {seconds:.0f} s")

    cmdclass["build_ext"] = _BuildExt

setup(
    packages=packages,
    # the CPU kernels prebuilt over torch's stable ABI (pyattr/backends/stable.py; make stable)
    package_data={"pyattr": ["_C_stable.abi3.so", "_C_stable.json"],
                  "pyattr.toy": ["induction/*.json", "induction/*.safetensors", "induction_b/*.json",
                                 "induction_b/*.safetensors", "induction_4l/*.json",
                                 "induction_4l/*.safetensors", "squares/*.json",
                                 "squares/*.safetensors", "translation/*.json", "translation/*.safetensors"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

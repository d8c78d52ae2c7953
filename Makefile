# Two entry points, each doing all set-up on a fresh machine:
#   make demo   installs pyattr and runs `pyattr explain` on the bundled model
#   make test   installs pyattr and runs the test suite (without the slow tier; make test-slow: only
#               the slow tier; make test-all: every tier at once)
#   make docs   builds the documentation site into site/ (mkdocs, warnings as errors)
# Both share one install (pyattr[demo,dev], editable, built against .venv's torch): the
# second command reinstalls only when setup.py, pyproject.toml, MANIFEST.in, a file under
# csrc/ or a build setting (PYATTR_FORCE_CUDA, PYATTR_CPU_CAPABILITY, TORCH_CUDA_ARCH_LIST,
# the GPUs nvidia-smi lists) changed, and then recompiles only what changed (build/).
SHELL       := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.14.1
EXTRAS ?= demo,dev
PIP    := $(PY) -m pip install --no-input --disable-pip-version-check
# torch and the dependencies install with uv (downloads in parallel, unpacks while it
# downloads: torch with its nvidia-* wheels in about 30 s, the ~100 dependencies in about
# 10 s, against 73 s and 118 s with pip on the 2-core machine); uv itself comes from the
# package index into .venv by pip. The editable build of pyattr stays with pip, whose
# verbose log this file reads.
UV     := $(VENV)/bin/uv
UVPIP  := $(UV) pip install --compile-bytecode --python $(PY)
# Bytecode is compiled at install (uv's --compile-bytecode; compileall for pyattr and the
# tests): where PYTHONDONTWRITEBYTECODE is set, as on the CI machines, no import writes a
# .pyc, so without this every process (each pytest worker, each CLI subprocess a test
# starts) compiled torch, transformers and pyattr from source again: make test took 149 s
# on a fresh clone instead of 96 s.
PYC    := $(PY) -m compileall -q -j 0
STAMP  := $(VENV)/.pyattr-installed
CONFIG := $(VENV)/.pyattr-build-settings
LOG    := $(VENV)/pyattr-install.log
CSRC   := $(shell find csrc 2>/dev/null)
SETTINGS = extras=$(EXTRAS) force_cuda=$(PYATTR_FORCE_CUDA) cpu=$(PYATTR_CPU_CAPABILITY) \
  arch=$(TORCH_CUDA_ARCH_LIST) visible=$(CUDA_VISIBLE_DEVICES) \
  gpus=$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')

step = @echo "==> [$$(date +%T)] $(1)"

# What the installs show of pip -v and uv (all of it goes to the logs), each line with the
# seconds since the step began: pip's and uv's progress, setup.py's "pyattr build:" lines, each file ninja
# finishes compiling ([n/N]), the link, and compiler errors and warnings.
define SHOW
import re, sys, time
t0 = time.monotonic()
tag = sys.argv[1] + " " if len(sys.argv) > 1 else ""
def out(s):
    print(f"  {tag}{time.monotonic() - t0:4.0f}s  {s}", flush=True)
for line in iter(sys.stdin.readline, ""):
    s = line.strip()
    m = re.match(r"\[(\d+)/(\d+)\] ", s)
    if m:
        tok = s.split()
        src = next((b for a, b in zip(tok, tok[1:]) if a == "-c" and b.endswith((".cpp", ".cu"))), "")
        out(f"[{m[1]}/{m[2]}] compiled {src[src.find('csrc/'):] if 'csrc/' in src else src}")
    elif " -shared " in s and "pyattr/_C." in s:
        out("linking pyattr._C")
    elif "pyattr build:" in s:
        out(s[s.find("pyattr build:"):])
    elif s.startswith(("Collecting", "Installing collected", "Successfully installed", "ERROR",
                       "Resolved ", "Prepared ", "Installed ", "Uninstalled ", "error:")):
        out(s)
    elif "warning:" in s and "csrc/" not in s:
        continue  # warnings from torch's and the compiler's headers (hundreds with AVX-512): the log has them
    elif ("error" in s.lower() or "warning:" in s) and "no previously-included" not in s:
        out(s)
endef
export SHOW

.PHONY: demo test test-slow test-all docs install venv stable FORCE

$(VENV)/.torch-installed:
	$(call step,creating $(VENV) with $(TORCH) (about 30 s))
	python3 -m venv $(VENV)
	@{ $(PIP) "uv>=0.5" && $(UVPIP) "$(TORCH)" "setuptools>=64" wheel ninja numpy; } 2>&1 \
	  | tee $(VENV)/torch-install.log | $(PY) -u -c "$$SHOW" || { tail -n 30 $(VENV)/torch-install.log; exit 1; }
	touch $@

venv: $(VENV)/.torch-installed

# Rewritten only when the settings differ from the last install's, so that its mtime
# says when they last changed.
$(CONFIG): FORCE
	@mkdir -p $(VENV)
	@echo '$(SETTINGS)' | cmp -s - $@ || echo '$(SETTINGS)' > $@

# pyattr's dependencies (pyproject.toml: dependencies + the extras) install with uv in the
# background while the foreground pip builds pyattr._C and installs pyattr alone: the
# compile is CPU-bound, the dependency install mostly download and unpacking, so the two
# overlap. The two install disjoint sets of packages (what the build uses, torch,
# setuptools and ninja, is already there).
define REQS
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project.get("optional-dependencies", {})
print("\n".join(project.get("dependencies", []) + [r for e in sys.argv[1].split(",") for r in extras[e]]))
endef
export REQS
DEPS_LOG := $(VENV)/deps-install.log
# inseq 0.7.1 (dev extra) declares typeguard<=2.13.3 without importing it, TransformerLens 4
# (dev extra) needs typeguard>=4.2: the override lets both install (inseq's tests run with it)
OVERRIDES := typeguard>=4.2,<5

$(STAMP): $(VENV)/.torch-installed $(CONFIG) setup.py pyproject.toml MANIFEST.in $(CSRC)
	$(call step,installing pyattr[$(EXTRAS)]: building pyattr._C (log $(LOG)) while the dependencies install (lines marked deps; log $(DEPS_LOG)))
	@$(PY) -c "$$REQS" '$(EXTRAS)' > $(VENV)/requirements.txt
	@echo '$(OVERRIDES)' > $(VENV)/overrides.txt
	@( $(UVPIP) -r $(VENV)/requirements.txt --override $(VENV)/overrides.txt 2>&1 | tee $(DEPS_LOG) | $(PY) -u -c "$$SHOW" deps ) & deps=$$!; \
	if ! PYTHONUNBUFFERED=1 $(PIP) -v --no-build-isolation --no-deps -e . 2>&1 \
	    | tee $(LOG) | $(PY) -u -c "$$SHOW"; then \
	  echo "build failed; the last 60 lines of $(LOG):"; tail -n 60 $(LOG); \
	  wait $$deps; exit 1; \
	fi; \
	wait $$deps || { echo "dependency install failed; the last 30 lines of $(DEPS_LOG):"; \
	  tail -n 30 $(DEPS_LOG); exit 1; }
	@$(PYC) pyattr
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(call step,pyattr explain)
	$(VENV)/bin/pyattr explain

# pytest's exit status fails make on any failure and on exit 5 (no tests collected).
# Two tiers (tests/conftest.py): `make test` leaves out what is marked slow (torch.compile,
# subprocess and benchmark-harness runs, Triton kernels under the CPU interpreter);
# `make test-slow` runs only what `make test` leaves out, and `make test-all` both at once.
# CI (.ci/run) runs `make test`, the README's command as written, then `make test-slow`:
# every test once. pytest-xdist spreads the tests over the cores, one intra-op thread per
# worker, a test file per worker (the README tests share one working directory across the
# file). No test's numbers depend on the order (tests/conftest.py seeds each test).
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile
test: $(STAMP)
	$(call step,pytest without the slow tier (about 2 minutes on 2 cores))
	@$(PYC) pyattr tests
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(call step,pytest: only the slow tier (about 4 minutes on 2 cores))
	@$(PYC) pyattr tests
	$(PYTEST) -m slow

test-all: $(STAMP)
	$(call step,pytest: every tier (about 6 minutes on 2 cores))
	@$(PYC) pyattr tests
	$(PYTEST)

# The CPU kernels prebuilt over torch's stable ABI (pyattr/_C_stable.abi3.so and its record
# _C_stable.json, tracked in git and shipped in every wheel, so that an install needs no
# compiler): rebuild them after changing their sources; CI fails while they are stale.
stable: $(STAMP)
	$(call step,building pyattr/_C_stable.abi3.so (about 1 minute on 2 cores))
	$(PY) -m pyattr.backends.stable

# The documentation site (docs/, mkdocs.yml) into site/, warnings as errors; the tests
# build it too (tests/test_docs.py), and run every code block of it.
docs: $(STAMP)
	$(call step,mkdocs build --strict into site/)
	$(VENV)/bin/mkdocs build --strict

# Two entry points, each doing all set-up on a fresh machine:
#   make demo   installs pyattr with the bundled model and runs `pyattr explain`
#   make test   installs pyattr with the test dependencies and runs the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.14.1
PIP    := $(PY) -m pip install --no-input --disable-pip-version-check

.PHONY: demo test venv install-demo install-dev

$(VENV)/.torch-installed:
	python3 -m venv $(VENV)
	$(PIP) -q "$(TORCH)" "setuptools>=64" wheel ninja
	touch $@

venv: $(VENV)/.torch-installed

install-demo: venv
	$(PIP) -q --no-build-isolation -e '.[demo]'

install-dev: venv
	$(PIP) -q --no-build-isolation -e '.[dev]'

demo: install-demo
	$(VENV)/bin/pyattr explain

test: install-dev
	$(PY) -m pytest -q

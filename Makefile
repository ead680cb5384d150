# Two entry points for a fresh machine (see README): `make` and `make test`.
# Everything below reads versions from stack.toml through the package; nothing here restates one.
SHELL := /bin/bash
.DEFAULT_GOAL := all
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CLI := $(VENV)/bin/ucx-dask-gpu

.PHONY: all test prereqs venv regen check-generated unit

all: prereqs venv
	$(CLI) stack validate

prereqs:
	ci/install_prereqs.sh

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml stack.toml locks/image-py311-linux-64.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --require-hashes -r locks/image-py311-linux-64.txt
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

regen: venv
	$(CLI) stack env-yml

unit: venv
	$(VPY) -m pytest -q tests/unit

test: prereqs venv
	$(VPY) -m pytest tests

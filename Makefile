# Two entry points for a fresh machine (see README): `make` and `make test`.
# Everything below reads versions from stack.toml through the package; nothing here restates one.
SHELL := /bin/bash
.DEFAULT_GOAL := all
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CLI := $(VENV)/bin/ucx-dask-gpu

.PHONY: all test prereqs venv regen check-generated unit ucx doctor gpu-verify

# `make`: prerequisites, UCX from verified source, what this machine runs on, the one image, the 3-role cluster
# (scheduler + 2 workers + client) running the workloads over ucx and tcp with a report; on a GPU host also NVLink.
all: prereqs venv ucx doctor cluster-demo gpu-verify

doctor: venv ucx
	$(CLI) doctor --ucx-prefix $(UCX_PREFIX)

# Pair by pair, from our UCX and the pip libucx side by side (scripts/verify_nvlink.sh); skipped, saying so, without GPUs.
gpu-verify: venv ucx
	@if nvidia-smi -L >/dev/null 2>&1; then \
	  scripts/verify_nvlink.sh --ucx-prefix $(UCX_PREFIX) --ucx-prefix pip --out build/verify-nvlink; \
	else echo "gpu-verify: no NVIDIA GPU here, NVLink not verified (run scripts/verify_nvlink.sh on a GPU host)"; fi

prereqs:
	ci/install_prereqs.sh

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml stack.toml locks/image-py311-linux-64.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --require-hashes -r locks/image-py311-linux-64.txt
	$(VPY) -m pip install -q -e '.[test]'
	@# The SBOM generator at the version stack.toml [sbom] pins (its output is part of the image's bytes).
	$(VPY) -m pip install -q "$$($(VPY) -m ucx_dask_gpu stack get sbom.generator)==$$($(VPY) -m ucx_dask_gpu stack get sbom.generator_version)"
	touch $@

# UCX from verified source (ucx-src-build/README.md): rebuilt when its inputs change; downloads cached in .cache/sources.
# The integration tests use this prefix (UCX_PREFIX).
# A separate stamp: the prefix's own files carry source_date_epoch mtimes (reproducible), too old for make.
export UCX_PREFIX ?= build/ucx-prefix
ucx: $(UCX_PREFIX).stamp
$(UCX_PREFIX).stamp: stack.toml $(wildcard ucx-src-build/patches/*/*.patch) $(wildcard src/ucx_dask_gpu/ucxbuild/*.py) | prereqs
	ucx-src-build/build.sh build --prefix $(UCX_PREFIX) --work-dir build/ucx-work --require ib,cuda
	touch $@

# The one image for client, scheduler and workers (docker/Dockerfile), and its cluster demo. `image` starts a Docker
# engine when none runs (root), fetches + verifies every input, then builds with --network none (a warm rebuild is
# a cache hit); `cluster-demo` runs scheduler + 2 workers + client over ucx and tcp, reports and stops cleanly.
.PHONY: docker-engine image cluster-demo
docker-engine:
	ci/start_dockerd.sh
image: venv docker-engine
	scripts/build_image.sh
cluster-demo: image
	$(CLI) image demo
# Two clean builds of the image must give the same image id (README "Reproducible image and SBOM").
.PHONY: check-reproducible
check-reproducible: venv docker-engine
	scripts/check_reproducible.sh

regen: venv
	$(CLI) stack env-yml
	$(CLI) conda regen

# Local conda channel (README "Conda"): rattler-build renders and checks every recipe variant against stack.toml, builds
# ucx and the metapackage from their recipes (stand-in build/host requirements), py-rattler indexes and installs,
# rattler-build runs the recipes' tests; $(CHANNEL) appears only when all passed.
.PHONY: channel
CHANNEL ?= build/channel
channel: prereqs venv
	$(CLI) conda channel --out $(CHANNEL)

unit: venv
	$(VPY) -m pytest -q tests/unit

test: prereqs venv ucx
	$(VPY) -m pytest tests

# Two entry points for a fresh machine (README; every target: docs/building.md): `make` and `make test`.
# Everything below reads versions from stack.toml through the package; nothing here restates one.
SHELL := /bin/bash
.DEFAULT_GOAL := all
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CLI := $(VENV)/bin/ucx-dask-gpu
# Where UCX (make ucx) and the UCXX wheels (make ucxx) are built; the tests and the image build read them from here.
export UCX_PREFIX ?= build/ucx-prefix
export UCXX_WHEELS ?= build/ucxx-wheels
# The hash-pinned Python locks are where stack.toml says ([python].lock, [ucxx.build].lock); `stack get` needs only the
# standard library, so the system python3 reads them before the venv exists.
# A stack.toml the package refuses stops make here with the package's one line (not with empty variables further on).
STACK_GET := PYTHONPATH=src $(PY) -m ucx_dask_gpu stack get
STACK_GET_FAILED := stack-get-failed:
stack_get = $(strip $(eval _stack_value := $(shell $(STACK_GET) $(1) 2>&1 || echo "$(STACK_GET_FAILED)"))$(if \
  $(findstring $(STACK_GET_FAILED),$(_stack_value)),$(error $(strip $(subst $(STACK_GET_FAILED),,$(_stack_value)))),\
  $(_stack_value)))
IMAGE_LOCK := $(call stack_get,python.lock)
UCXX_BUILD_LOCK := $(call stack_get,ucxx.build.lock)
TEST_TOOLS_LOCK := $(call stack_get,test_tools.lock)

.PHONY: all test prereqs sources venv regen check-generated unit ucx ucxx doctor gpu-verify lock

# `make`: every source archive fetched and verified first, prerequisites, UCX and UCXX from that source, what this
# machine runs on, the one image, the 3-role cluster (scheduler + 2 workers + client) running the workloads over ucx
# and tcp with a report; on a GPU host also NVLink. At its end it says what it leaves on the machine (an apt source,
# a running Docker engine) and how to undo each.
all: sources prereqs venv ucx ucxx doctor cluster-demo gpu-verify
	@ci/apt_sources.sh --status
	@ci/start_dockerd.sh --status

doctor: venv ucx
	$(CLI) doctor --ucx-prefix $(UCX_PREFIX)

# Pair by pair, from our UCX (scripts/verify_nvlink.sh; `--ucx-prefix pip` adds a libucx wheel's UCX for comparison
# where one is installed); skipped, saying so, without GPUs.
gpu-verify: venv ucx
	@if nvidia-smi -L >/dev/null 2>&1; then \
	  scripts/verify_nvlink.sh --ucx-prefix $(UCX_PREFIX) --out build/verify-nvlink; \
	else echo "gpu-verify: no NVIDIA GPU here, NVLink not verified (run scripts/verify_nvlink.sh on a GPU host)"; fi

prereqs:
	ci/install_prereqs.sh

# Every pinned source archive (UCX, UCXX, rapids-cmake, CPM.cmake) fetched and verified into the download cache before
# anything compiles: all missing ones are named in one line at once. Upstream (GitHub) first, then a source mirror:
# `make SOURCES=DIR` names a directory holding the archives under stack.toml's names ($UCX_DASK_GPU_SOURCE_MIRROR for
# every step below). Verified again when stack.toml changes.
ifdef SOURCES
export UCX_DASK_GPU_SOURCE_MIRROR := $(abspath $(SOURCES))
endif
sources: build/sources.stamp
build/sources.stamp: stack.toml
	ucx-src-build/build.sh fetch --all --no-cuda
	@mkdir -p $(@D) && touch $@

# The venv runs on our stack: the hashed lock (no UCXX, no libucx wheel), our UCXX wheels --no-deps on top with a
# start-up preload of our UCX's libucp (ucx-src-build/build.sh install-ucxx: UCXX loads no other UCX), this package,
# and the launchers the tests generate commands with (stack.toml [test_tools], hash-locked on the same versions).
# In two steps: all but UCXX needs nothing built (`make test` installs it while UCX compiles), then our UCXX wheels.
venv: $(VENV)/.installed
$(VENV)/.base: pyproject.toml stack.toml $(IMAGE_LOCK) $(TEST_TOOLS_LOCK)
	$(PY) -m venv --clear $(VENV)
	$(VPY) -m pip install -q --require-hashes -r $(IMAGE_LOCK)
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --require-hashes -r $(TEST_TOOLS_LOCK)
	@# The SBOM generator at the version stack.toml [sbom] pins (its output is part of the image's bytes).
	$(VPY) -m pip install -q "$$($(VPY) -m ucx_dask_gpu stack get sbom.generator)==$$($(VPY) -m ucx_dask_gpu stack get sbom.generator_version)"
	touch $@
$(VENV)/.installed: $(VENV)/.base $(UCXX_WHEELS).stamp
	ucx-src-build/build.sh install-ucxx --python $(VPY) --wheels $(UCXX_WHEELS) --ucx-prefix $(UCX_PREFIX)
	$(VPY) -m pip check
	touch $@

# UCX from verified source (ucx-src-build/README.md); downloads cached in .cache/sources. The integration tests use
# this prefix (UCX_PREFIX). The build always runs and does nothing when the prefix holds a build of the same inputs
# (its input key: sources, patches, flags, compilers and tools, ...; not the checkout's path, which does not reach the
# bytes); the stamp holds that key and changes exactly when the prefix does, so what depends on it rebuilds then only.
.PHONY: FORCE
ucx: $(UCX_PREFIX).stamp
$(UCX_PREFIX).stamp: FORCE | sources prereqs
	ucx-src-build/build.sh build --prefix $(UCX_PREFIX) --work-dir build/ucx-work --require ib,cuda --stamp $@

# UCXX (libucxx, ucxx, distributed-ucxx wheels) from verified source against that UCX, offline in a network namespace;
# a build with the same input key (patches under ucx-src-build/patches/ucxx-<version>/, the UCX it compiles against,
# compilers, ... included) is taken from .cache/ucxx-builds. The venv and the image install these wheels.
ucxx: $(UCXX_WHEELS).stamp
$(UCXX_WHEELS).stamp: $(UCX_PREFIX).stamp FORCE | sources
	ucx-src-build/build.sh ucxx --ucx-prefix $(UCX_PREFIX) --out $(UCXX_WHEELS) --work-dir build/ucxx-work --stamp $@

# Re-resolve the hash-pinned Python locks (runtime, UCXX build) from stack.toml (needs PyPI and uv).
lock: venv
	$(VPY) -m pip install -q uv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(CLI) stack lock

# The one image for client, scheduler and workers (docker/Dockerfile), and its cluster demo. `image` starts a Docker
# engine when none runs (root), fetches + verifies every input, then builds with --network none (a warm rebuild is
# a cache hit); `cluster-demo` runs scheduler + 2 workers + client over ucx and tcp, reports and stops cleanly.
.PHONY: docker-engine image cluster-demo clean-images
docker-engine:
	ci/start_dockerd.sh
image: venv docker-engine
	scripts/build_image.sh
cluster-demo: image
	$(CLI) image demo
# Every image this checkout's builds made (each build already removes what the previous build of its tag left and
# it no longer uses); the next image build is cold.
clean-images: venv
	$(CLI) image clean
# Two clones at different paths, built with nothing cached, must give the same UCX prefix, UCXX wheels and image id
# (docs/reproducibility.md).
.PHONY: check-reproducible
check-reproducible: venv docker-engine
	scripts/check_reproducible.sh

regen: venv
	$(CLI) stack env-yml
	$(CLI) conda regen
	$(VPY) -m tools.docmap --write

# Local conda channel (docs/conda.md): rattler-build renders and checks every recipe variant under conda-forge's pinning
# (else the recipes' fallback), builds ucx, libucxx, ucxx, distributed-ucxx and the metapackage from their recipes
# (stand-ins for what only conda-forge/rapidsai have; packages kept by input hash in .cache/conda-builds), py-rattler
# indexes and installs `ucx-dask-gpu cuda-version=<major>.0` into a fresh prefix, the recipes' tests run;
# $(CHANNEL) appears only when all passed. Its packages are stand-in builds (build strings `_standin`), never
# published: build/channel is what ci/conda_build.sh builds with the real requirements, and what an upload reads.
.PHONY: channel
CHANNEL ?= build/standin-channel
channel: prereqs venv
	$(VPY) -m tools.conda_standin channel --out $(CHANNEL)

unit: venv
	$(VPY) -m pytest -q tests/unit

# Two pytest-xdist workers, handed groups of test modules longest first (the Docker engine's, the conda channel's, the
# two-clone rebuild's, then each other module: tests/conftest.py). TEST_WORKERS=0: one process, in that order.
TEST_WORKERS ?= 2
test: sources prereqs
	@# The venv's downloads and installs run while UCX compiles; UCXX needs that UCX, the venv its wheels.
	$(MAKE) -j2 ucx $(VENV)/.base
	$(MAKE) ucxx venv
	$(VPY) -m pytest tests --durations=30 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

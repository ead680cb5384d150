"""Fixtures of the integration tests: the shipped dask config, and real `dask scheduler` / `dask worker` processes,
each with its own environment.

Every process gets an isolated dask config: DASK_ROOT_CONFIG points at an empty directory (so a host-wide /etc/dask
cannot leak in) and DASK_CONFIG at the config under test (usually the shipped one, installed by the test).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.repro_check.check import holding_lock
from ucx_dask_gpu.gate import daskconfig
from ucx_dask_gpu.proof.launchers import DaskProcess


def env_for(tmp: Path, config_dir: Path | None, extra_path: Path | None = None) -> dict[str, str]:
    """The environment of one process: its own dask config (none: an empty one) and, with `extra_path`, a directory
    of installed distributions ahead of the venv's (other versions than the venv's: another environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    empty = tmp / "empty-dask-config"
    empty.mkdir(exist_ok=True)
    env["DASK_ROOT_CONFIG"] = str(empty)
    env["DASK_CONFIG"] = str(config_dir or empty)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return env


def start_scheduler(tmp: Path, env: dict[str, str], name: str = "scheduler", protocol: str = "tcp",
                    timeout: float = 90) -> tuple[DaskProcess, str]:
    proc = DaskProcess.scheduler(sys.executable, env, tmp, name, protocol)
    try:
        return proc, proc.address(timeout)
    except (ChildProcessError, TimeoutError):
        proc.stop()
        raise


def start_worker(tmp: Path, env: dict[str, str], address: str, name: str, nanny: bool = True,
                 extra_args: tuple[str, ...] = ()) -> DaskProcess:
    return DaskProcess.worker(sys.executable, env, tmp, name, address, nanny=nanny, extra=extra_args)


def run_python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def workload(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ucx-dask-gpu workload ARGS` in its own process (the CLI a user runs)."""
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "workload", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def procs() -> SimpleNamespace:
    """env_for, start_scheduler, start_worker, run_python, workload: see each one's docstring."""
    return SimpleNamespace(env_for=env_for, start_scheduler=start_scheduler, start_worker=start_worker,
                           run_python=run_python, workload=workload)


@pytest.fixture(scope="module")
def shipped_config(tmp_path_factory) -> Path:
    """The dask config the image ships (transports left to UCX), installed into a directory of its own."""
    d = tmp_path_factory.mktemp("dask-config")
    daskconfig.install(d)
    return d


@pytest.fixture(scope="session")
def docker_lock(tmp_path_factory) -> Path:
    """A lock file shared by every worker of this test run (`make test` runs two, tests/conftest.py says how), held
    around what changes the one Docker engine for both: starting it, building an image, the Debian bases (also a
    command's --docker-lock)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "docker.lock"


@pytest.fixture(scope="session")
def docker_exclusive(docker_lock):
    """`with docker_exclusive():` holds the run's docker lock: the other worker waits, then finds the engine started,
    the image built."""
    return functools.partial(holding_lock, docker_lock)


@pytest.fixture(scope="session")
def engine(docker_exclusive):
    """A Docker engine that answers (started when none runs, as root)."""
    from tools.docker_engine import ensure_engine

    with docker_exclusive():
        return ensure_engine(allow_start=True)


# A tag of its own for the image under test (a checkout that must not rebuild the image others test), e.g.
# ucx-dask-gpu:my-branch; unset: the default tag ([image].name:[stack].version).
IMAGE_TAG_ENV = "UCX_DASK_GPU_TEST_IMAGE_TAG"


@pytest.fixture(scope="session")
def build_image(build_image, docker_exclusive):
    """tests/conftest.py's build_image under the run's docker lock: no image build overlaps another worker's, nor the
    reproducibility check's (which bootstraps the Debian bases again, moving their tags)."""
    def locked(*args: str, **kwargs) -> dict:
        with docker_exclusive():
            return build_image(*args, **kwargs)

    return locked


@pytest.fixture(scope="session")
def image(engine, st, build_image) -> dict:
    """The image, built the way a user builds it (a warm Docker cache makes that a no-op): its build summary."""
    tag = os.environ.get(IMAGE_TAG_ENV)
    return build_image(*(("--tag", tag) if tag else ()))

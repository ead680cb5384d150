"""No Docker engine: every image/cluster entry point says so in one line and exits NO_DOCKER (7), building nothing."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import NO_DOCKER

ROOT = Path(__file__).resolve().parents[2]
NOWHERE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


@pytest.mark.parametrize("cmd", [
    ["scripts/build_image.sh"],
    ["ci/start_dockerd.sh"],            # DOCKER_HOST names another engine: not ours to start
    ["ci/start_dockerd.sh", "--no-start"],
    [".venv/bin/ucx-dask-gpu", "image", "demo"],
    [".venv/bin/ucx-dask-gpu", "image", "base"],
])
def test_missing_engine_is_one_line_exit_7(cmd, tmp_path):
    env = {**os.environ, **NOWHERE, "UCX_DASK_GPU_BUILD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == NO_DOCKER, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing Docker engine" in lines[0], proc.stderr
    assert not (tmp_path / "cache").exists()  # the engine is checked before anything is fetched or built


def test_not_root_may_not_start_an_engine(monkeypatch):
    from tools import docker_engine as dockerutil
    from ucx_dask_gpu.errors import UserError

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setattr(dockerutil, "engine_version", lambda timeout=20: (_ for _ in ()).throw(
        UserError("missing Docker engine at unix:///var/run/docker.sock (x)", NO_DOCKER)))
    monkeypatch.setattr(dockerutil.os, "geteuid", lambda: 1000)
    with pytest.raises(UserError) as err:
        dockerutil.ensure_engine()
    assert err.value.exit_code == NO_DOCKER and "not allowed to start one" in str(err.value)


def test_the_engine_make_left_running_is_named_and_only_it_is_stopped(tmp_path):
    """What `make` says at its end (`ci/start_dockerd.sh --status`) and `--stop` undoes: the dockerd processes whose
    output goes to the engine log ensure_engine opens. Real processes of a binary named dockerd (a copy of sleep): one
    writing to that log, one to another."""
    from tools import docker_engine as dockerutil

    dockerd = tmp_path / "dockerd"
    shutil.copy(shutil.which("sleep"), dockerd)
    log, elsewhere = tmp_path / "engine.log", tmp_path / "other.log"
    with open(log, "ab") as ours_out, open(elsewhere, "ab") as other_out:
        ours = subprocess.Popen([str(dockerd), "300"], stdout=ours_out)
        other = subprocess.Popen([str(dockerd), "300"], stdout=other_out)
    try:
        assert dockerutil.started_engines(str(log)) == [ours.pid]
        assert dockerutil.stop_started_engines(str(log), timeout=30) == [ours.pid]
        assert ours.wait(10) == -15 and other.poll() is None
        assert dockerutil.started_engines(str(log)) == []
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()

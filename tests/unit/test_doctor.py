"""`ucx-dask-gpu doctor` on the machine the tests run on (CI: a CPU box). Real probes, no GPU needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ucx_dask_gpu.gate import identity
from ucx_dask_gpu.ucx import install
from ucx_dask_gpu.errors import UCX_NOT_FOUND

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != install.PREFIX_ENV}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "doctor", *args], capture_output=True, text=True,
                          env=e, timeout=300)


def has_gpu() -> bool:
    try:
        from ucx_dask_gpu import nvml

        return bool(nvml.discover())
    except Exception:
        return False


@pytest.fixture(scope="module")
def report() -> dict:
    r = run("--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_sections_present(report):
    assert set(report) >= {"host", "stack", "ucx", "ucxx", "cuda", "gpu", "config"}


def test_names_the_dask_config_in_force(tmp_path):
    """With the shipped config installed where DASK_CONFIG points: its files, and every tuned setting in force."""
    from ucx_dask_gpu.gate import daskconfig

    daskconfig.install(tmp_path / "dask")
    empty = tmp_path / "root"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    r = run("--json", env=env | {"DASK_CONFIG": str(tmp_path / "dask"), "DASK_ROOT_CONFIG": str(empty)})
    config = json.loads(r.stdout)["config"]
    assert config["differ"] == {} and config["in_force"] == config["settings"] > 0
    assert str(tmp_path / "dask" / daskconfig.INSTALLED_TUNED) in [f["path"] for f in config["files"]]
    table = run(env=env | {"DASK_CONFIG": str(tmp_path / "dask"), "DASK_ROOT_CONFIG": str(empty),
                           "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "false"}).stdout
    assert "Dask config" in table and "distributed.scheduler.work-stealing=False (shipped True)" in table


def test_no_gpu_is_said_plainly_and_exits_0(report):
    if has_gpu():
        pytest.skip("this machine has a GPU; the GPU path is tests/gpu/")
    assert report["gpu"]["status"].startswith("no GPU") and report["gpu"]["gpus"] == []
    table = run()
    assert table.returncode == 0 and "no GPU" in table.stdout


def test_stack_id_is_the_one_the_guard_computes(report):
    assert report["stack"]["id"] == identity.stack_id()
    assert "computed" in report["stack"]["source"]


def test_finds_the_checkouts_ucx_prefix_without_being_told(report):
    """In a venv of this checkout (`make venv`), doctor takes the UCX the venv preloads at start-up, i.e. `make ucx`'s
    prefix, with no --ucx-prefix and from any working directory."""
    preloaded = install.preloaded_prefix(Path(sysconfig.get_paths()["purelib"]))
    if preloaded is None:
        pytest.skip(f"this Python ({sys.prefix}) was not made by `make venv`: no start-up preload of a UCX")
    r = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "doctor", "--json"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != install.PREFIX_ENV}, cwd="/", timeout=300)
    u = json.loads(r.stdout)["ucx"]
    assert u["prefix"] == str(preloaded) and "preload" in u["found_via"]
    assert u["version"] and u["libraries"]["libucp.so"].startswith(str(preloaded))


def test_ucxx_statement_matches_what_was_loaded(report):
    x = report["ucxx"]
    assert x["statement"]
    if x["runs_on"] == "wheel":  # the venv's libucx wheel, RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY unset
        assert "NOT ours" in x["statement"] and "/libucx/lib/" in x["loaded"]
        assert x["version"] and x["version"] in x["statement"]
    elif x["runs_on"] == "none":
        assert x["loaded"] is None


def test_ucx_loaded_version_matches_ucx_info_when_found(report):
    u = report["ucx"]
    if u["version"] is None:
        assert u["error"], "when no UCX loads, doctor says why"
        return
    assert Path(u["libraries"]["libucp.so"]).is_file()


def test_bad_prefix_is_one_line_and_exit_code(tmp_path):
    r = run("--ucx-prefix", str(tmp_path / "nope"))
    assert r.returncode == UCX_NOT_FOUND
    assert len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr


def test_prefix_of_library():
    assert install.prefix_of_library("/opt/ucx/lib/libucp.so.0.0.0") == Path("/opt/ucx")
    assert install.prefix_of_library("/usr/lib/x86_64-linux-gnu/libucp.so.0") is None
    assert install.prefix_of_library(None) is None


@pytest.mark.parametrize("version, expected", [("1.13.1", False), ("1.18.9", False), ("1.19.0", True),
                                               ("1.20.0", True), ("2.0", True)])
def test_ucxx_uses_our_ucx_only_from_the_minimum_version(st, version, expected):
    """What doctor says of a UCX: UCXX refuses one older than stack.toml [ucxx].min_ucx at import."""
    assert install.ucxx_can_use(st, version) is expected


def test_one_reader_per_build_info_file(tmp_path):
    """The UCX prefix's build-info.json and the UCXX wheels' ucxx-build-info.json: read one way everywhere; absent or
    not JSON is None (each caller says what that means for it)."""
    assert install.read_build_info(tmp_path) is None and install.read_build_info(None) is None
    assert install.read_ucxx_build_info(tmp_path) is None
    (tmp_path / install.BUILD_INFO).parent.mkdir(parents=True)
    (tmp_path / install.BUILD_INFO).write_text('{"ucx_version": "1.20.1"}')
    (tmp_path / install.UCXX_BUILD_INFO).write_text("not json")
    assert install.read_build_info(tmp_path) == {"ucx_version": "1.20.1"}
    assert install.at(tmp_path).kind == "source" and install.read_ucxx_build_info(tmp_path) is None
    (tmp_path / install.INSTALLED_UCXX_BUILD_INFO).write_text('{"packages": []}')
    assert install.read_ucxx_build_info(tmp_path / install.SHARE) == {"packages": []}
    assert install.INSTALLED_UCXX_BUILD_INFO.name == install.UCXX_BUILD_INFO == "ucxx-build-info.json"

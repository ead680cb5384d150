"""A broken stack.toml read by every entry point that reads it at start-up: `make` (at parse time), build.sh, the ci/
scripts, the CLI from a source tree and from an installed package. Each ends in ONE line with exit 3 (make: its own
exit 2, stopping on the package's line), never a traceback, never going on with empty values."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import BAD_STACK

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GOOD = (REPO / "stack.toml").read_bytes()
BROKEN = {
    "not-toml": GOOD.replace(b"[stack]", b"[stack", 1),
    "not-utf8": GOOD.replace(b"[stack]", b"# caf\xe9\n[stack]", 1),
    "refused-by-the-model": GOOD.replace(b'tag = "v1.20.1"', b"tag = 1", 1),
}
WHAT = {"not-toml": "not valid TOML", "not-utf8": "not UTF-8", "refused-by-the-model": "ucx.source.tag"}


def source_tree(where: Path, stack_toml: bytes) -> Path:
    """What the entry points need of a checkout: src/, the Makefile, ci/, build.sh; and this stack.toml."""
    shutil.copytree(REPO / "src", where / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "ci", where / "ci")
    (where / "ucx-src-build").mkdir()
    shutil.copy2(REPO / "ucx-src-build" / "build.sh", where / "ucx-src-build" / "build.sh")
    shutil.copy2(REPO / "Makefile", where / "Makefile")
    (where / "stack.toml").write_bytes(stack_toml)
    return where


@pytest.fixture(scope="module")
def tree_with(tmp_path_factory):
    """One source tree per stack.toml variant, shared by the module's tests (each start compiles it once)."""
    made: dict[str, Path] = {}

    def tree(kind: str) -> Path:
        if kind not in made:
            made[kind] = source_tree(tmp_path_factory.mktemp(kind), BROKEN.get(kind, GOOD))
        return made[kind]
    return tree


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "UCX_DASK_GPU_STACK")}


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# -S: no site-packages, so no installed copy's metadata answers --version (as on a bare python3).
BARE = [sys.executable, "-S", "-m", "ucx_dask_gpu"]
ENTRY_POINTS = {
    "stack get": ([*BARE, "stack", "get", "python.lock"], {"PYTHONPATH": "src"}),
    "--version": ([*BARE, "--version"], {"PYTHONPATH": "src"}),
    "build.sh": (["sh", "ucx-src-build/build.sh", "fetch", "--dest", "fetched"], {}),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_broken_stack_file_in_a_source_tree_is_one_line_exit_3(entry, broken, tree_with):
    tree = tree_with(broken)
    argv, extra = ENTRY_POINTS[entry]
    proc = subprocess.run(argv, cwd=tree, env={**clean_env(), **extra}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == BAD_STACK and WHAT[broken] in one_line(proc)
    assert not (tree / "fetched").exists()


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_make_stops_on_the_packages_line_instead_of_going_on_with_empty_values(broken, tree_with):
    tree = tree_with(broken)
    proc = subprocess.run(["make", "-n", "venv"], cwd=tree, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    line = one_line(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert line.startswith("Makefile:") and line.endswith("Stop.") and "ucx-dask-gpu stack: error:" in line
    assert WHAT[broken] in line


def test_make_reads_a_good_stack_file_as_before(tree_with):
    tree = tree_with("good")
    show = "show-locks: ; @echo $(IMAGE_LOCK) $(UCXX_BUILD_LOCK) $(TEST_TOOLS_LOCK)"
    proc = subprocess.run(["make", "--eval", show, "show-locks"], cwd=tree, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    locks = proc.stdout.split()
    assert len(locks) == 3 and all(lock.startswith("locks/") for lock in locks), proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the ci/ scripts refuse to run without root before reading stack.toml")
@pytest.mark.parametrize("script", ["ci/apt_sources.sh", "ci/install_prereqs.sh"])
def test_the_ci_scripts_stop_on_the_packages_line(script, tree_with):
    tree = tree_with("not-utf8")
    proc = subprocess.run(["bash", script], cwd=tree, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == BAD_STACK and "not UTF-8" in one_line(proc) and proc.stdout == ""


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_stack_file_in_an_installed_package_is_one_line_exit_3(broken, tmp_path):
    """The wheel's layout: the package with its stack.toml in _data/, no checkout around it, no dist metadata."""
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "src" / "ucx_dask_gpu", site / "ucx_dask_gpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "ucx_dask_gpu" / "_data").mkdir()
    (site / "ucx_dask_gpu" / "_data" / "stack.toml").write_bytes(BROKEN[broken])
    for argv in (["stack", "validate"], ["--version"], ["image", "compose"]):
        proc = subprocess.run([*BARE, *argv], cwd=tmp_path,
                              env={**clean_env(), "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == BAD_STACK and WHAT[broken] in one_line(proc), argv


@pytest.mark.skipif(not Path("/usr/bin/python3").exists() or not shutil.which("setpriv"),
                    reason="needs /usr/bin/python3 and setpriv to read as another user")
def test_an_unreadable_stack_file_is_one_line_exit_3():
    """Permission denied as a user would meet it (root reads everything: the command runs as nobody)."""
    tree = Path(tempfile.mkdtemp(prefix="udg-unreadable-"))
    try:
        os.chmod(tree, 0o755)
        source_tree(tree, GOOD)
        os.chmod(tree / "stack.toml", 0o000)
        for d, _, files in os.walk(tree / "src"):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(Path(d) / f, 0o644)
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        proc = subprocess.run([*as_user, "/usr/bin/python3", "-m", "ucx_dask_gpu", "stack", "get", "python.lock"],
                              cwd=tree, env={**clean_env(), "PYTHONPATH": "src", "PYTHONDONTWRITEBYTECODE": "1"},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == BAD_STACK and "Permission denied" in one_line(proc)
    finally:
        shutil.rmtree(tree)

"""Fixtures shared by every kind of test: the repository and its stack, and the image tests' helpers (a minimal
wheel, a real distribution under another version; the image built the way a user builds it)."""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path
from types import SimpleNamespace

import pytest

from ucx_dask_gpu import stack

REPO = Path(__file__).resolve().parents[1]

# The tests run make as a user's shell does; under `make test` the sub-make variables would make every nested make
# print "Entering directory" lines and "make[1]:" prefixes that a user never sees.
for _var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(_var, None)


# `make test` runs the suite on two pytest-xdist workers (`--dist loadscope --no-loadscope-reorder`), a group of
# tests at a time, longest first: the modules whose tests share the one Docker engine's containers (any test marked
# docker) in order on one worker; the conda channel's module (its channel built once, a library rebuilt) on the other;
# then the two-clone rebuild (its image builds, like every image build, under the run's docker lock:
# tests/integration/conftest.py); every other module whole on a worker (its fixtures made once). The grouping is the
# scheduler's own (below): xdist's `xdist_group` marks do not reach pytest 9.2's node ids.
GROUP_RANKS = {"docker-engine": 0, "conda-channel": 1, "two-clone-rebuild": 2}
MODULES_ALONE = {"test_conda_channel.py": "conda-channel", "test_reproducible_image.py": "two-clone-rebuild"}


@functools.lru_cache(maxsize=None)
def module_group(module: str) -> str:
    """The worker group of a test module (its path from the repository, as in node ids)."""
    if Path(module).name in MODULES_ALONE:
        return MODULES_ALONE[Path(module).name]
    return "docker-engine" if "mark.docker" in (REPO / module).read_text() else module


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: GROUP_RANKS.get(module_group(item.nodeid.split("::")[0]), len(GROUP_RANKS)))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid.split("::")[0])

    return ByModuleGroup(config, log)


@pytest.fixture(autouse=True)
def _the_machines_null_device_stays_one():
    """No test may replace this machine's /dev/null (a command that renames a file over a path it was given would):
    the test that does fails by name, and the device is put back so that the rest of the run is not spoilt."""
    before = os.stat("/dev/null")
    yield
    after = os.stat("/dev/null")
    if (after.st_mode, after.st_rdev, after.st_ino) != (before.st_mode, before.st_rdev, before.st_ino):
        if os.geteuid() == 0:
            os.replace(_fresh_null_device(), "/dev/null")
        pytest.fail(f"this test replaced /dev/null (now mode {after.st_mode:o}, device {after.st_rdev})")


def _fresh_null_device() -> str:
    path = f"/dev/.null-{os.getpid()}"
    os.mknod(path, 0o20666, os.makedev(1, 3))
    os.chmod(path, 0o666)
    return path


def write_legacy_command(directory: Path, name: str) -> Path:
    """`dask-scheduler` / `dask-worker` as the image has them (docker/Dockerfile writes each: the entrypoint's checks,
    then dask's own command), written the same way for this Python; the package itself installs no such name."""
    path = Path(directory) / name
    path.write_text(f"#!{sys.executable}\nimport sys\nfrom ucx_dask_gpu.image.entrypoint import legacy_main\n"
                    "sys.exit(legacy_main())\n")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="session")
def legacy_command():
    """write_legacy_command(directory, name) -> the image's `dask-scheduler` / `dask-worker` for this Python."""
    return write_legacy_command


@pytest.fixture(scope="session")
def repo() -> Path:
    """The checkout under test."""
    return REPO


@pytest.fixture(scope="session")
def st() -> stack.Stack:
    """The repository's stack.toml, loaded."""
    return stack.load(REPO / "stack.toml")


def _make_wheel(directory: Path, name: str, version: str, payload: str = "") -> Path:
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}"
    path = Path(directory) / f"{dist}-py3-none-any.whl"
    files = {
        f"{mod}/__init__.py": f"VALUE = {payload!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return path


@pytest.fixture(scope="session")
def make_wheel():
    """make_wheel(directory, name, version, payload="") -> a minimal valid pure-Python wheel `name==version`,
    built without any build backend, whose module holds `payload`."""
    return _make_wheel


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _write_wheel(path: Path, files: dict[str, bytes], dist_info: str) -> Path:
    record = "".join(_record_line(n, b) for n, b in files.items()) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, b in {**files, f"{dist_info}/RECORD": record.encode()}.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), b)
    return path


def _reversioned(wheel: Path, version: str, directory: Path) -> Path:
    """The same wheel (same code) under another version: its dist-info renamed, METADATA's Version and RECORD
    rewritten, so pip installs it as that version."""
    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n) for n in z.namelist()}
    info = next(n.split("/")[0] for n in files if n.endswith(".dist-info/METADATA"))
    project, old = info[: -len(".dist-info")].rsplit("-", 1)
    new_info = f"{project}-{version}.dist-info"
    out = {}
    for n, b in files.items():
        if n == f"{info}/RECORD":
            continue
        if n == f"{info}/METADATA":
            b = b.replace(f"\nVersion: {old}\n".encode(), f"\nVersion: {version}\n".encode(), 1)
        out[n.replace(info + "/", new_info + "/", 1) if n.startswith(info + "/") else n] = b
    tags = wheel.name[: -len(".whl")].split("-")[-3:]
    Path(directory).mkdir(parents=True, exist_ok=True)
    return _write_wheel(Path(directory) / f"{project}-{version}-{'-'.join(tags)}.whl", out, new_info)


def _installed_as_wheel(name: str, version: str, directory: Path) -> Path:
    """A pure-Python distribution installed here, packed as a wheel again under `version` (its real code)."""
    dist = distribution(name)
    project = dist.metadata["Name"].replace("-", "_")
    info = f"{project}-{version}.dist-info"
    files = {str(f): Path(dist.locate_file(f)).read_bytes() for f in dist.files
             if ".dist-info/" not in str(f) and "__pycache__" not in str(f) and not str(f).startswith("..")}
    meta = dist.read_text("METADATA").replace(f"\nVersion: {dist.version}\n", f"\nVersion: {version}\n", 1)
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    Path(directory).mkdir(parents=True, exist_ok=True)
    return _write_wheel(Path(directory) / f"{project}-{version}-py3-none-any.whl", files, info)


def _pip_target(wheels: list[Path], target: Path) -> Path:
    """`pip install --no-deps --target TARGET WHEELS`: a directory to put ahead on a process's PYTHONPATH, where those
    versions are then the installed ones (for imports and importlib.metadata alike)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--target", str(target), *map(str, wheels)], check=True)
    return target


@pytest.fixture(scope="session")
def wheels():
    """reversioned(wheel, version, dir), installed_as_wheel(name, version, dir), pip_target(wheels, dir): real
    distributions under another version, for environments that differ in one pin (see each function)."""
    return SimpleNamespace(reversioned=_reversioned, installed_as_wheel=_installed_as_wheel, pip_target=_pip_target)


def _build_image(*args: str, timeout: int = 3600) -> dict:
    proc = subprocess.run([str(REPO / "scripts" / "build_image.sh"), "--json", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    assert proc.returncode == 0, f"build_image.sh {' '.join(args)} failed (exit {proc.returncode})"
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def build_image():
    """build_image(*args) -> scripts/build_image.sh --json ARGS (the way a user builds the image): its summary."""
    return _build_image

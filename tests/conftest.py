"""Fixtures shared by every kind of test: the repository and its stack, and the image tests' helpers (a minimal
wheel; the image built the way a user builds it)."""
from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from ucx_dask_gpu import stack

REPO = Path(__file__).resolve().parents[1]


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


def _build_image(*args: str, timeout: int = 3600) -> dict:
    proc = subprocess.run([str(REPO / "scripts" / "build_image.sh"), "--json", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    assert proc.returncode == 0, f"build_image.sh {' '.join(args)} failed (exit {proc.returncode})"
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def build_image():
    """build_image(*args) -> scripts/build_image.sh --json ARGS (the way a user builds the image): its summary."""
    return _build_image

"""Helpers shared by the image tests (unit and integration): a minimal wheel, built without any build backend."""
from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path


def make_wheel(directory: Path, name: str, version: str, payload: str = "") -> Path:
    """A minimal valid pure-Python wheel `name==version` whose module holds `payload`."""
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


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


ROOT = Path(__file__).resolve().parents[1]


def build_image(*args: str, timeout: int = 3600) -> dict:
    """scripts/build_image.sh --json ARGS (the way a user builds the image); its JSON summary."""
    proc = subprocess.run([str(ROOT / "scripts" / "build_image.sh"), "--json", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    assert proc.returncode == 0, f"build_image.sh {' '.join(args)} failed (exit {proc.returncode})"
    return json.loads(proc.stdout)

"""tools/gpu-host/stack_venv.sh keeps the host's packages (numpy, cupy, pytest: a bare GPU host has them, .whl/ does
not) visible in the venv, also when sourced from a shell that already has the venv first on PATH (a session script
run after the venv was made)."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source(venv: Path, wheels: Path, path: str) -> subprocess.CompletedProcess:
    # With no wheels the script stops at its pip step (status 1), after the venv and its host-packages .pth are made.
    return subprocess.run(["bash", "-c", f'source "{ROOT}/tools/gpu-host/stack_venv.sh"; echo "status $?"'],
                          env={"PATH": path, "UCX_DASK_GPU_VENV": str(venv), "UCX_DASK_GPU_WHEELS": str(wheels),
                               "HOME": str(venv.parent)},
                          capture_output=True, text=True, timeout=120)


def test_sourcing_again_with_the_venv_on_path_keeps_the_host_packages(tmp_path):
    venv, wheels = tmp_path / "venv", tmp_path / "no-wheels"
    wheels.mkdir()
    host_bin = str(Path(sys.executable).parent)
    first = _source(venv, wheels, f"{host_bin}:/usr/bin:/bin")
    assert "status 1" in first.stdout, first.stdout + first.stderr
    pth = next(venv.glob("lib/python3*/site-packages/zz-host-packages.pth"))
    host_site = sysconfig.get_paths()["purelib"]
    assert host_site in pth.read_text().split()

    again = _source(venv, wheels, f"{venv}/bin:{host_bin}:/usr/bin:/bin")
    assert "status 1" in again.stdout, again.stdout + again.stderr
    listed = pth.read_text().split()
    assert host_site in listed and not any(p.startswith(str(venv)) for p in listed), listed

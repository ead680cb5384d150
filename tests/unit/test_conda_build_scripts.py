"""recipes/ucx/build.sh as conda-forge runs it, natively and cross-compiling (linux-aarch64 on linux-64): the configure
line it gives (stand-ins for autogen, configure-release and make record what they were asked), and a cross build
without the compiler activation's triplets is one line, not a build for the wrong machine."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    src = tmp / "src"
    (src / "contrib").mkdir(parents=True)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    log = tmp / "calls"
    for path in (src / "autogen.sh", src / "contrib" / "configure-release", bin_dir / "make"):
        path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$(basename "$0") $*" >> "{log}"\n')
        path.chmod(0o755)
    base = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PREFIX": str(tmp / "prefix"),
            "BUILD_PREFIX": str(tmp / "build-prefix"), "CPU_COUNT": "2"}
    proc = subprocess.run(["bash", str(REPO / "recipes/ucx/build.sh")], cwd=src, env={**base, **env},
                          capture_output=True, text=True)
    return proc, log.read_text().splitlines() if log.is_file() else []


def _configure(calls: list[str]) -> list[str]:
    (line,) = [c for c in calls if c.startswith("configure-release ")]
    return line.split()[1:]


def test_native_build_configures_for_this_machine(tmp_path):
    proc, calls = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    args = _configure(calls)
    assert f"--prefix={tmp_path / 'prefix'}" in args and f"--with-cuda={tmp_path / 'prefix'}" in args
    assert not [a for a in args if a.startswith(("--host", "--build"))]
    assert calls[0] == "autogen.sh " and calls[-2:] == ["make -j2", "make install"]


def test_cross_build_configures_for_the_target_and_runs_nothing_of_it(tmp_path):
    proc, calls = _run(tmp_path, CONDA_BUILD_CROSS_COMPILATION="1", HOST="aarch64-conda-linux-gnu",
                       BUILD="x86_64-conda-linux-gnu")
    assert proc.returncode == 0, proc.stderr
    args = _configure(calls)
    assert "--host=aarch64-conda-linux-gnu" in args and "--build=x86_64-conda-linux-gnu" in args
    # Everything it runs is a build-machine tool: nothing from $PREFIX (the target's files).
    assert [c.split()[0] for c in calls] == ["autogen.sh", "configure-release", "make", "make"]
    assert str(tmp_path / "prefix") + "/bin" not in proc.stderr


def test_cross_build_without_the_triplet_is_one_line(tmp_path):
    proc, calls = _run(tmp_path, CONDA_BUILD_CROSS_COMPILATION="1", BUILD="x86_64-conda-linux-gnu")
    assert proc.returncode != 0 and not [c for c in calls if c.startswith("configure-release")]
    assert "cross-compiling needs $HOST from the compiler activation" in proc.stderr

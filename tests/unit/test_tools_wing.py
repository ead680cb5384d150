"""What exists because of where this repository is built and checked lives outside the product, in tools/ (the
stand-in conda channel, the no-Docker rootfs runner, the two-clone reproducibility check, the GPU-host scripts, the
build host's Docker engine, the docs generator): tools/ may import ucx_dask_gpu, the package never imports tools/ (a
user's installed package has no tools/, and nothing it runs depends on this repository's workshop)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_the_product_never_imports_tools():
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "src").rglob("*.py"))
                 if any(m == "tools" or m.startswith("tools.") for m in _imports(p))]
    assert offenders == []
    moved = ["conda/standin.py", "image/rootfs.py", "image/chroot.py", "image/reprocheck.py", "docmap.py"]
    assert [m for m in moved if (REPO / "src/ucx_dask_gpu" / m).exists()] == []
    assert not (REPO / "benchmarks/gpu-host").exists()


def test_the_product_cli_has_no_workshop_commands():
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "image", "--help"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "build" in proc.stdout
    assert not {"export-rootfs", "rootfs-receive", "rootfs-run", "engine"} & set(proc.stdout.split())
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "repro", "--help"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "normalise" in proc.stdout and "check" not in proc.stdout.split()


@pytest.mark.parametrize("tool, words", [("tools.rootfs_runner", ["export", "receive", "run"]),
                                         ("tools.repro_check", ["--against-checkout", "--clone-dir"]),
                                         ("tools.docmap", ["--check", "--write"]),
                                         ("tools.docker_engine", ["--no-start", "--status", "--stop"])])
def test_each_tool_runs_from_the_repository_root(tool, words):
    proc = subprocess.run([sys.executable, "-m", tool, "--help"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and all(w in proc.stdout for w in words), proc.stderr
    assert tool.split(".")[1].replace("_", "") in (REPO / "tools/README.md").read_text().replace("_", "")


def test_tools_has_its_readme_and_runs_from_the_repository_root():
    assert "conda_standin" in (REPO / "tools/README.md").read_text()
    proc = subprocess.run([sys.executable, "-m", "tools.conda_standin", "channel", "--help"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--out" in proc.stdout and "build/channel" in proc.stdout


@pytest.mark.parametrize("kind", ["file", "a directory of the user's", "build/channel"])
def test_an_output_it_may_not_write_is_one_line_exit_9_and_stays_untouched(tmp_path, kind):
    if kind == "file":
        out = tmp_path / "f"
        out.write_text("mine")
    elif kind == "build/channel":
        out = REPO / "build" / "channel"
    else:
        out = tmp_path / "d"
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    proc = subprocess.run([sys.executable, "-m", "tools.conda_standin", "channel", "--out", str(out), "--work",
                           str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 9 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == before

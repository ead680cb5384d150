"""The stand-in machinery lives outside the product: tools/ may import ucx_dask_gpu, the package never imports tools/
(a user's installed package cannot build stand-in packages, and nothing it runs depends on this repository's tools)."""
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
    assert not (REPO / "src/ucx_dask_gpu/conda/standin.py").exists()


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

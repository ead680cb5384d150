"""The stand-in machinery lives outside the product: tools/ may import ucx_dask_gpu, the package never imports tools/
(a user's installed package cannot build stand-in packages, and nothing it runs depends on this repository's tools)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
    assert proc.returncode == 0 and "never published" in proc.stdout.replace("\n", " ") or "--out" in proc.stdout


def test_bad_input_is_one_line_with_the_products_exit_code(tmp_path):
    (tmp_path / "f").write_text("")
    proc = subprocess.run([sys.executable, "-m", "tools.conda_standin", "channel", "--out", str(tmp_path / "f")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 9 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr

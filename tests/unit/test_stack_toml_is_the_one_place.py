"""stack.toml is the only file where a version, URL, hash or install path is written: the Dockerfile, the package's
code (src/), ci/, scripts/ and the Makefile read them through the package. Comments and docstrings may mention them;
code may not."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"

URL = re.compile(r"\bhttps?://")
HEX_HASH = re.compile(r"(?<![0-9a-f])(?:[0-9a-f]{40}|[0-9a-f]{64})(?![0-9a-f])")
VERSION = re.compile(r"\d+(?:\.\d+)+")

# Written in our code for a reason of its own, not as a copy of stack.toml's value.
NOT_OURS = {
    ("src/ucx_dask_gpu/conda/recipes.py", "2.28"): "the glibc of conda-forge's alma8/ubi8 build images",
    ("src/ucx_dask_gpu/conda/recipes.py", "2.17"): "the glibc of conda-forge's cos7 build image",
}


def _leaves(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _leaves(v, key)
    else:
        yield key, node


def owned_values() -> set[str]:
    """What stack.toml owns: every version number in it (also inside requirement specifiers), its URLs, hashes,
    commits, tags, archive names, paths, the Debian suite, and its large numbers (uid, epoch)."""
    out = set()
    for key, value in _leaves(tomllib.loads((ROOT / "stack.toml").read_text())):
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if value >= 1000:
                out.add(str(value))
            continue
        text = str(value)
        out.update(v for v in VERSION.findall(text) if v.count(".") >= 1)
        if key in ("suite", "tag", "archive") or "/" in text or URL.search(text) or HEX_HASH.fullmatch(text):
            out.add(text)
    return out


OWNED = owned_values()


def _pattern(value: str) -> re.Pattern:
    # A version matches as a whole number: 1.20.1 is not in 11.20.15, 13.0 is in "13.0.*" but not in "13.0.96".
    return re.compile(rf"(?<![\w.]){re.escape(value)}(?![\w]|\.\d)")


PATTERNS = {v: _pattern(v) for v in OWNED}


def offences(where: str, text: str) -> list[str]:
    found = [v for v, p in PATTERNS.items() if p.search(text) and (where, v) not in NOT_OURS]
    found += [f"URL {m.group(0)}" for m in URL.finditer(text)]
    found += [f"hash {m.group(0)}" for m in HEX_HASH.finditer(text)]
    return found


def python_code_strings(path: Path):
    """(line, text) of every string and number in the code, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings and not isinstance(node.value, bool) \
                and isinstance(node.value, (str, int, float)):
            yield node.lineno, str(node.value)


def non_comment_lines(path: Path):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.lstrip().startswith("#"):
            yield i, line


def test_stack_toml_owns_what_the_test_looks_for():
    assert {"bookworm", "/opt/ucx", "/opt/venv", "10001", "http://deb.debian.org/debian"} <= OWNED
    assert any(HEX_HASH.fullmatch(v) for v in OWNED) and any(v.startswith("https://") for v in OWNED)
    assert "13.0" in OWNED and "1.19" in OWNED  # from "nvidia-cuda-nvcc==13.0.*" and [ucxx].min_ucx
    assert offences("x", 'PREFIX = "/opt/ucx"') and offences("x", "pip install cupy==14.2.0")
    assert not offences("x", "cuda 13.0.5, glibc 2.280 and 127.0.0.1") and not offences("x", "python3 -m ucx_dask_gpu")


def test_dockerfile_writes_no_versions_or_paths():
    text = "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"\b\d+\.\d+\.\d+\b", text), "a version number in the Dockerfile"
    assert "/opt/" not in text and "bookworm" not in text and "10001" not in text
    assert offences("docker/Dockerfile", text) == []


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "src").rglob("*.py")))
def test_package_code_reads_stack_toml(path):
    found = [f"{path}:{line}: {o}" for line, text in python_code_strings(ROOT / path) for o in offences(path, text)]
    assert found == []


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in
                                        [*(ROOT / "ci").iterdir(), *(ROOT / "scripts").iterdir(), ROOT / "Makefile"]
                                        if p.is_file()))
def test_scripts_and_makefile_read_stack_toml(path):
    found = [f"{path}:{line}: {o}" for line, text in non_comment_lines(ROOT / path) for o in offences(path, text)]
    assert found == []

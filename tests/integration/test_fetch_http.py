"""`ucx-src-build/build.sh fetch|build` against a real HTTP server on 127.0.0.1: order of locations, 404 and refused
connections, hash mismatch, $UCX_SOURCE_DIR, malformed stack.toml. Each failure: one line on stderr, its own exit
code, nothing half-written.
"""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import re
import socket
import subprocess
import tarfile
import threading
from functools import partial
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import BAD_STACK, HASH_MISMATCH, SOURCE_UNREACHABLE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUILD_SH = REPO / "ucx-src-build" / "build.sh"
VERSIONS = ("9.1.0", "9.0.0")  # pinned first, fallback second


def _tarball(version: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = f"AC_INIT([ucx], [{version}])\n".encode()
        info = tarfile.TarInfo(f"ucx-{version}/configure.ac")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def closed_port_url():
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


ARCHIVES = {v: _tarball(v) for v in VERSIONS}
SHA = {v: hashlib.sha256(d).hexdigest() for v, d in ARCHIVES.items()}


def archive(v: str) -> str:
    return f"ucx-{v}.tar.gz"


def write_stack(tmp_path: Path, urls: dict[str, list[str]]) -> Path:
    """The repository's stack.toml with [[ucx.sources]] replaced (everything else, incl. validation, stays real)."""
    text = (REPO / "stack.toml").read_text()
    start, end = text.index("[[ucx.sources]]"), text.index("[ucx.configure]")
    blocks = "".join(
        f'[[ucx.sources]]\nversion = "{v}"\narchive = "{archive(v)}"\nsha256 = "{SHA[v]}"\nlayout = "release"\n'
        f"urls = {json.dumps(urls[v])}\n\n" for v in VERSIONS)
    path = tmp_path / "stack.toml"
    path.write_text(text[:start] + blocks + text[end:])
    return path


def run(stack_file: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("UCX_SOURCE_DIR", "UCX_DASK_GPU_CACHE")}
    e.update(env or {})
    return subprocess.run([str(BUILD_SH), "--stack-file", str(stack_file), *args], capture_output=True, text=True,
                          env=e, timeout=120)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{stderr}"
    return lines[0]


def files_in(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_order_404_then_mirror(tmp_path, server):
    root, base = server
    (root / "mirror").mkdir()
    (root / "mirror" / archive("9.1.0")).write_bytes(ARCHIVES["9.1.0"])
    st = write_stack(tmp_path, {"9.1.0": [f"{base}/gone/{archive('9.1.0')}", f"{base}/mirror/{archive('9.1.0')}"],
                                "9.0.0": [f"{base}/mirror/{archive('9.0.0')}"]})
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.index("/gone/") < out.index("HTTP 404") < out.index(f"using UCX 9.1.0 from {base}/mirror/")
    assert "FALLBACK" not in r.stderr
    assert (dest / archive("9.1.0")).read_bytes() == ARCHIVES["9.1.0"]
    m = json.loads((dest / "manifest.json").read_text())
    assert m["ucx"]["version"] == "9.1.0" and m["ucx"]["fallback"] is False
    assert m["files"][archive("9.1.0")]["url"] == f"{base}/mirror/{archive('9.1.0')}"


def test_unreachable_pin_falls_back_loudly(tmp_path, server, closed_port_url):
    root, base = server
    (root / archive("9.0.0")).write_bytes(ARCHIVES["9.0.0"])
    st = write_stack(tmp_path, {"9.1.0": [f"{closed_port_url}/{archive('9.1.0')}",
                                          f"http://ucx-mirror.invalid/{archive('9.1.0')}"],
                                "9.0.0": [f"{base}/{archive('9.0.0')}"]})
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == 0, r.stderr
    warning = one_line(r.stderr)
    assert "FALLBACK" in warning and "9.0.0" in warning and closed_port_url in warning
    m = json.loads((dest / "manifest.json").read_text())
    assert m["ucx"]["version"] == "9.0.0" and m["ucx"]["fallback"] is True
    assert "ucx-mirror.invalid" in m["ucx"]["fallback_reason"]


def test_hash_mismatch_is_fatal_one_line_nothing_kept(tmp_path, server):
    root, base = server
    (root / archive("9.1.0")).write_bytes(ARCHIVES["9.1.0"] + b"x")  # tampered pin
    (root / archive("9.0.0")).write_bytes(ARCHIVES["9.0.0"])  # a good fallback that must NOT be used
    st = write_stack(tmp_path, {"9.1.0": [f"{base}/{archive('9.1.0')}"], "9.0.0": [f"{base}/{archive('9.0.0')}"]})
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == HASH_MISMATCH
    line = one_line(r.stderr)
    assert "sha256 mismatch" in line and SHA["9.1.0"] in line and f"{base}/{archive('9.1.0')}" in line
    assert files_in(dest) == [], "no partial or unverified file left behind"
    assert "9.0.0" not in r.stdout


def test_nothing_reachable(tmp_path, server, closed_port_url):
    _, base = server
    st = write_stack(tmp_path, {"9.1.0": [f"{closed_port_url}/{archive('9.1.0')}"],
                                "9.0.0": [f"{base}/missing/{archive('9.0.0')}"]})
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == SOURCE_UNREACHABLE
    line = one_line(r.stderr)
    assert "no UCX source archive reachable" in line and "HTTP 404" in line
    assert not dest.exists()


def test_source_dir_after_urls(tmp_path, server):
    _, base = server
    local = tmp_path / "local"
    local.mkdir()
    (local / archive("9.1.0")).write_bytes(ARCHIVES["9.1.0"])
    st = write_stack(tmp_path, {"9.1.0": [f"{base}/missing/{archive('9.1.0')}"],
                                "9.0.0": [f"{base}/missing/{archive('9.0.0')}"]})
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda", env={"UCX_SOURCE_DIR": str(local)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.index("HTTP 404") < r.stdout.index(f"found {local / archive('9.1.0')}")
    assert f"using UCX 9.1.0 from {local / archive('9.1.0')}" in r.stdout
    # and a tampered copy there is just as fatal as a tampered mirror
    (local / archive("9.1.0")).write_bytes(b"not the archive")
    r = run(st, "fetch", "--dest", str(tmp_path / "ctx2"), "--no-cuda", env={"UCX_SOURCE_DIR": str(local)})
    assert r.returncode == HASH_MISMATCH and str(local) in one_line(r.stderr)


def test_malformed_stack_toml(tmp_path):
    st = tmp_path / "stack.toml"
    st.write_text(re.sub(r'sha256 = "[0-9a-f]{64}"', 'sha256 = "deadbeef"', (REPO / "stack.toml").read_text(), 1))
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest))
    assert r.returncode == BAD_STACK
    assert "ucx.sources[0].sha256" in one_line(r.stderr)
    assert not dest.exists()


def test_build_stops_before_touching_the_prefix(tmp_path, server):
    """A build whose source fails verification ends with one line and no prefix (and no leftover work dir)."""
    root, base = server
    (root / archive("9.1.0")).write_bytes(b"tampered")
    st = write_stack(tmp_path, {"9.1.0": [f"{base}/{archive('9.1.0')}"], "9.0.0": [f"{base}/{archive('9.0.0')}"]})
    prefix = tmp_path / "prefix"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    r = run(st, "build", "--prefix", str(prefix), "--cache", str(tmp_path / "cache"), env={"TMPDIR": str(tmpdir)})
    assert r.returncode == HASH_MISMATCH
    one_line(r.stderr)
    assert not prefix.exists() and files_in(tmpdir) == [] and files_in(tmp_path / "cache") == []

"""`ucx-src-build/build.sh fetch|build` against a real HTTP server on 127.0.0.1: order of locations (URLs, source
mirrors, cache), 404 and refused connections, an archive with other content, the same content compressed
differently, $UCX_DASK_GPU_SOURCE_MIRROR, malformed stack.toml. Each failure: one line on stderr, its own exit code,
nothing half-written.
"""
from __future__ import annotations

import gzip
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
from ucx_dask_gpu.ucxbuild.gittree import content_tree

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUILD_SH = REPO / "ucx-src-build" / "build.sh"
VERSION = "9.1.0"


def _tarball(text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo(f"ucx-{VERSION}/configure.ac")
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


ARCHIVE = f"ucx-{VERSION}.tar.gz"
GOOD = _tarball(f"AC_INIT([ucx], [{VERSION}])\n")
SHA = hashlib.sha256(GOOD).hexdigest()
OTHER = _tarball("AC_INIT([ucx], [9.1.0-evil])\n")


def write_stack(tmp_path: Path, urls: list[str], mirror_dirs: list[str] = ()) -> Path:
    """The repository's stack.toml with [ucx.source] pointing at our archive (everything else, incl. validation,
    stays real)."""
    text = (REPO / "stack.toml").read_text()
    start, end = text.index("[ucx.source]"), text.index("[ucx.configure]")
    tree_file = tmp_path / "tree.tar.gz"
    tree_file.write_bytes(GOOD)
    block = (f'[ucx.source]\nversion = "{VERSION}"\ntag = "v{VERSION}"\ncommit = "{"1" * 40}"\n'
             f'archive = "{ARCHIVE}"\nurls = {json.dumps(urls)}\ngit = "https://github.com/openucx/ucx.git"\n'
             f'content_tree = "{content_tree(tree_file)}"\n'
             f'sha256 = "{SHA}"\n\n')
    text = text[:start] + block + text[end:]
    text = re.sub(r"^mirror_dirs = .*$", f"mirror_dirs = {json.dumps(list(mirror_dirs))}", text, count=1, flags=re.M)
    path = tmp_path / "stack.toml"
    path.write_text(text)
    return path


def run(stack_file: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("UCX_DASK_GPU_SOURCE_MIRROR", "UCX_DASK_GPU_CACHE")}
    e.update(env or {})
    return subprocess.run([str(BUILD_SH), "--stack-file", str(stack_file), *args], capture_output=True, text=True,
                          env=e, timeout=120)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{stderr}"
    return lines[0]


def files_in(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_order_404_then_the_next_url(tmp_path, server):
    root, base = server
    (root / "mirror").mkdir()
    (root / "mirror" / ARCHIVE).write_bytes(GOOD)
    st = write_stack(tmp_path, [f"{base}/gone/{ARCHIVE}", f"{base}/mirror/{ARCHIVE}"])
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.index("/gone/") < out.index("HTTP 404") < out.index(f"using UCX {VERSION} from {base}/mirror/")
    assert r.stderr == ""
    assert (dest / ARCHIVE).read_bytes() == GOOD
    m = json.loads((dest / "manifest.json").read_text())
    assert m["files"][ARCHIVE] == {"sha256": SHA, "url": f"{base}/mirror/{ARCHIVE}"}


def test_upstream_serves_other_bytes_of_the_same_content(tmp_path, server):
    """GitHub's tag archive need not be byte-identical to the mirror's: accepted by its content tree."""
    root, base = server
    regzipped = gzip.compress(gzip.decompress(GOOD), compresslevel=1, mtime=12345)
    assert regzipped != GOOD
    (root / ARCHIVE).write_bytes(regzipped)
    dest = tmp_path / "ctx"
    r = run(write_stack(tmp_path, [f"{base}/{ARCHIVE}"]), "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == 0, r.stderr
    assert "content tree verified" in r.stdout and (dest / ARCHIVE).read_bytes() == regzipped


def test_unreachable_upstream_then_the_mirror(tmp_path, closed_port_url):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / ARCHIVE).write_bytes(GOOD)
    st = write_stack(tmp_path, [f"{closed_port_url}/{ARCHIVE}", f"http://ucx-mirror.invalid/{ARCHIVE}"],
                     mirror_dirs=[str(mirror)])
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == 0, r.stderr
    assert r.stdout.index("ucx-mirror.invalid") < r.stdout.index(f"found {mirror / ARCHIVE}")
    assert (dest / ARCHIVE).read_bytes() == GOOD


def test_other_content_is_fatal_one_line_nothing_kept(tmp_path, server):
    root, base = server
    (root / "a").mkdir()
    (root / "a" / ARCHIVE).write_bytes(OTHER)  # what a tampered upstream would serve
    (root / "b").mkdir()
    (root / "b" / ARCHIVE).write_bytes(GOOD)  # a good copy that must NOT be used
    st = write_stack(tmp_path, [f"{base}/a/{ARCHIVE}", f"{base}/b/{ARCHIVE}"])
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == HASH_MISMATCH
    line = one_line(r.stderr)
    assert "content tree" in line and f"{base}/a/{ARCHIVE}" in line
    assert files_in(dest) == [], "no partial or unverified file left behind"
    assert "/b/" not in r.stdout


def test_nothing_reachable_says_where_to_put_the_archive(tmp_path, server, closed_port_url):
    _, base = server
    st = write_stack(tmp_path, [f"{closed_port_url}/{ARCHIVE}", f"{base}/missing/{ARCHIVE}"],
                     mirror_dirs=[str(tmp_path / "no-mirror-here")])
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda")
    assert r.returncode == SOURCE_UNREACHABLE
    line = one_line(r.stderr)
    assert "HTTP 404" in line and "UCX_DASK_GPU_SOURCE_MIRROR" in line and ARCHIVE in line and f"v{VERSION}" in line
    assert not dest.exists()


def test_mirror_variable_after_urls(tmp_path, server):
    _, base = server
    local = tmp_path / "local"
    local.mkdir()
    (local / ARCHIVE).write_bytes(GOOD)
    st = write_stack(tmp_path, [f"{base}/missing/{ARCHIVE}"])
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest), "--no-cuda", env={"UCX_DASK_GPU_SOURCE_MIRROR": str(local)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.index("HTTP 404") < r.stdout.index(f"found {local / ARCHIVE}")
    assert f"using UCX {VERSION} from {local / ARCHIVE}" in r.stdout
    # and a tampered copy there is just as fatal as a tampered upstream
    (local / ARCHIVE).write_bytes(b"not the archive")
    r = run(st, "fetch", "--dest", str(tmp_path / "ctx2"), "--no-cuda",
            env={"UCX_DASK_GPU_SOURCE_MIRROR": str(local)})
    assert r.returncode == HASH_MISMATCH and str(local) in one_line(r.stderr)


def test_malformed_stack_toml(tmp_path):
    st = tmp_path / "stack.toml"
    st.write_text(re.sub(r'sha256 = "[0-9a-f]{64}"', 'sha256 = "deadbeef"', (REPO / "stack.toml").read_text(), 1))
    dest = tmp_path / "ctx"
    r = run(st, "fetch", "--dest", str(dest))
    assert r.returncode == BAD_STACK
    assert "ucx.source.sha256" in one_line(r.stderr)
    assert not dest.exists()


def test_build_stops_before_touching_the_prefix(tmp_path, server):
    """A build whose source fails verification ends with one line and no prefix (and no leftover work dir)."""
    root, base = server
    (root / ARCHIVE).write_bytes(b"tampered")
    st = write_stack(tmp_path, [f"{base}/{ARCHIVE}"])
    prefix = tmp_path / "prefix"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    r = run(st, "build", "--prefix", str(prefix), "--cache", str(tmp_path / "cache"), env={"TMPDIR": str(tmpdir)})
    assert r.returncode == HASH_MISMATCH
    one_line(r.stderr)
    assert not prefix.exists() and files_in(tmpdir) == [] and files_in(tmp_path / "cache") == []

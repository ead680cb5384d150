"""Tests of tools/repro_check (the workshop's two-clone check, not the product): its own parts on real files, archives
and git repositories (the full check builds for many minutes: tests/integration/test_reproducible_image.py): clones,
the deterministic prefix tar, the first differing file in a prefix and in a wheel, diffoscope's report, the report and
its one line, and bad arguments."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.repro_check import check as reprocheck
from tools.repro_check import cli
from ucx_dask_gpu.errors import OUTPUT_REFUSED, USAGE
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def tiny_repo(tmp_path, st) -> Path:
    """A git repository with a stack.toml (what make_clone reads from `st.root`), an executable and an origin."""
    repo = tmp_path / "origin-checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    shutil.copy(st.path, repo / "stack.toml")
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    git(repo, "remote", "add", "origin", "https://example.org/ucx-dask-gpu.git")
    return repo


def test_a_clone_has_the_commit_the_origin_and_the_variations_umask(tiny_repo, tmp_path, st):
    here = load(tiny_repo / "stack.toml")
    dest = tmp_path / "some" / "deeper" / "b"
    v = reprocheck.VARIATIONS[1]
    reprocheck.make_clone(here, dest, git(tiny_repo, "rev-parse", "HEAD"), v)
    assert git(dest, "rev-parse", "HEAD") == git(tiny_repo, "rev-parse", "HEAD")
    assert git(dest, "remote", "get-url", "origin") == "https://example.org/ucx-dask-gpu.git"
    assert (dest / "stack.toml").stat().st_mode & 0o777 == 0o600     # umask 077: what the image build must undo
    assert (dest / "run.sh").stat().st_mode & 0o777 == 0o700
    with pytest.raises(reprocheck.UserError) as e:
        reprocheck.make_clone(here, dest, git(tiny_repo, "rev-parse", "HEAD"), v)
    assert e.value.exit_code == OUTPUT_REFUSED and "not a new or empty directory" in str(e.value)


def test_a_detached_head_on_no_branch_is_cloned_too(tiny_repo, tmp_path):
    """What CI checks out: a commit no branch points at."""
    (tiny_repo / "new").write_text("x")
    git(tiny_repo, "add", "new")
    git(tiny_repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    head, branch = git(tiny_repo, "rev-parse", "HEAD"), git(tiny_repo, "branch", "--show-current")
    git(tiny_repo, "checkout", "-q", "--detach")
    git(tiny_repo, "branch", "-f", branch, "HEAD~1")
    dest = reprocheck.make_clone(load(tiny_repo / "stack.toml"), tmp_path / "c", head, reprocheck.VARIATIONS[0])
    assert git(dest, "rev-parse", "HEAD") == head and (dest / "new").is_file()


def test_clone_env_points_at_the_clone_only(tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_DASK_GPU_STACK", "/elsewhere/stack.toml")
    monkeypatch.setenv("UCXX_WHEELS", "build/ucxx-wheels")
    monkeypatch.setenv("LC_ALL", "C")
    env = reprocheck.clone_env(reprocheck.VARIATIONS[1], tmp_path)
    assert "UCX_DASK_GPU_STACK" not in env and "LC_ALL" not in env
    assert (env["TZ"], env["LANG"], env["PYTHONPATH"]) == ("GMT-14", "POSIX", str(tmp_path / "src"))
    assert env["UCXX_WHEELS"] == str(tmp_path / "build" / "ucxx-wheels")


def fake_build(root: Path, label: str, files: dict[str, bytes], wheel_members: dict[str, bytes], epoch: int,
               work: Path) -> reprocheck.Build:
    """A prefix and a wheels directory as `make ucx ucxx` leaves them (real files, a real wheel)."""
    b = reprocheck.Build.in_clone(label, root, reprocheck.VARIATIONS[0])
    for rel, data in {"share/ucx-dask-gpu/build-info.json": b"{}", **files}.items():
        (b.prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (b.prefix / rel).write_bytes(data)
        os.utime(b.prefix / rel, (epoch, epoch))
    b.wheels_dir.mkdir(parents=True)
    whl = b.wheels_dir / "libucxx_cu13-0.51.1-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in wheel_members.items():
            z.writestr(zipfile.ZipInfo(name, (2025, 11, 30, 0, 0, 0)), data)
    (b.wheels_dir / "ucxx-build-info.json").write_text(json.dumps({"packages": [{"wheel": whl.name}]}))
    return b


def test_identical_builds_agree(st, tmp_path):
    e = st.source_date_epoch
    builds = [fake_build(tmp_path / n, n, {"lib/libucs.so": b"\x7fELF same"}, {"libucxx/x.so": b"same"}, e,
                         tmp_path) for n in ("a", "b")]
    for b in builds:
        reprocheck.record_outputs(st, b, tmp_path / "work")
    r = reprocheck.compare_builds(*builds, tmp_path / "work", limit=10)
    assert r["identical"] and r["prefix"]["identical"] and r["wheels"]["identical"]
    assert builds[0].prefix_tar_sha256 == builds[1].prefix_tar_sha256
    assert "REPRODUCIBLE" in reprocheck.render(r).splitlines()[-1]


def test_the_first_differing_file_is_named_with_diffoscopes_report(st, tmp_path):
    e = st.source_date_epoch
    a = fake_build(tmp_path / "a", "a", {"lib/libucs.so": b"configured in /tmp/a/src\n", "lib/ucx/uct.so": b"x"},
                   {"libucxx/lib64/libucxx.so": b"/tmp/a", "libucxx/VERSION": b"1"}, e, tmp_path)
    b = fake_build(tmp_path / "b", "b", {"lib/libucs.so": b"configured in /tmp/deeper/b/src\n", "lib/ucx/uct.so": b"y"},
                   {"libucxx/lib64/libucxx.so": b"/tmp/deeper/b", "libucxx/VERSION": b"1"}, e, tmp_path)
    work = tmp_path / "work"
    for x in (a, b):
        reprocheck.record_outputs(st, x, work)
    r = reprocheck.compare_builds(a, b, work, limit=10)
    assert not r["identical"]
    assert r["prefix"]["first_difference"]["path"] == "lib/libucs.so"     # before lib/ucx/ in tar order
    first = r["wheels"]["first_difference"]
    assert first["member"] == "libucxx/lib64/libucxx.so" and "CRC" in first["fields"]
    assert reprocheck.first_difference_line(r) == "UCX prefix: lib/libucs.so differs"
    if shutil.which("diffoscope") is None:
        assert "not installed" in r["prefix"]["diffoscope"]
    else:
        text = Path(r["prefix"]["diffoscope"]).read_text()
        assert "/tmp/a/src" in text and "/tmp/deeper/b/src" in text
        assert "libucxx/lib64/libucxx.so" in Path(first["diffoscope"]).read_text()
    assert "NOT REPRODUCIBLE: UCX prefix: lib/libucs.so differs" in reprocheck.render(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file another owner (root)")
def test_prefix_tar_keeps_modes_drops_owners_and_build_times(st, tmp_path):
    e = st.source_date_epoch
    trees = []
    for n, mtime in (("a", e), ("b", e + 86400)):
        t = tmp_path / n
        (t / "bin").mkdir(parents=True)
        (t / "bin" / "ucx_info").write_bytes(b"x")
        (t / "bin" / "ucx_info").chmod(0o755)
        os.utime(t / "bin" / "ucx_info", (mtime, mtime))
        trees.append(t)
    os.chown(trees[1] / "bin" / "ucx_info", 4321, 4321)
    ra, rb = (reprocheck.tar_tree(t, tmp_path / f"{t.name}.tar", e) for t in trees)
    assert ra.sha256 == rb.sha256, "a later build time and another owner give the same tar"
    (trees[1] / "bin" / "ucx_info").chmod(0o700)
    rc = reprocheck.tar_tree(trees[1], tmp_path / "c.tar", e)
    assert rc.sha256 != ra.sha256
    assert reprocheck.first_tree_difference([x.as_list() for x in ra.entries],
                                            [x.as_list() for x in rc.entries])["path"] == "bin/ucx_info"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.repro_check", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    proc = run_cli("--first", "some:image", "--no-image")
    assert proc.returncode == USAGE and len(proc.stderr.strip().splitlines()) == 1
    assert "--against-checkout" in proc.stderr
    proc = run_cli("--against-checkout", "--revision", "HEAD~1", "--no-image")
    assert proc.returncode == USAGE and "--revision" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("--clone-dir", str(tmp_path / "a"), "--clone-dir", str(tmp_path / "b"), "--clone-dir",
                   str(tmp_path / "c"))
    assert proc.returncode == USAGE and len(proc.stderr.strip().splitlines()) == 1
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep-me").write_text("mine")
    proc = run_cli("--no-image", "--clone-dir", str(full))
    assert proc.returncode == OUTPUT_REFUSED and "not empty" in proc.stderr.strip().splitlines()[-1]
    assert (full / "keep-me").read_text() == "mine" and [p.name for p in full.iterdir()] == ["keep-me"]


def test_its_outputs_are_the_clone_directories_and_the_report():
    outputs = {a.option_strings[-1]: a.type.output_kind for a in cli.build_parser()._actions
               if getattr(a.type, "output_kind", None)}
    assert outputs == {"--clone-dir": "dir", "--json": "file"}


def test_a_file_given_as_a_clone_directory_is_refused_before_anything_runs(tmp_path):
    wrong = tmp_path / "results.json"
    wrong.write_text("mine")
    proc = run_cli("--no-image", "--clone-dir", str(wrong))
    assert proc.returncode == OUTPUT_REFUSED and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(wrong) in proc.stderr and "Traceback" not in proc.stderr
    assert wrong.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["results.json"]

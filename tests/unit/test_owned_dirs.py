"""Directories the tool writes carry a record of what it wrote (fsutil's manifest): every command that writes a
directory, run twice with the user's files planted there before and between the runs, leaves those files as they
were, and a filesystem failure ends in one line with its exit code. Real processes where the command runs here
without Docker or a GPU; the writing step itself where the rest of the command needs them."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ucx_dask_gpu import report
from ucx_dask_gpu.errors import OUTPUT_REFUSED, RESULT_KEPT, SCHEDULER_UNREACHABLE, TLS_INIT_FAILED, USAGE, UserError

REPO = Path(__file__).resolve().parents[2]
HAS_OPENSSL = shutil.which("openssl") is not None


def udg(*args, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, **kwargs)


def one_line(proc: subprocess.CompletedProcess) -> bool:
    return len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def in_process(call) -> int:
    try:
        call()
        return 0
    except UserError as e:
        return e.exit_code


def _from_map(d: Path, scratch: Path) -> int:
    # the files are written before any cluster is reached: an address where none answers ends it right after
    rc = udg("workload", "from-map", d, "--files", 2, "--rows", 10, "--scheduler", "tcp://127.0.0.1:9",
             "--timeout", 2).returncode
    return 0 if rc == SCHEDULER_UNREACHABLE else rc


# Each command that writes a directory: how it writes D (its exit code), and names it writes there (the user's files
# are planted under those names too: a name taken, a file inside a folder of its own).
COMMANDS = {
    "conda pack --out": (lambda d, s: udg("conda", "pack", "--out", d).returncode,
                         ["ucx", "ucxx", "conda_build_config.yaml", "ucx/recipe.yaml"]),
    "config install --dest": (lambda d, s: udg("config", "install", "--dest", d).returncode,
                              ["ucx-dask-gpu.yaml", "ucx-dask-gpu-tuned.yaml"]),
    "workload from-map PATH": (_from_map, ["part-00000.parquet", "part-00001.parquet"]),
    "bench/verify-nvlink --out": (lambda d, s: in_process(lambda: report.write_report(
        d, "verify-nvlink", {"pairs": []}, "# report", b"\x89PNG", "ucx-dask-gpu verify-nvlink")),
                                  ["verify-nvlink.json", "command.txt"]),
}
if HAS_OPENSSL:
    COMMANDS["tls init DIR"] = (lambda d, s: udg("tls", "init", d).returncode, ["ca.pem", "client.key"])


# done, refused before anything ran (exit 9; tls init: a ca.pem without its key is a usage error), or the result kept
ANSWERS = (0, USAGE, OUTPUT_REFUSED, RESULT_KEPT)


def plantable(names: list[str]):
    top = st.sampled_from([*names, "notes.txt", "sub"])
    return st.lists(st.tuples(top, st.sampled_from(["", "notes.txt", "recipe.yaml"]), st.binary(max_size=16)),
                    max_size=3)


def plant(d: Path, wanted) -> dict[str, bytes]:
    """The user's files, where a file can be put (not over an existing file or folder); returns what was put."""
    put = {}
    for top, sub, data in wanted:
        path = d / top / sub if sub else d / top
        with contextlib.suppress(OSError):
            if path.exists() or path.is_symlink():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            put[str(path.relative_to(d))] = data
    return put


def intact(d: Path, files: dict[str, bytes]) -> bool:
    return all((d / rel).is_file() and (d / rel).read_bytes() == data for rel, data in files.items())


def users_files_survive_two_runs(run, names: list[str]) -> None:
    """The property every directory-writing command keeps: the user's files planted before the first run and between
    the runs are all still there, whatever each run answers; with none planted, the second run replaces the first's
    output."""

    # few examples, the same on every run (real processes, a few seconds each); no example database in the checkout
    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(before=plantable(names), between=plantable(names))
    def property_(before, between):
        with tempfile.TemporaryDirectory() as tmp:
            scratch, d = Path(tmp) / "scratch", Path(tmp) / "d"
            scratch.mkdir()
            mine = plant(d, before) if before else {}
            first = run(d, scratch)
            assert first in ANSWERS, first
            assert intact(d, mine)
            mine.update(plant(d, between) if d.is_dir() else {})
            second = run(d, scratch)
            assert second in ANSWERS, second
            assert intact(d, mine)
            if not mine:
                assert first == second == 0, "a second run over its own output alone must replace it"

    property_()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_users_files_survive_every_run(command):
    users_files_survive_two_runs(*COMMANDS[command])


# --- each case of issue 30, as a user meets it ----------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A file system with no space left (a 64 KiB tmpfs, filled): needs root and mount."""
    where = tmp_path / "full"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with contextlib.suppress(OSError), open(where / "fill", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)  # still gone, and the test says why
            pytest.fail(f"{where} still in use after the test: a file left open or a process left running")


def test_conda_pack_twice_keeps_a_file_the_user_added_inside_it(tmp_path):
    d = tmp_path / "D"
    assert udg("conda", "pack", "--out", d).returncode == 0
    (d / "ucx" / "notes.txt").write_text("mine")
    proc = udg("conda", "pack", "--out", d)
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "ucx/notes.txt" in proc.stderr
    assert (d / "ucx" / "notes.txt").read_text() == "mine"
    (d / "ucx" / "notes.txt").unlink()
    assert udg("conda", "pack", "--out", d).returncode == 0  # its own output alone: replaced


def test_from_map_refuses_a_users_part_file_unless_told_to_overwrite(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "part-00000.parquet").write_text("mine")
    proc = udg("workload", "from-map", d, "--files", 1, "--rows", 10, "--scheduler", "tcp://127.0.0.1:9")
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "part-00000.parquet" in proc.stderr
    assert "--overwrite" in proc.stderr and (d / "part-00000.parquet").read_text() == "mine"
    proc = udg("workload", "from-map", d, "--files", 1, "--rows", 10, "--scheduler", "tcp://127.0.0.1:9",
               "--timeout", 2, "--overwrite")
    assert proc.returncode == SCHEDULER_UNREACHABLE, proc.stderr
    assert (d / "part-00000.parquet").read_bytes()[:4] == b"PAR1"


def test_from_map_into_a_directory_nothing_can_be_written_in_is_exit_9(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    proc = udg("workload", "from-map", blocker / "data", "--files", 1, "--rows", 10)
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc)
    assert blocker.read_text() == "mine"


def test_from_map_into_a_read_only_directory_is_exit_9(tmp_path):
    """A read-only mount (root writes through permission bits, not through this)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", "-o", "ro", str(data), str(data)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a read-only bind mount needs root and mount")
    try:
        proc = udg("workload", "from-map", data, "--files", 1, "--rows", 10)
        assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "Read-only" in proc.stderr, proc.stderr
        assert sorted(p.name for p in data.iterdir()) == ["notes.txt"]
    finally:
        subprocess.run(["umount", str(data)], capture_output=True)


def test_ucx_build_refuses_to_replace_an_earlier_build_holding_the_users_file(tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "share" / "ucx-dask-gpu").mkdir(parents=True)
    (prefix / "share" / "ucx-dask-gpu" / "build-info.json").write_text('{"files": {}}')
    (prefix / "etc").mkdir()
    (prefix / "etc" / "site.conf").write_text("mine")
    proc = udg("ucx", "build", "--prefix", prefix)
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "etc" in proc.stderr, proc.stderr
    assert (prefix / "etc" / "site.conf").read_text() == "mine"


@pytest.mark.skipif(not HAS_OPENSSL, reason="no openssl command here")
def test_tls_init_on_a_full_disk_is_one_line_and_leaves_nothing(full_disk):
    proc = udg("tls", "init", full_disk / "certs")
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "No space left" in proc.stderr, proc.stderr
    assert [p.name for p in full_disk.iterdir()] == ["fill"]


@pytest.mark.skipif(not HAS_OPENSSL, reason="no openssl command here")
def test_tls_init_with_a_relative_directory_and_a_deleted_key(tmp_path):
    proc = udg("tls", "init", "relcerts", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    certs = tmp_path / "relcerts"
    before = {n: (certs / n).read_bytes() for n in ("ca.pem", "scheduler.pem", "worker.key")}
    (certs / "client.key").unlink()
    proc = udg("tls", "init", "relcerts", cwd=tmp_path)
    assert proc.returncode == 0 and "client.key" in proc.stdout, proc.stderr
    assert (certs / "client.key").is_file() and (certs / "client.pem").is_file()
    assert all((certs / n).read_bytes() == data for n, data in before.items())  # the rest stays as it was
    check = subprocess.run(["openssl", "verify", "-CAfile", "ca.pem", "client.pem"], cwd=certs, capture_output=True)
    assert check.returncode == 0


@pytest.mark.skipif(not HAS_OPENSSL, reason="no openssl command here")
def test_tls_init_failing_leaves_no_directory_behind(tmp_path):
    fake = tmp_path / "bin"  # an openssl that fails, as the real one did on a relative DIR
    fake.mkdir()
    (fake / "openssl").write_text("#!/bin/sh\necho 'Unable to load CA certificate' >&2\nexit 1\n")
    (fake / "openssl").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    proc = udg("tls", "init", "relcerts", cwd=work, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert proc.returncode == TLS_INIT_FAILED and one_line(proc) and "Unable to load CA certificate" in proc.stderr
    assert list(work.iterdir()) == []


def test_a_result_for_a_full_device_is_kept_in_the_temporary_directory_not_in_dev(tmp_path):
    before = set(os.listdir("/dev"))
    proc = udg("image", "compose", "-o", "/dev/full", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == RESULT_KEPT and one_line(proc) and str(tmp_path) in proc.stderr, proc.stderr
    assert set(os.listdir("/dev")) == before
    [kept] = tmp_path.iterdir()
    assert "services:" in kept.read_text()


def test_config_install_on_a_full_disk_leaves_no_staging_folder(full_disk, tmp_path):
    keep = tmp_path / "tmp"
    keep.mkdir()
    proc = udg("config", "install", "--dest", full_disk / "dask", env={**os.environ, "TMPDIR": str(keep)})
    assert proc.returncode == RESULT_KEPT and one_line(proc) and "No space left" in proc.stderr, proc.stderr
    assert [p.name for p in full_disk.iterdir()] == ["fill"]
    [kept] = keep.iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["ucx-dask-gpu-transports.yaml", "ucx-dask-gpu-tuned.yaml",
                                                      "ucx-dask-gpu.yaml"]


# Every directory option of test_outputs.WRITING (the parser's own list), and how its writing is covered: by the
# property test above (a COMMANDS entry), or by the same writer as one that is, or why it has a record of its own.
SAME_WRITER = "report.write_report / fsutil.write_output_dir, as bench/verify-nvlink --out"
DIRECTORY_OPTIONS = {
    ("bench", "idle", "--out"): SAME_WRITER,
    ("bench", "svd", "--out"): SAME_WRITER,
    ("bench", "transfer", "--out"): SAME_WRITER,
    ("bench", "transpose", "--out"): SAME_WRITER,
    ("verify-nvlink", "--out"): "bench/verify-nvlink --out",
    ("verify-nvlink", "--raw-dir"): SAME_WRITER,
    ("image", "role-hook", "--dest"): SAME_WRITER,
    ("repro", "normalise", "--out"): SAME_WRITER,
    ("conda", "pack", "--out"): "conda pack --out",
    ("conda", "lint", "--packed"): "conda pack --out",
    ("conda", "render", "--packed"): "conda pack --out",
    ("config", "install", "--dest"): "config install --dest",
    ("tls", "init", "dir"): "tls init DIR",
    # work directories: only the command's own folders are replaced, never a file beside them; one holding anything
    # else is refused at its first claim (fsutil.claim_work_dir)
    ("ucx", "build", "--work-dir"): "claim_work_dir",
    ("ucx", "ucxx", "--work-dir"): "claim_work_dir",
    # build outputs replaced whole only when their own record lists everything in them
    ("ucx", "build", "--prefix"): "an earlier build's build-info.json lists its files (test below)",
    ("ucx", "ucxx", "--out"): "the wheels ucxx-build-info.json lists (ucxx.replaceable_output)",
    ("ucx", "fetch", "--dest"): "the source cache: archives by name, checked against stack.toml's pins",
}


def test_every_directory_a_command_writes_is_covered():
    from test_outputs import WRITING

    assert {k for k, kind in WRITING.items() if kind == "dir"} == set(DIRECTORY_OPTIONS)
    covered = {v for v in DIRECTORY_OPTIONS.values() if v.startswith(("conda ", "config ", "image ", "tls ", "bench"))}
    assert covered <= set(COMMANDS) | ({"tls init DIR"} if not HAS_OPENSSL else set())

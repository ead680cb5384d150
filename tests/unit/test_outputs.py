"""Every command-line option that writes, found in the real parser: an existing directory (or a file where a directory
is asked for) with the user's files in it is refused with exit 9 before anything runs, and survives untouched; the
writers never remove or replace what was not named, and keep a result they could not write (exit 18)."""
from __future__ import annotations

import argparse
import os
import re
import resource
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ucx_dask_gpu import cli, fsutil
from ucx_dask_gpu.cliutil import check_outputs
from ucx_dask_gpu.errors import OUTPUT_REFUSED, RESULT_KEPT, UserError

REPO = Path(__file__).resolve().parents[2]

# Every writing option, with what it names. Checked against the parser both ways (test_the_list_is_the_parser), so
# an option added without add_output, or one that stops writing, fails here.
WRITING = {
    ("bench", "idle", "--out"): "dir",
    ("bench", "svd", "--out"): "dir",
    ("bench", "transfer", "--out"): "dir",
    ("bench", "transpose", "--out"): "dir",
    ("cluster", "--scheduler-file"): "file",
    ("conda", "lint", "--packed"): "dir",
    ("conda", "pack", "--out"): "dir",
    ("conda", "render", "--packed"): "dir",
    ("conda", "variants", "--out"): "file",
    ("config", "install", "--dest"): "dir",
    ("image", "compose", "--output"): "file",
    ("image", "demo", "--json"): "file",
    ("image", "role-hook", "--dest"): "dir",
    ("repro", "compare", "--json"): "file",
    ("repro", "normalise", "--out"): "dir",
    ("repro", "rootfs", "dest"): "file",
    ("sbom", "generate", "--output"): "file",
    ("tls", "init", "dir"): "dir",
    ("topology", "--record-sysfs"): "file",
    ("ucx", "build", "--prefix"): "dir",
    ("ucx", "build", "--stamp"): "file",
    ("ucx", "build", "--work-dir"): "dir",
    ("ucx", "fetch", "--dest"): "dir",
    ("ucx", "ucxx", "--out"): "dir",
    ("ucx", "ucxx", "--stamp"): "file",
    ("ucx", "ucxx", "--work-dir"): "dir",
    ("verify-nvlink", "--out"): "dir",
    ("verify-nvlink", "--raw-dir"): "dir",
    ("workload", "from-map", "--output"): "file",
    ("workload", "transpose", "--output"): "file",
}

# Names that usually mean "write here", and the options by such names that do not write (with the reason).
WRITING_NAME = re.compile(r"^(--?(o|out|output|json|dest|prefix|packed|work|work-dir|raw-dir|record-.*|.*-file|stamp"
                          r"|.*-dir|parts|root)|dir|out|dest)$")
NOT_WRITTEN = {
    ("stack", "--file"): "stack.toml, read",
    ("image", "--stack-file"): "stack.toml, read",
    ("repro", "--stack-file"): "stack.toml, read",
    ("sbom", "--stack-file"): "stack.toml, read",
    ("ucx", "--stack-file"): "stack.toml, read",
    ("ucx", "verify", "--prefix"): "the UCX prefix to check, read",
    ("ucx", "build", "--cuda-link-dir"): "libcuda.so and libnvidia-ml.so to link with, read",
    ("tls", "env", "dir"): "where the certificates are, printed",
}


def _name(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), None) or \
        (action.option_strings[0] if action.option_strings else action.dest)


def walk(parser: argparse.ArgumentParser, path: tuple = ()):
    """(command path, action, the parsers from the top down) for every option and positional of every command."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                for p, act, chain in walk(sub, path + (name,)):
                    yield p, act, (parser, *chain)
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            yield path, a, (parser,)


PARSER = cli.build_parser()
ACTIONS = {(*path, _name(a)): (a, chain) for path, a, chain in walk(PARSER)}
MARKED = {key: getattr(a.type, "output_kind") for key, (a, _) in ACTIONS.items()
          if getattr(a.type, "output_kind", None)}


def test_the_list_is_the_parser():
    assert MARKED == WRITING


def test_every_option_named_like_an_output_is_one_or_says_why_not():
    by_name = {key for key, (a, _) in ACTIONS.items()
               if WRITING_NAME.match(key[-1]) and a.nargs != 0}  # --json flags that only print are not outputs
    assert by_name - set(MARKED) == set(NOT_WRITTEN)
    assert set(MARKED) - by_name == set(), "an output whose name WRITING_NAME misses: widen the pattern"


def test_every_output_says_in_its_help_how_a_directory_there_is_treated():
    for key, (a, _) in ACTIONS.items():
        if key in MARKED:
            assert "exit 9" in a.help and "refused" in a.help, key


def _argv(key: tuple, value: str) -> list[str]:
    """A command line of `key`'s command with `value` for that option; every other positional and required option
    filled with a harmless value (nothing runs: the outputs are checked first)."""
    path = key[:-1]
    argv: list[str] = []
    for depth in range(len(path) + 1):
        for k, (a, _) in ACTIONS.items():
            if k[:-1] != path[:depth]:
                continue
            if k == key:
                argv += [a.option_strings[-1], value] if a.option_strings else [value]
            elif not a.option_strings:
                argv.append("x")
            elif a.required:
                argv += [a.option_strings[0], str(a.choices[0]) if a.choices else "x"]
        argv += path[depth:depth + 1]
    return argv


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _users_files(where: Path) -> dict[str, str]:
    where.mkdir(parents=True)
    (where / "notes.txt").write_text("mine")
    (where / "sub").mkdir()
    (where / "sub" / "data.bin").write_text("also mine")
    return {"notes.txt": "mine", "sub/data.bin": "also mine"}


def _unchanged(where: Path, files: dict[str, str]) -> bool:
    found = {str(p.relative_to(where)): p.read_text() for p in where.rglob("*")
             if p.is_file() and p.name != fsutil.MANIFEST}  # the tool's record of what it wrote there
    return found == files


@pytest.mark.parametrize("key", sorted(WRITING), ids=" ".join)
def test_a_wrong_destination_is_refused_before_anything_runs_and_nothing_is_touched(key, tmp_path, capsys):
    if WRITING[key] == "file":  # a directory where a file is asked for
        wrong = tmp_path / "results"
        mine = _users_files(wrong)
        rc, err = _run(_argv(key, str(wrong)), capsys)
        assert _unchanged(wrong, mine)
    else:  # a file where a directory is asked for
        wrong = tmp_path / "results.json"
        wrong.write_text("mine")
        rc, err = _run(_argv(key, str(wrong)), capsys)
        assert wrong.read_text() == "mine"
    assert rc == OUTPUT_REFUSED, err
    assert len(err.strip().splitlines()) == 1 and str(wrong) in err and "refused before anything ran" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [wrong.name]


@pytest.mark.parametrize("key", sorted(WRITING), ids=" ".join)
def test_no_place_to_write_is_refused_before_anything_runs(key, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    rc, err = _run(_argv(key, str(blocker / "x" / "out")), capsys)  # under a file: nothing can be made there
    assert rc == OUTPUT_REFUSED and len(err.strip().splitlines()) == 1, err
    assert blocker.read_text() == "mine"
    rc, err = _run(_argv(key, "/proc/x/out"), capsys)
    assert rc == OUTPUT_REFUSED and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("key", sorted(WRITING), ids=" ".join)
def test_a_good_destination_passes_the_check(key, tmp_path):
    args = PARSER.parse_args(_argv(key, str(tmp_path / "new")))
    check_outputs(args)
    assert list(tmp_path.iterdir()) == []  # the check made nothing


# --- the writers ------------------------------------------------------------------------------------------------------

def test_atomic_path_never_replaces_a_directory_it_was_not_told_is_its_own(tmp_path):
    dest = tmp_path / "result.json"
    mine = _users_files(dest)
    with pytest.raises(IsADirectoryError):
        fsutil.atomic_write_text(dest, "{}")
    assert _unchanged(dest, mine) and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    with fsutil.atomic_path(dest, replace_dir=True) as tmp:  # a cache replacing its own entry
        tmp.mkdir()
        (tmp / "new").write_text("n")
    assert [p.name for p in dest.iterdir()] == ["new"] and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_atomic_write_many_renames_nothing_when_one_destination_is_a_directory(tmp_path):
    (tmp_path / "b.md").mkdir()
    with pytest.raises(IsADirectoryError):
        fsutil.atomic_write_many({tmp_path / "a.json": "{}", tmp_path / "b.md": "# b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.md"]


def test_a_symlinked_output_writes_its_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fsutil.check_output_file(link)
    fsutil.write_output_file(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_device_is_written_in_place_never_replaced(tmp_path):
    # A null device of the test's own (root can make one), so that the check does not depend on the machine's
    # /dev/null having stayed one; elsewhere the machine's.
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with open(device, "wb") as f:
            f.write(b"")
    except OSError:
        device = Path("/dev/null")
    before = os.stat(device)
    fsutil.check_output_file(str(device))
    fsutil.write_output_file(str(device), "x")
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_write_failing_after_the_work_keeps_the_result_beside_it(tmp_path):
    dest = tmp_path / "result.json"
    fsutil.check_output_file(dest)
    mine = _users_files(dest)  # a directory appears there while the work runs
    with pytest.raises(UserError) as err:
        fsutil.write_output_file(dest, '{"value": 1}\n')
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("result.json.kept-")]
    assert err.value.exit_code == RESULT_KEPT and len(kept) == 1 and f"kept at {kept[0]}" in str(err.value)
    assert kept[0].read_text() == '{"value": 1}\n' and _unchanged(dest, mine)


def test_where_nothing_can_be_made_beside_it_the_result_goes_to_the_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out"
    fsutil.check_output_dir(out)
    out.mkdir()
    os.rmdir(out)
    out.write_text("a file took its place")  # and the parent of a kept copy is a file too
    with pytest.raises(UserError) as err:
        fsutil.write_output_dir(out / "report", {"r.json": "{}", "r.png": b"\x89PNG"})
    kept = list((tmp_path / "tmp").iterdir())
    assert err.value.exit_code == RESULT_KEPT and len(kept) == 1 and f"kept in {kept[0]}" in str(err.value)
    assert sorted(p.name for p in kept[0].iterdir()) == ["r.json", "r.png"]
    assert out.read_text() == "a file took its place"


def test_a_report_goes_into_a_directory_beside_the_users_files(tmp_path):
    out = tmp_path / "results"
    mine = _users_files(out)
    written = fsutil.write_output_dir(out, {"r.json": "{}", "command.txt": "x\n"})
    assert sorted(p.name for p in written) == ["command.txt", "r.json"]
    assert _unchanged(out, {**mine, "r.json": "{}", "command.txt": "x\n"})


def test_a_report_name_taken_by_a_directory_keeps_the_report_and_touches_nothing(tmp_path):
    out = tmp_path / "results"
    mine = _users_files(out)
    (out / "r.json").mkdir()
    with pytest.raises(UserError) as err:
        fsutil.write_output_dir(out, {"r.json": "{}", "r.md": "# r\n"})
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("results.kept-")]
    assert err.value.exit_code == RESULT_KEPT and len(kept) == 1
    assert (kept[0] / "r.md").read_text() == "# r\n" and _unchanged(out, mine) and (out / "r.json").is_dir()


def test_a_real_command_whose_write_fails_keeps_its_output_on_stdout(tmp_path):
    """`image compose -o FILE` under a file-size limit of 0 bytes: the check passes (an empty file can be made), the
    write fails (EFBIG), no copy fits anywhere: the compose file comes out on stdout, exit 18, one line."""
    def no_file_bytes():
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

    dest = tmp_path / "compose.yml"
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "image", "compose", "-o", str(dest)], cwd=REPO,
                          capture_output=True, text=True, preexec_fn=no_file_bytes, timeout=60)
    assert proc.returncode == RESULT_KEPT, proc.stderr
    assert proc.stderr.count("\n") == 1 and "kept on stdout" in proc.stderr and "File too large" in proc.stderr
    assert "services:" in proc.stdout and not dest.exists()


def test_a_work_directory_holding_the_users_files_is_refused(tmp_path):
    work = tmp_path / "work"
    mine = _users_files(work)
    (work / "logs").mkdir()
    with pytest.raises(UserError) as err:
        fsutil.claim_work_dir(work, "--work-dir")
    assert err.value.exit_code == OUTPUT_REFUSED and "--work-dir" in str(err.value)
    assert "logs and 2 more" in str(err.value)
    assert _unchanged(work, mine) and not (work / fsutil.WORK_MARK).exists()


def test_a_users_folder_named_as_the_commands_own_is_still_the_users(tmp_path):
    """`--work-dir ~` where ~ holds only logs/: the build would empty logs/ on every run."""
    work = tmp_path / "home"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "2026.txt").write_text("mine")
    with pytest.raises(UserError) as err:
        fsutil.claim_work_dir(work, "--work-dir")
    assert err.value.exit_code == OUTPUT_REFUSED and "logs" in str(err.value)
    assert (work / "logs" / "2026.txt").read_text() == "mine" and not (work / fsutil.WORK_MARK).exists()


def test_a_work_directory_claimed_once_stays_claimed(tmp_path):
    work = fsutil.claim_work_dir(tmp_path / "new" / "work")
    assert work.is_dir() and (work / fsutil.WORK_MARK).is_file()
    (work / "logs").mkdir()
    (work / "something-new").mkdir()  # made by a later version of the command
    assert fsutil.claim_work_dir(work) == work
    assert fsutil.claim_work_dir(tmp_path / "empty") == tmp_path / "empty"


def test_config_install_into_a_directory_with_other_files(tmp_path, capsys):
    dest = tmp_path / "dask"
    mine = _users_files(dest)
    rc, err = _run(["config", "install", "--dest", str(dest)], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in dest.iterdir()) == [fsutil.MANIFEST, "notes.txt", "sub",
                                                       "ucx-dask-gpu-transports.yaml", "ucx-dask-gpu-tuned.yaml",
                                                       "ucx-dask-gpu.yaml"]
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "sub" / "data.bin").read_text() == "also mine"


@pytest.mark.skipif(not __import__("shutil").which("openssl"), reason="no openssl command here")
def test_tls_init_leaves_the_users_files_even_those_named_like_its_scratch_files(tmp_path, capsys):
    d = tmp_path / "certs"
    d.mkdir()
    for name in ("san.cnf", "ca.srl", "notes.txt"):
        (d / name).write_text(f"my {name}")
    rc, err = _run(["tls", "init", str(d)], capsys)
    assert rc == 0, err
    names = sorted(p.name for p in d.iterdir())
    assert names == [fsutil.MANIFEST, "ca.key", "ca.pem", "ca.srl", "client.key", "client.pem", "notes.txt", "san.cnf",
                     "scheduler.key", "scheduler.pem", "worker.key", "worker.pem"]
    assert all((d / n).read_text() == f"my {n}" for n in ("san.cnf", "ca.srl", "notes.txt"))
    assert oct((d / "ca.key").stat().st_mode & 0o777) == "0o600"


def test_a_channel_or_ucxx_output_is_replaced_only_when_it_is_one_this_project_wrote(tmp_path):
    from tools.conda_standin.channel import is_channel_or_empty
    from ucx_dask_gpu.ucxbuild.ucxx import UCXX_BUILD_INFO, replaceable_output

    d = tmp_path / "d"
    d.mkdir()
    assert is_channel_or_empty(d) and replaceable_output(d)
    (d / "noarch").mkdir()
    (d / "noarch" / "repodata.json").write_text("{}")
    assert is_channel_or_empty(d)
    (d / "notes.txt").write_text("mine")
    assert not is_channel_or_empty(d) and not replaceable_output(d)
    w = tmp_path / "wheels"
    w.mkdir()
    (w / UCXX_BUILD_INFO).write_text('{"packages": [{"wheel": "a.whl"}]}')
    (w / "a.whl").write_bytes(b"PK")
    assert replaceable_output(w)
    (w / "b.whl").write_bytes(b"PK")
    assert not replaceable_output(w)


def test_ucxx_out_holding_the_users_files_is_refused_before_the_build(tmp_path, capsys):
    out = tmp_path / "wheels"
    mine = _users_files(out)
    rc, err = _run(["ucx", "ucxx", "--ucx-prefix", str(tmp_path / "none"), "--out", str(out)], capsys)
    assert rc == OUTPUT_REFUSED and "not UCXX wheels this command wrote" in err and _unchanged(out, mine)

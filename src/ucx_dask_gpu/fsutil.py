"""Files: written so that readers never see half a file (temp path in the same directory, then rename), their sha256,
whether one is an ELF binary, which shared library a process has mapped; and the outputs a user names on a command line: checked before the work starts,
written after it without removing or replacing anything else, and kept somewhere when that write fails; a directory
the tool writes records what it wrote there (MANIFEST), so a later run replaces only that.
Standard library only."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping

from .errors import OUTPUT_REFUSED, RESULT_KEPT, UserError

ELF_MAGIC = b"\x7fELF"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike, default=None):
    """The JSON document at `path`; `default` where there is none or it is not JSON (a record not written yet)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def is_elf(path: str | os.PathLike) -> bool:
    """A regular file (not a symlink) that starts with the ELF magic."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


def mapped_library(name: str, pid: int | str = "self") -> str | None:
    """The file a process (this one by default) has mapped whose name starts with `name` (`libucp.so` finds
    /opt/ucx/lib/libucp.so.0.0.0): the library the loader really chose. None when none is (not loaded yet), or the
    process is gone."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/") and os.path.basename(fields[5]).startswith(name):
                    return fields[5].rstrip("\n")
    except OSError:
        pass
    return None


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, replace_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; rename it over `dest` only if the block succeeds. Works for files and
    directories (whatever the caller creates at the yielded path). A directory standing at `dest` is replaced only with
    `replace_dir=True`, which is for directories the caller made itself (a cache entry, its own earlier output, checked
    as such); otherwise the block's result is dropped, IsADirectoryError is raised and the directory stays as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    target = tmp / dest.name
    try:
        yield target
        if dest.is_dir() and not dest.is_symlink():
            if not replace_dir:
                raise IsADirectoryError(errno.EISDIR, "is a directory, not replaced", str(dest))
            os.replace(dest, tmp / ".replaced")  # out of the way, removed with tmp once the new one is in place
        os.replace(target, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
    return Path(dest)


def atomic_write_text(dest: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    return atomic_write_bytes(dest, text.encode(), mode)


def atomic_write_many(files: dict[str | os.PathLike, bytes | str]) -> list[Path]:
    """Write several files so that either all appear or none: every one is written before any is renamed in (each
    rename is atomic); a failure while writing leaves nothing behind."""
    for dest in files:  # before anything is written or renamed
        if Path(dest).is_dir() and not Path(dest).is_symlink():
            raise IsADirectoryError(errno.EISDIR, "is a directory, not replaced", str(dest))
    with contextlib.ExitStack() as stack:
        for dest, data in files.items():
            tmp = stack.enter_context(atomic_path(dest))
            tmp.write_bytes(_bytes(data))
            os.chmod(tmp, 0o644)
    return [Path(dest) for dest in files]


# --- outputs a user names on the command line ------------------------------------------------------------------------
# The types argparse gives such options (cliutil.add_output): strings that remember their option, so the command's
# code uses them as paths while cliutil.run_parsed checks every one of them before the command starts.

class OutputFile(str):
    """A file to write a result to. A directory there is refused, never replaced; a symlink is followed (the file it
    points to is written, the link stays); a character device or FIFO (/dev/stdout) is written in place."""

    option = ""
    stdout_dash = False  # "-" means stdout, for options that say so


class OutputDir(str):
    """A directory to write named files into (created when missing): only those files are written there, nothing else
    in it is touched."""

    option = ""


def _label(path: str | os.PathLike, option: str = "") -> str:
    option = option or getattr(path, "option", "")
    return f"{option} {path}" if option else str(path)


def _refuse(path: str | os.PathLike, why: str, option: str = ""):
    raise UserError(f"{_label(path, option)}: {why} (refused before anything ran; nothing written or removed)",
                    OUTPUT_REFUSED)


def _refuse_unless_creatable(path: str | os.PathLike, directory: Path) -> None:
    """Refuse `path` unless a file can be created in `directory`. A real probe (a temporary file created and
    removed), as permission bits do not tell: root passes them, read-only mounts and /proc do not show in them."""
    try:
        fd, name = tempfile.mkstemp(prefix=".ucx-dask-gpu-probe.", dir=directory)
    except OSError as e:
        _refuse(path, f"no file can be created in {directory} ({e.strerror or e})")
    os.close(fd)
    os.unlink(name)


def _in_place(path: Path) -> bool:
    """A character device or FIFO: written as it is (renaming a file over /dev/stdout would replace the device)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _file_target(path: str | os.PathLike) -> Path:
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() and not _in_place(p) else p


def check_output_file(path: str | os.PathLike) -> Path:
    """Before the work: refuse (exit 9, one line) a file output that could not be written afterwards."""
    if path == "-" and getattr(path, "stdout_dash", False):
        return Path(path)
    try:
        target = _file_target(path)
        if target.is_dir():
            _refuse(path, "is a directory, name a file to write")
        if _in_place(target):
            if not os.access(target, os.W_OK):
                _refuse(path, "not writable")
            return target
        if target.exists() and not target.is_file():
            _refuse(path, "exists and is not a regular file")
        parent = target.parent
        if not parent.is_dir():
            _refuse(path, f"no directory {parent}" if not parent.exists() else f"{parent} is not a directory")
        _refuse_unless_creatable(path, parent)
    except OSError as e:
        _refuse(path, e.strerror or str(e))
    return target


def check_output_dir(path: str | os.PathLike) -> Path:
    """Before the work: refuse (exit 9, one line) a directory output that could not be written afterwards: a file
    standing there or on the way to it, or a nearest existing directory that no file can be created in (the
    missing ones are created at the write, like mkdir -p)."""
    p = Path(path)
    try:
        where = p
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            _refuse(path, "exists and is not a directory" if where == p else f"{where} is not a directory")
        _refuse_unless_creatable(path, where)
    except OSError as e:
        _refuse(path, e.strerror or str(e))
    return p


WORK_MARK = ".ucx-dask-gpu-work"


def claim_work_dir(path: str | os.PathLike, option: str = "") -> Path:
    """A work directory a command replaces its own folders in (logs, sources, stages): accepted when new, empty or
    claimed by an earlier run (WORK_MARK), and claimed then. One holding anything else, even only folders named as the
    command's own (a user's ~/logs), is refused (exit 9) before the work: `--work-dir ~` must not cost anyone ~/logs."""
    d = Path(path)
    try:
        if d.is_dir() and not (d / WORK_MARK).is_file():
            foreign = sorted(p.name for p in d.iterdir())
            if foreign:
                _refuse(path, f"holds what this command did not make ({first_of(foreign)}); give a new or empty "
                               "directory, or one it worked in before", option)
        d.mkdir(parents=True, exist_ok=True)
        (d / WORK_MARK).touch()
    except OSError as e:
        _refuse(path, e.strerror or str(e), option)
    return d


# --- what the tool wrote into a directory: its manifest -------------------------------------------------------------
# A directory the tool writes carries MANIFEST: the names it wrote there. A later run replaces only those; anything
# else is the user's: the command refuses (exit 9) naming it, and never replaces or removes it. A directory is
# replaced or removed whole only when everything in it is recorded there (or it is empty): the tool never deletes a
# directory it cannot prove it made.

MANIFEST = ".ucx-dask-gpu-manifest"  # no .json/.yaml suffix: dask reads those in a config directory
SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk or a size limit: the write, not the input


def read_manifest(directory: str | os.PathLike) -> dict:
    """The record of `directory`: files (paths it wrote), trees (top-level folders claimed whole), key (what the
    writer uses to tell whether its content is current). Empty where there is none: then nothing there is ours."""
    try:
        data = json.loads((Path(directory) / MANIFEST).read_text())
        return {"files": [str(f) for f in data["files"]], "trees": [str(t) for t in data["trees"]],
                "key": data.get("key")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"files": [], "trees": [], "key": None}


def write_manifest(directory: str | os.PathLike, files: Iterable[str], trees: Iterable[str] = (),
                   key: str | None = None) -> None:
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(
        {"files": sorted(set(files)), "trees": sorted(set(trees)), "key": key}, indent=1) + "\n")


def record_written(directory: str | os.PathLike, names: Iterable[str]) -> None:
    """Add `names` to the manifest, after they were written (a name recorded is one the tool wrote)."""
    record = read_manifest(directory)
    write_manifest(directory, [*record["files"], *names], record["trees"], record["key"])


def unknown_entries(directory: str | os.PathLike, files: Iterable[str] | None = None) -> list[str]:
    """What `directory` holds that its manifest does not record, as sorted relative paths (a folder not recorded is
    named, not descended into). `files`: the paths another record of the writer lists instead (a UCX prefix's build
    info); the folders holding them count as written too."""
    d = Path(directory)
    record = read_manifest(d) if files is None else {"files": list(files), "trees": []}
    trees = set(record["trees"])
    files = {*record["files"], *(parent.as_posix() for f in record["files"] for parent in Path(f).parents)}
    unknown = []
    for top, dirs, names in os.walk(d):
        rel = Path(top).relative_to(d)
        for name in list(dirs):
            path = (rel / name).as_posix()
            if path not in files:  # a tree claimed whole is not looked into; an unknown folder is named once
                dirs.remove(name)
                if path not in trees:
                    unknown.append(path)
        unknown += [p for n in names if (p := (rel / n).as_posix()) not in files and p not in trees and p != MANIFEST]
    return sorted(unknown)


def first_of(names: list[str]) -> str:
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def refuse_unknown(directory: str | os.PathLike, option: str = "") -> None:
    """Before the work (exit 9): refuse `directory` unless it is missing, empty, or holds only what its manifest
    records."""
    d = Path(directory)
    try:
        if not d.exists() and not d.is_symlink():
            return
        if d.is_symlink() or not d.is_dir():
            _refuse(directory, "exists and is not a directory", option)
        unknown = unknown_entries(d)
    except OSError as e:
        _refuse(directory, e.strerror or str(e), option)
    if unknown:
        _refuse(directory, f"holds {first_of(unknown)}, which this command did not write (not in its {MANIFEST}); "
                           "give a new or empty directory, or one it wrote before", option)


@contextlib.contextmanager
def replace_own_dir(dest: str | os.PathLike, option: str = "", trees: bool = False,
                    key: str | None = None) -> Iterator[Path]:
    """Yield a new directory to fill; when the block succeeds it replaces `dest` whole, with a manifest of everything
    in it (`trees`: each top-level folder claimed whole, for a root filesystem whose own programs write inside it).
    `dest` must be missing, empty, or hold only what its manifest records: else refused (exit 9) before the block
    and again just before the replacement. A full disk or a parent that cannot be made: one line (exit 9), nothing
    of the new directory left."""
    refuse_unknown(dest, option)
    body_failed: list[BaseException] = []
    try:
        with atomic_path(dest, replace_dir=True) as tmp:
            tmp.mkdir()
            try:
                yield tmp
            except OSError as e:
                if e.errno in SPACE_ERRORS:
                    raise
                body_failed.append(e)  # the caller's own error (an input it reads), passed on as it is
                raise
            entries = sorted(p.name for p in tmp.iterdir()) if trees else \
                [p.relative_to(tmp).as_posix() for p in tmp.rglob("*")]
            write_manifest(tmp, [] if trees else entries, entries if trees else [], key)
            refuse_unknown(dest, option)  # nothing of the user's appeared there while the work ran
    except OSError as e:  # making the parent or the temporary directory, a full disk, the manifest, the rename
        if body_failed:
            raise
        raise UserError(f"{_label(dest, option)}: cannot write ({e.strerror or e}); nothing of it was left there, "
                        "nothing else touched", OUTPUT_REFUSED) from None


def taken_names(directory: str | os.PathLike, files: Mapping[str, bytes | None]) -> list[str]:
    """The names among `files` that stand in `directory` and are not the tool's (not in its manifest), sorted. A file
    whose bytes are exactly those about to be written is not counted: replacing it loses nothing."""
    d = Path(directory)
    recorded = set(read_manifest(d)["files"])
    taken = []
    for name, data in files.items():
        path = d / name
        if name in recorded or not (path.exists() or path.is_symlink()):
            continue
        with contextlib.suppress(OSError):
            if data is not None and path.is_file() and not path.is_symlink() and path.read_bytes() == data:
                continue
        taken.append(name)
    return sorted(taken)


def check_names_free(directory: str | os.PathLike, names: Iterable[str] | Mapping[str, bytes | str],
                     option: str = "", overwrite_flag: str = "") -> None:
    """Before the work (exit 9), for a command that adds files into a user's directory: refuse when a name it will
    write (with the bytes, where known) is taken by a file it did not write; `overwrite_flag` is the option that says
    to replace them anyway."""
    taken = taken_names(directory, {n: _bytes(names[n]) if isinstance(names, Mapping) else None for n in names})
    if taken:
        how = f"; {overwrite_flag} replaces them" if overwrite_flag else ""
        _refuse(directory, f"{first_of(taken)} is there and this command did not write it (not in its "
                           f"{MANIFEST}){how}", option)


def keep_result(files: Mapping[str, bytes], beside: Path | None, stem: str, stdout: IO[str] | None = None) -> str:
    """Put what could not be written where it survives: in directory `beside` (as STEM.kept-XXXX, a file or, for
    several files, a directory), else in the temporary directory, else on `stdout` (text files only). Returns where,
    as words for the one line."""
    for directory in dict.fromkeys((beside, None)):
        kept = None
        try:
            directory = directory or Path(tempfile.gettempdir())  # which fails itself where no file can be made
            if len(files) == 1:
                fd, kept = tempfile.mkstemp(prefix=f"{stem}.kept-", dir=directory)
                with os.fdopen(fd, "wb") as f:
                    f.write(next(iter(files.values())))
                return f"at {kept}"
            kept = tempfile.mkdtemp(prefix=f"{stem}.kept-", dir=directory)
            for name, data in files.items():
                (Path(kept) / name).write_bytes(data)
            return f"in {kept}"
        except OSError:
            if kept and os.path.isdir(kept):  # a copy half written (full disk, size limit) is no copy
                shutil.rmtree(kept, ignore_errors=True)
            elif kept:
                with contextlib.suppress(OSError):
                    os.unlink(kept)
    out = stdout or sys.stdout
    texts = {}
    for name, data in files.items():
        with contextlib.suppress(UnicodeDecodeError):
            texts[name] = data.decode()
    try:
        for name, text in texts.items():
            if len(files) > 1:
                out.write(f"# ---- {name}\n")
            out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
    except (OSError, ValueError) as e:  # stdout closed too: say so rather than claim a copy
        return f"nowhere (stdout failed too: {getattr(e, 'strerror', None) or e})"
    skipped = sorted(set(files) - set(texts))
    return "on stdout" + (f" (without {', '.join(skipped)}: binary)" if skipped else "")


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else data


def write_output_file(path: str | os.PathLike, data: bytes | str, stdout: IO[str] | None = None,
                      what: str = "the result") -> Path | None:
    """After the work: write `path` whole (or in place for a device/FIFO), never replacing a directory. When that
    fails, keep `data` (keep_result) and end with one line saying where (exit 18). "-" with stdout_dash: stdout."""
    data = _bytes(data)
    if path == "-" and getattr(path, "stdout_dash", False):
        out = stdout or sys.stdout
        out.write(data.decode())
        out.flush()
        return None
    target = _file_target(path)
    try:
        if _in_place(target):
            with open(target, "wb") as f:
                f.write(data)
        else:
            atomic_write_bytes(target, data)
        return target
    except OSError as e:
        # beside a device is /dev, no place for a user's result: the temporary directory or stdout instead
        where = keep_result({target.name: data}, None if _in_place(target) else target.parent, target.name, stdout)
        raise UserError(f"{_label(path)}: cannot write ({e.strerror or e}); {what} is kept {where}",
                        RESULT_KEPT) from None


def write_output_dir(path: str | os.PathLike, files: Mapping[str, bytes | str], stdout: IO[str] | None = None,
                     what: str = "the report", overwrite: bool = False) -> list[Path]:
    """After the work: write these files into directory `path` (created with its parents when missing), all or none,
    leaving everything else in it alone, and record them in its manifest. A name taken by a file it did not write
    is not replaced, unless `overwrite` (the user said so, or another record of the caller's proves the files its
    own). When they cannot be written, keep them (keep_result) and end with one line saying where (exit 18)."""
    directory = Path(path)
    data = {name: _bytes(d) for name, d in files.items()}
    created = not directory.exists()
    try:
        taken = taken_names(directory, data) if directory.is_dir() and not overwrite else []
        if taken:
            why = f"{first_of(taken)} is there and this command did not write it (not in its {MANIFEST})"
        else:
            directory.mkdir(parents=True, exist_ok=True)
            written = atomic_write_many({directory / name: d for name, d in data.items()})
            record_written(directory, data)
            return written
    except OSError as e:
        why = f"cannot write ({e.strerror or e})"
        if created:  # the empty directory this run made is no output either
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    where = keep_result(data, directory.resolve().parent, directory.resolve().name, stdout)
    raise UserError(f"{_label(path)}: {why}; {what} is kept {where}", RESULT_KEPT)

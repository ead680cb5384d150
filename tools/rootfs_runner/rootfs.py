"""The image's own bits, taken to a machine without Docker: its filesystem in verified parts, and back in one piece.

`python -m tools.rootfs_runner export IMAGE DIR` writes

    DIR/manifest.json        image, image id, stack id, compression, sha256 + size of the rootfs tar, of the compressed
                             archive and of every part, and the batches
    DIR/image-config.json    the image's Config: Env, User, WorkingDir, Entrypoint, Cmd, Labels
    DIR/batch-NN/            one part (`rootfs.tar.<zst|xz>.NNN`, at most --part-size) + both JSON files, so
                             the parts can travel one at a time (a file-size or transfer limit, removable media)
                             and each is checked on arrival

from `docker export` of a container created (never started) from the image, compressed (xz by default, zstd -19
--long on request), split and hashed on the way, in a temporary directory beside DIR first (nothing half-written is
left under DIR).

On the machine that runs it (as root, standard library only):
    `receive BATCH_DIR`  moves the batch's part(s) into the parts directory (stack.toml [gpu_host]), checks each against
                         the manifest and says which parts are still missing;
    `unpack`             checks every part again, decompresses them in order into `tar -x` (owners kept) while
                         hashing the tar stream, and marks the root directory with the archive's sha256 (an unpacked
                         root with the same mark is reused).
A missing part or a wrong sha256 ends with one line and ROOTFS_INVALID; a damaged unpack is removed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import secrets
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Iterable, Iterator

from ucx_dask_gpu import fsutil
from ucx_dask_gpu.errors import OUTPUT_REFUSED, ROOTFS_INVALID, USAGE, UserError
from ucx_dask_gpu.fsutil import atomic_write_text, sha256_file
from ucx_dask_gpu.image.docker import docker_bin, image_inspect

MANIFEST = "manifest.json"
CONFIG = "image-config.json"
MIB = 1 << 20
DEFAULT_PART_SIZE = "1GiB"    # export --part-size: smaller where a file-size or transfer limit applies
CHUNK = 4 * MIB
ZSTD_WINDOW_LOG = 27          # --long: a 128 MiB window; the decoder needs the same (--long=27)
COMPRESSIONS = {"zstd": "zst", "xz": "xz"}
# xz: present on every host that unpacks the parts (zstd smaller and faster where both ends have it: --compression)
DEFAULT_COMPRESSION = "xz"
CONFIG_KEYS = ("Env", "User", "WorkingDir", "Entrypoint", "Cmd", "Labels")


# --- export (here, with Docker) -------------------------------------------------------------------------------------

def _compressor(compression: str, level: int) -> list[str]:
    if compression == "zstd":
        if not shutil.which("zstd"):
            raise UserError("export: the zstd command is missing (apt-get install zstd)", USAGE)
        return ["zstd", f"-{level}", f"--long={ZSTD_WINDOW_LOG}", "-T0", "-q", "-c"]
    if compression == "xz":
        return ["xz", f"-{min(level, 9)}", "-T0", "-c"]
    raise UserError(f"unknown compression {compression!r} (expected {', '.join(COMPRESSIONS)})", USAGE)


def _pump(src, dst, digest) -> None:
    """Copy a stream to another, hashing it; closes `dst`. A reader that went away (stopped on a failure) ends it:
    the reader's exit code tells why."""
    with contextlib.suppress(BrokenPipeError):
        try:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        finally:
            dst.close()


def export_rootfs(image: str, out: str | os.PathLike, part_size: int, level: int = 19,
                  compression: str = DEFAULT_COMPRESSION) -> dict:
    """Export `image`'s filesystem into `out` (see the module doc); returns the manifest."""
    fsutil.refuse_unknown(out)  # before Docker works: pack() checks again at the end
    meta = image_inspect(image)
    if meta is None:
        raise UserError(f"no image {image} (build it: scripts/build_image.sh)", USAGE)
    cfg = meta.get("Config") or {}
    identity = {"image": image, "image_id": meta.get("Id"),
                "stack_id": (cfg.get("Labels") or {}).get("io.ucx-dask-gpu.stack-id")}
    container = f"udg-export-{secrets.token_hex(3)}"
    proc = subprocess.run([docker_bin(), "create", "--name", container, image], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"export: docker create {image} failed: {proc.stderr.strip()[-200:]}", USAGE)
    try:
        return pack([docker_bin(), "export", container], out, identity, {k: cfg.get(k) for k in CONFIG_KEYS},
                    part_size, level, compression)
    finally:
        subprocess.run([docker_bin(), "rm", "-f", container], capture_output=True)


def pack(tar_command: list[str], out: str | os.PathLike, identity: dict, config: dict, part_size: int,
         level: int = 19, compression: str = DEFAULT_COMPRESSION) -> dict:
    """The tar that `tar_command` writes on stdout, compressed, split and hashed into `out` (batches, manifest with
    `identity`, image config `config`); written in a temporary directory beside it and renamed when complete."""
    if part_size < MIB:
        raise UserError(f"--part-size must be at least 1 MiB (got {part_size} bytes)", USAGE)
    compress = _compressor(compression, level)
    # a new directory, or one this command exported before (replaced; anything else there is refused, exit 9)
    with fsutil.replace_own_dir(out, getattr(out, "option", "")) as tmp:
        source = subprocess.Popen(tar_command, stdout=subprocess.PIPE)
        compressor = subprocess.Popen(compress, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        tar_digest = CountingSha256()
        feeder = threading.Thread(target=_pump, args=(source.stdout, compressor.stdin, tar_digest))
        feeder.start()
        writer = PartWriter(tmp, f"rootfs.tar.{COMPRESSIONS[compression]}", part_size)
        try:
            while chunk := compressor.stdout.read(CHUNK):
                writer.write(chunk)
        except BaseException:  # a full disk, Ctrl-C: nothing of the pipeline stays running or holds a file open
            for proc in (source, compressor):
                proc.kill()
                proc.wait()
            with contextlib.suppress(OSError):  # its file closes even when the flush fails
                writer.close()
            feeder.join()
            raise
        parts = writer.close()
        feeder.join()
        if source.wait() != 0 or compressor.wait() != 0:
            raise UserError(f"export: {tar_command[0]} {tar_command[1]} or {compress[0]} failed (exit "
                            f"{source.returncode}, {compressor.returncode})", USAGE)
        manifest = {
            **identity, "compression": compression,
            "zstd_window_log": ZSTD_WINDOW_LOG if compression == "zstd" else None,
            "rootfs_sha256": tar_digest.hexdigest(), "rootfs_bytes": tar_digest.bytes,
            "archive_sha256": writer.archive.hexdigest(), "archive_bytes": writer.archive.bytes,
            "parts": parts, "batches": [f"batch-{i + 1:02d}" for i in range(len(parts))],
        }
        for batch, part in zip(manifest["batches"], parts):
            (tmp / batch).mkdir()
            (tmp / part["name"]).rename(tmp / batch / part["name"])
        for d in [tmp, *(tmp / b for b in manifest["batches"])]:
            atomic_write_text(d / MANIFEST, json.dumps(manifest, indent=2) + "\n")
            atomic_write_text(d / CONFIG, json.dumps(config, indent=2) + "\n")
    return manifest


class CountingSha256:
    """sha256 that also counts the bytes it saw."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.bytes = 0

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.bytes += len(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class PartWriter:
    """Writes a stream into numbered part files of at most `size` bytes, hashing each part and the whole."""

    def __init__(self, d: Path, stem: str, size: int) -> None:
        self.d, self.stem, self.size = d, stem, size
        self.parts: list[dict] = []
        self.archive = CountingSha256()
        self._file = None
        self._hash = None
        self._bytes = 0

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1].update(bytes=self._bytes, sha256=self._hash.hexdigest())
            self._file = None

    def write(self, data: bytes) -> None:
        self.archive.update(data)
        while data:
            if self._file is None:
                name = f"{self.stem}.{len(self.parts):03d}"
                self.parts.append({"name": name})
                self._file, self._hash, self._bytes = open(self.d / name, "wb"), hashlib.sha256(), 0
            piece = data[:self.size - self._bytes]
            self._file.write(piece)
            self._hash.update(piece)
            self._bytes += len(piece)
            data = data[len(piece):]
            if self._bytes == self.size:
                self._finish()

    def close(self) -> list[dict]:
        self._finish()
        return self.parts


# --- receive, verify, unpack (on the machine that runs it) ----------------------------------------------------------

def read_manifest(d: str | os.PathLike) -> dict:
    path = Path(d) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        manifest["parts"], manifest["compression"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"no readable {MANIFEST} in {d} (export it with `python -m tools.rootfs_runner export`)",
                        ROOTFS_INVALID) from None
    return manifest


def _check_part(path: Path, part: dict) -> str | None:
    if not path.is_file():
        return "missing"
    if path.stat().st_size != part["bytes"] or sha256_file(path) != part["sha256"]:
        return "sha256 differs from the manifest"
    return None


def receive(batch: str | os.PathLike, parts_dir: str | os.PathLike) -> dict:
    """Move a batch's part(s) (and the manifest and config) into `parts_dir`, check them; report what is missing."""
    batch, parts_dir = Path(batch), Path(parts_dir)
    manifest = read_manifest(batch)
    known = {p["name"]: p for p in manifest["parts"]}
    incoming = [f for f in sorted(batch.iterdir()) if f.name in known]
    # the parts directory may hold the user's files too: a name taken by one no earlier receive wrote stays theirs
    fsutil.check_output_dir(parts_dir)
    fsutil.check_names_free(parts_dir, {**{n: (batch / n).read_bytes() for n in (MANIFEST, CONFIG)},
                                        **{f.name: None for f in incoming}}, "--parts")
    if (parts_dir / MANIFEST).is_file():
        have = read_manifest(parts_dir)
        if have.get("archive_sha256") != manifest.get("archive_sha256"):
            raise UserError(f"{parts_dir} holds parts of another export ({have.get('image')}, archive "
                            f"{str(have.get('archive_sha256'))[:12]}): remove it first", ROOTFS_INVALID)
    moved = []
    try:
        parts_dir.mkdir(parents=True, exist_ok=True)
        for name in (MANIFEST, CONFIG):
            shutil.copyfile(batch / name, parts_dir / name)
        fsutil.record_written(parts_dir, [MANIFEST, CONFIG])
        for f in incoming:
            dest = parts_dir / f.name
            try:
                shutil.move(str(f), dest)  # a copy across file systems: a half copy is no part
            except OSError:
                dest.unlink(missing_ok=True)
                raise
            problem = _check_part(dest, known[f.name])
            if problem:
                dest.unlink()
                raise UserError(f"{f.name}: {problem}: copy it again", ROOTFS_INVALID)
            moved.append(f.name)
    except OSError as e:  # a full disk midway: what was moved stays a whole, checked part; the rest stays in the batch
        raise UserError(f"--parts {parts_dir}: cannot write ({e.strerror or e}); received "
                        f"{', '.join(moved) or 'no part'}, the rest is still in {batch}", OUTPUT_REFUSED) from None
    finally:
        if moved:  # each part moved in and checked is the tool's, whatever stopped the rest
            with contextlib.suppress(OSError):
                fsutil.record_written(parts_dir, moved)
    missing = [p["name"] for p in manifest["parts"] if not (parts_dir / p["name"]).is_file()]
    return {"moved": moved, "missing": missing, "parts": len(manifest["parts"]), "image": manifest["image"]}


def verify_parts(parts_dir: str | os.PathLike) -> dict:
    """The manifest of `parts_dir` when every part is there with its sha256; else ROOTFS_INVALID naming them."""
    parts_dir = Path(parts_dir)
    manifest = read_manifest(parts_dir)
    bad = [f"{p['name']} {why}" for p in manifest["parts"] if (why := _check_part(parts_dir / p["name"], p))]
    if bad:
        raise UserError(f"{len(bad)} of {len(manifest['parts'])} parts not usable in {parts_dir}: {', '.join(bad)}",
                        ROOTFS_INVALID)
    return manifest


def _decoder(compression: str) -> tuple[list[str] | None, object]:
    """A decompressing command, else a Python decompressor object (standard library for xz; `zstandard` if
    installed for zstd); ROOTFS_INVALID when neither exists here."""
    if compression == "zstd":
        if shutil.which("zstd"):
            return ["zstd", "-d", "-q", "-c", f"--long={ZSTD_WINDOW_LOG}"], None
        try:
            import zstandard  # optional: only where no zstd command exists
        except ImportError:
            raise UserError("no zstd decoder here (no zstd command, no Python zstandard): install one of them, "
                            "or export with --compression xz", ROOTFS_INVALID) from None
        return None, zstandard.ZstdDecompressor(max_window_size=1 << ZSTD_WINDOW_LOG).decompressobj()
    if compression == "xz":
        return (["xz", "-d", "-c"], None) if shutil.which("xz") else (None, lzma.LZMADecompressor())
    raise UserError(f"unknown compression {compression!r} in the manifest", ROOTFS_INVALID)


def _archive_chunks(parts_dir: Path, manifest: dict) -> Iterator[bytes]:
    for part in manifest["parts"]:
        with open(parts_dir / part["name"], "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk


def _decompressed(chunks: Iterable[bytes], compression: str) -> Iterator[bytes]:
    cmd, obj = _decoder(compression)
    if obj is not None:
        for chunk in chunks:
            if data := obj.decompress(chunk):
                yield data
        return
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def feed():
        try:
            for chunk in chunks:
                proc.stdin.write(chunk)
        except BrokenPipeError:
            pass
        finally:
            proc.stdin.close()

    feeder = threading.Thread(target=feed)
    feeder.start()
    while data := proc.stdout.read(CHUNK):
        yield data
    feeder.join()
    if proc.wait() != 0:
        raise UserError(f"{cmd[0]} could not decompress the archive (exit {proc.returncode})", ROOTFS_INVALID)


def unpack(root: str | os.PathLike, parts_dir: str | os.PathLike) -> dict:
    """Unpack the verified parts into `root` as root (owners, modes kept); reuse an unpack of the same archive. A root
    holding anything an earlier unpack did not make is refused (exit 9), never removed (fsutil.replace_own_dir; the
    image's top-level folders are claimed whole: its programs write inside them when it runs)."""
    parts_dir, root = Path(parts_dir), Path(root)
    manifest = verify_parts(parts_dir)
    if fsutil.read_manifest(root)["key"] == manifest["archive_sha256"]:
        return {"root": str(root), "reused": True, "manifest": manifest}
    if os.geteuid() != 0:
        raise UserError("unpacking the image's filesystem keeps its owners: run as root", ROOTFS_INVALID)
    with fsutil.replace_own_dir(root, "--root", trees=True, key=manifest["archive_sha256"]) as new:
        tar = subprocess.Popen(["tar", "-x", "-p", "--numeric-owner", "-C", str(new), "-f", "-"],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        digest = CountingSha256()
        try:
            for data in _decompressed(_archive_chunks(parts_dir, manifest), manifest["compression"]):
                digest.update(data)
                tar.stdin.write(data)
        except (BrokenPipeError, UserError) as e:
            tar.kill()
            if isinstance(e, UserError):
                raise
            raise UserError(f"tar stopped unpacking into {root}: {tar.stderr.read().decode()[-200:]}",
                            ROOTFS_INVALID) from None
        tar.stdin.close()
        err = tar.stderr.read().decode().strip()
        if tar.wait() != 0 or digest.hexdigest() != manifest["rootfs_sha256"]:
            why = f"tar failed: {err[-200:]}" if tar.returncode else \
                "the unpacked tar's sha256 differs from the manifest"
            raise UserError(f"unpacking into {root}: {why}", ROOTFS_INVALID)
    return {"root": str(root), "reused": False, "manifest": manifest, "bytes": digest.bytes}


def read_image_config(d: str | os.PathLike) -> dict:
    try:
        return json.loads((Path(d) / CONFIG).read_text())
    except (OSError, ValueError):
        raise UserError(f"no readable {CONFIG} in {d}", ROOTFS_INVALID) from None

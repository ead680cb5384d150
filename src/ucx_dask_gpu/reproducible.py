"""Reproducible image: the same inputs give the same image id, byte for byte, on any build machine.

Docker 20.10's classic builder (what Debian ships; no BuildKit `rewrite-timestamp`) writes build times into every
layer (directory and file mtimes), into the image config (`created`, history, the build container's id and
hostname, the parent image id, the engine version) and leaves .pyc files whose headers carry file mtimes. So the
image is made deterministic AFTER `docker build`, from what the build produced:

1. `docker save` the built image;
2. normalise every layer tar (`tarnorm`: sorted entries, mtimes clamped to SOURCE_DATE_EPOCH, numeric owners, no
   atime/ctime, only xattr pax records, whiteouts kept) and fix what clamping or the build leaves behind:
   - a timestamp-based .pyc whose source mtime is clamped would be stale: it becomes a checked-hash .pyc with the
     same code (valid for the source as shipped, whatever its mtime);
   - "last password change" days in /etc/shadow later than SOURCE_DATE_EPOCH are clamped to it;
   - build litter (pip/apt caches, apt lists, logs, /tmp) is dropped from the layer, and each drop is reported;
3. add one layer with the SBOM (/usr/share/ucx-dask-gpu/sbom.cdx.json, `sbom.py`), generated from the normalised
   layers themselves (dpkg status, installed distributions, UCX build info) and the hashed lock;
4. rebuild the config from an allow-list: `created` and every history entry at SOURCE_DATE_EPOCH, no build
   container, hostname, parent image or engine version; OCI labels `created`/`version`/`revision`/`source` and the
   stack id; new diff_ids;
5. write ONE archive that is both an OCI image layout (oci-layout, index.json, blobs/sha256/...) and a
   `docker load` archive (manifest.json pointing at the same blobs), itself deterministic, and `docker load` it.

The image id (sha256 of the config) is then a function of the inputs only; it is what two clean builds compare.
Next to the archive: image.json (ids and digests) and layers.json (every entry of every layer: path, type, mode,
owner, mtime, size, sha256), which `compare` uses to name the first differing files per layer.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from . import tarnorm
from .errors import BAD_ARCHIVE, NOT_REPRODUCIBLE, USAGE, UserError
from .fsutil import atomic_path, atomic_write_text, sha256_file

SBOM_IN_IMAGE = "usr/share/ucx-dask-gpu/sbom.cdx.json"
IMAGE_JSON = "image.json"
LAYERS_JSON = "layers.json"
SBOM_JSON = "sbom.cdx.json"
ARCHIVE = "image.tar"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LABEL_PREFIX = "io.ucx-dask-gpu."
# Container config keys an image config keeps (OCI image-spec config + Docker's Healthcheck/OnBuild/Shell).
# Everything else (Hostname, Domainname, Image = the parent's id, Attach*, Tty, ...) is build-host state.
CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir", "Labels", "StopSignal",
               "ArgsEscaped", "Healthcheck", "OnBuild", "Shell")

# Build litter: files below these directories are dropped from every layer (directories themselves stay, and so
# do whiteouts: deleting a lower file is not litter). A Dockerfile should not leave them; the normaliser reports
# each one it drops, so the cause can be fixed where it is made.
LITTER_DIRS = ("root/.cache/", "tmp/", "var/tmp/", "var/cache/apt/", "var/lib/apt/lists/", "var/log/",
               "var/cache/ldconfig/", "run/", "dev/", "proc/", "sys/")
LITTER_RE = re.compile(r"^(home/[^/]+/\.cache/|var/cache/debconf/[^/]+-old$|var/lib/dpkg/[^/]+-old$)")


def iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def say(msg: str) -> None:
    print(f"repro: {msg}", file=sys.stderr, flush=True)


# --- content fixes --------------------------------------------------------------------------------------------------

def fix_shadow(data: bytes, epoch: int) -> bytes | None:
    """Clamp the "last password change" field (days since 1970) of shadow(5) lines to SOURCE_DATE_EPOCH's day."""
    days = epoch // 86400
    changed = False
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        f = line.split(b":")
        if len(f) >= 3 and f[2].isdigit() and int(f[2]) > days:
            f[2] = str(days).encode()
            lines[i] = b":".join(f)
            changed = True
    return b"\n".join(lines) if changed else None


def pyc_source(pyc_path: str) -> str | None:
    """`d/__pycache__/m.cpython-311.opt-1.pyc` -> `d/m.py` (None for legacy or sourceless layouts)."""
    head, _, fname = pyc_path.rpartition("/")
    if not fname.endswith(".pyc") or not (head == "__pycache__" or head.endswith("/__pycache__")):
        return None
    parent = head[: -len("__pycache__")].rstrip("/")
    module = fname.split(".", 1)[0]
    return f"{parent}/{module}.py" if parent else f"{module}.py"


def fix_pyc(pyc: bytes, source: bytes, source_mtime: int, epoch: int) -> bytes | None:
    """A timestamp .pyc that is valid for `source` but would be stale once the source's mtime is clamped to `epoch`
    becomes a checked-hash .pyc with the same code object (PEP 552). Anything else is left alone (None):
    hash-based already, stale already (recompiling it is Python's business), still valid after clamping, or
    compiled by a different Python than this one (its source hash key would differ)."""
    if len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return None
    if int.from_bytes(pyc[4:8], "little") != 0:
        return None
    mtime, size = int.from_bytes(pyc[8:12], "little"), int.from_bytes(pyc[12:16], "little")
    if mtime != (source_mtime & 0xFFFFFFFF) or size != (len(source) & 0xFFFFFFFF):
        return None
    if source_mtime <= epoch:
        return None
    return pyc[:4] + (0b11).to_bytes(4, "little") + importlib.util.source_hash(source) + pyc[16:]


def is_litter(ti: tarfile.TarInfo) -> bool:
    name = ti.name
    base = name.rpartition("/")[2]
    if ti.type == tarfile.DIRTYPE or base.startswith(tarnorm.WHITEOUT_PREFIX):
        return False
    return name.startswith(LITTER_DIRS) or bool(LITTER_RE.match(name))


# --- the files of an image, layer over layer ----------------------------------------------------------------------

class Overlay:
    """What the union of the layers seen so far holds, for the few things the normaliser needs to know:
    every path (to avoid re-creating existing directories), the Python sources (for .pyc fixes) and the
    contents of the files the SBOM is made from."""

    def __init__(self):
        self.paths: set[str] = set()
        self.sources: dict[str, tuple[tarfile.TarFile, tarfile.TarInfo]] = {}
        self.watched: dict[str, bytes] = {}

    @staticmethod
    def watch(name: str) -> bool:
        return (name in ("var/lib/dpkg/status", "usr/lib/os-release", "etc/ucx-dask-gpu/stack-id")
                or name.endswith("/share/ucx-dask-gpu/build-info.json")
                or name.endswith("/share/ucx-dask-gpu/ucxx-build-info.json")
                or (name.endswith(".dist-info/METADATA") and name.count("/") >= 1))

    def whiteout(self, name: str) -> None:
        """Apply one whiteout entry of an upper layer to what the lower layers hold."""
        head, _, base = name.rpartition("/")
        if base == tarnorm.OPAQUE_WHITEOUT:
            prefix = f"{head}/" if head else ""
            gone = lambda p: p.startswith(prefix)  # noqa: E731
        else:
            target = f"{head}/{base[len(tarnorm.WHITEOUT_PREFIX):]}" if head else base[len(tarnorm.WHITEOUT_PREFIX):]
            gone = lambda p: p == target or p.startswith(target + "/")  # noqa: E731
        self.paths = {p for p in self.paths if not gone(p)}
        self.sources = {p: v for p, v in self.sources.items() if not gone(p)}
        self.watched = {p: v for p, v in self.watched.items() if not gone(p)}


# --- one layer --------------------------------------------------------------------------------------------------------

@dataclass
class LayerResult:
    diff_id: str
    size: int
    entries: list[tarnorm.Entry]
    dropped: list[str]
    rewritten: list[str]


def normalise_layer(src: tarfile.TarFile, out, epoch: int, overlay: Overlay, where: str,
                    drop_litter: bool = True) -> LayerResult:
    members = {tarnorm.clean_name(m.name): m for m in src.getmembers()}
    # Whiteouts act on the lower layers, before this layer's own files are added.
    for name in sorted(members, key=tarnorm.sort_key):
        if name.rpartition("/")[2].startswith(tarnorm.WHITEOUT_PREFIX):
            overlay.whiteout(name)
    seen: dict[str, bytes] = {}

    def source_of(py: str) -> tuple[bytes, int] | None:
        """(contents, mtime) of the file Python would stat for `py`: symlinks and hard links followed, this layer
        first, then the layers below."""
        for _ in range(16):
            m = members.get(py)
            tf = src
            if m is None and py in overlay.sources:
                tf, m = overlay.sources[py]
            if m is None:
                return None
            if m.type == tarfile.LNKTYPE and tf is src:
                py = tarnorm.clean_name(m.linkname)
            elif m.type == tarfile.SYMTYPE:
                target = m.linkname if m.linkname.startswith("/") else f"{py.rpartition('/')[0]}/{m.linkname}"
                py = tarnorm.clean_name(posixpath.normpath("/" + target))
            elif m.isfile():
                return tf.extractfile(m).read(), int(m.mtime)
            else:
                return None
        return None

    def fix(ti: tarfile.TarInfo, read: Callable[[], bytes]):
        name = ti.name
        if drop_litter and is_litter(ti):
            return "drop"
        if ti.type != tarfile.REGTYPE:
            return None
        if Overlay.watch(name):
            seen[name] = read()
        if name in ("etc/shadow", "etc/shadow-"):
            return fix_shadow(read(), epoch)
        if name.endswith(".pyc"):
            py = pyc_source(name)
            if py is None:
                return None
            src_data = source_of(py)
            if src_data is None:
                return None
            return fix_pyc(read(), src_data[0], src_data[1], epoch)
        return None

    result = tarnorm.normalise_tar(src, out, epoch, where=where, fix=fix)
    for e in result.entries:
        overlay.paths.add(e.path)
    for name, m in members.items():
        if name.endswith(".py") and (m.isfile() or m.issym()):
            overlay.sources[name] = (src, m)
    overlay.watched.update(seen)
    return LayerResult(f"sha256:{result.sha256}", result.size, result.entries, result.dropped, result.rewritten)


def sbom_layer(out, epoch: int, sbom: bytes, overlay: Overlay) -> LayerResult:
    """A layer holding only the SBOM (and the directories above it that the image does not have yet)."""
    extra = []
    parts = SBOM_IN_IMAGE.split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i])
        if d not in overlay.paths:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, epoch
            extra.append((ti, b""))
    ti = tarfile.TarInfo(SBOM_IN_IMAGE)
    ti.mode, ti.mtime = 0o644, epoch
    extra.append((ti, sbom))
    empty = io.BytesIO()
    tarfile.open(fileobj=empty, mode="w").close()
    empty.seek(0)
    with tarfile.open(fileobj=empty) as src:
        result = tarnorm.normalise_tar(src, out, epoch, where="sbom layer", extra=extra)
    return LayerResult(f"sha256:{result.sha256}", result.size, result.entries, [], [])


# --- config -----------------------------------------------------------------------------------------------------------

def normalise_config(cfg: dict, diff_ids: list[str], epoch: int, labels: dict[str, str],
                     extra_history: list[dict]) -> dict:
    inner = cfg.get("config") or {}
    config = {k: inner[k] for k in CONFIG_KEYS if inner.get(k) is not None}
    merged = dict(config.get("Labels") or {})
    merged.update(labels)
    if merged:
        config["Labels"] = dict(sorted(merged.items()))
    history = []
    for h in cfg.get("history") or []:
        entry = {"created": iso(epoch), "created_by": h.get("created_by", "")}
        if h.get("comment"):
            entry["comment"] = h["comment"]
        if h.get("empty_layer"):
            entry["empty_layer"] = True
        history.append(entry)
    history += extra_history
    non_empty = sum(1 for h in history if not h.get("empty_layer"))
    if history and non_empty != len(diff_ids):
        raise UserError(f"image config: {non_empty} history entries with layers but {len(diff_ids)} layers",
                        BAD_ARCHIVE)
    out = {"architecture": cfg.get("architecture", "amd64"), "os": cfg.get("os", "linux")}
    if cfg.get("variant"):
        out["variant"] = cfg["variant"]
    out.update({"created": iso(epoch), "config": config, "rootfs": {"type": "layers", "diff_ids": diff_ids},
                "history": history})
    return out


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# --- the archive: OCI layout + docker load manifest, one deterministic tar ---------------------------------------------

def _outer_entry(name: str, size: int, epoch: int, directory: bool = False) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = epoch, 0, 0, "", ""
    if directory:
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
    else:
        ti.size, ti.mode = size, 0o644
    return ti


class _NullWriter:
    def write(self, b):
        return len(b)


def write_archive(out, epoch: int, config: bytes, layers: list[tuple[str, Path]], ref_name: str,
                  annotations: dict[str, str]) -> dict:
    """Write the archive to the binary stream `out`; returns the digests it holds."""
    cfg_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": p.stat().st_size} for d, p in layers],
        "annotations": dict(sorted(annotations.items())),
    }
    manifest_bytes = canonical_json(manifest)
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX,
             "manifests": [{"mediaType": OCI_MANIFEST, "digest": manifest_digest, "size": len(manifest_bytes),
                            "annotations": {"org.opencontainers.image.ref.name": ref_name}}]}
    blob = lambda d: "blobs/sha256/" + d.split(":", 1)[1]  # noqa: E731
    # RepoTags stay empty: the archive does not depend on the tag a build asked for; it is tagged after loading.
    docker_manifest = [{"Config": blob(cfg_digest), "RepoTags": None, "Layers": [blob(d) for d, _ in layers]}]
    files: dict[str, bytes | Path] = {
        "oci-layout": canonical_json({"imageLayoutVersion": "1.0.0"}),
        "index.json": canonical_json(index),
        "manifest.json": canonical_json(docker_manifest),
        blob(cfg_digest): config,
        blob(manifest_digest): manifest_bytes,
    }
    for d, p in layers:
        files.setdefault(blob(d), p)
    h = hashlib.sha256()

    class _Tee(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            out.write(b)
            h.update(b)
            return len(b)

    with tarfile.open(fileobj=_Tee(), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_outer_entry(d, 0, epoch, directory=True))
        for name in sorted(files, key=tarnorm.sort_key):
            data = files[name]
            if isinstance(data, Path):
                with open(data, "rb") as f:
                    tar.addfile(_outer_entry(name, data.stat().st_size, epoch), f)
            else:
                tar.addfile(_outer_entry(name, len(data), epoch), io.BytesIO(data))
    return {"image_id": cfg_digest, "manifest_digest": manifest_digest, "archive_sha256": h.hexdigest()}


# --- the whole image ---------------------------------------------------------------------------------------------------

@dataclass
class ImageResult:
    tag: str
    image_id: str
    source_image_id: str
    manifest_digest: str
    archive_sha256: str
    diff_ids: list[str]
    out_dir: str
    archive: str | None
    sbom_sha256: str | None
    dropped: dict[str, list[str]] = field(default_factory=dict)
    pyc_fixed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def _docker():
    from .dockerutil import docker, docker_bin, image_inspect

    return docker, docker_bin, image_inspect


def default_out_dir(cache: Path, tag: str) -> Path:
    """<cache>/image/<tag>/repro: next to the build's own per-tag work directory."""
    return cache / "image" / re.sub(r"[^A-Za-z0-9_.-]", "_", tag) / "repro"


def source_url(st) -> str | None:
    """Where the image's sources live: stack.toml [stack].source if written there, else git's `origin` remote."""
    url = (st.raw.get("stack") or {}).get("source")
    if isinstance(url, str) and url:
        return url
    try:
        proc = subprocess.run(["git", "-C", str(st.root), "remote", "get-url", "origin"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def git_revision(root: Path) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def oci_labels(st, existing: dict[str, str], stack_id: str | None) -> dict[str, str]:
    """The OCI labels the normalised image carries (added to, or replacing, what the build set)."""
    labels = {"org.opencontainers.image.created": iso(st.source_date_epoch),
              "org.opencontainers.image.version": st.version,
              "org.opencontainers.image.title": existing.get("org.opencontainers.image.title", st.name)}
    rev = existing.get("org.opencontainers.image.revision") or git_revision(st.root)
    if rev:
        labels["org.opencontainers.image.revision"] = rev
    src = existing.get("org.opencontainers.image.source") or source_url(st)
    if src:
        labels["org.opencontainers.image.source"] = src
    if stack_id:
        labels[LABEL_PREFIX + "stack-id"] = stack_id
    labels[LABEL_PREFIX + "sbom"] = "/" + SBOM_IN_IMAGE
    labels[LABEL_PREFIX + "source-date-epoch"] = str(st.source_date_epoch)
    return labels


def normalise_image(st, ref: str, out_dir: Path, *, tag: str | None = None, keep_archive: bool = False,
                    wheels: dict[str, tuple[str, str]] | None = None, with_sbom: bool = True,
                    load: bool = True) -> ImageResult:
    """docker save REF -> normalised layers + SBOM layer + config -> archive -> docker load -> tag.

    `wheels`: canonical name -> (wheel file name, sha256) of the wheels the image was installed from (the SBOM
    names the exact file and hash; without it, each pin is listed with all the hashes the lock allows).
    """
    import time

    docker, docker_bin, image_inspect = _docker()
    epoch = st.source_date_epoch
    tag = tag or ref
    meta = image_inspect(ref)
    if meta is None:
        raise UserError(f"no image {ref!r} to normalise (build it first: scripts/build_image.sh)", BAD_ARCHIVE)
    source_id = meta["Id"]
    previous = _previous(out_dir)
    if previous and source_id in (previous["image_id"], previous["source_image_id"]) \
            and image_inspect(previous["image_id"]) is not None and (not keep_archive or previous.get("archive")):
        # A warm rebuild gave the same docker build output (or REF is our result already): same normalised image.
        if tag != ref or source_id != previous["image_id"]:
            docker(["tag", previous["image_id"], tag], code=BAD_ARCHIVE, what=f"docker tag {tag}")
        say(f"{tag}: {previous['image_id'][:19]} (normalised before from {previous['source_image_id'][:19]})")
        return ImageResult(**{**previous, "tag": tag})
    if LABEL_PREFIX + "sbom" in ((meta.get("Config") or {}).get("Labels") or {}):
        raise UserError(f"{ref} is a normalised image already (it has an SBOM layer) but {out_dir} does not record "
                        "it; normalise the image docker build made", BAD_ARCHIVE)
    out_dir.mkdir(parents=True, exist_ok=True)
    secs: dict[str, float] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".normalise.", dir=out_dir) as tmp_s:
        tmp = Path(tmp_s)
        saved = tmp / "saved.tar"
        say(f"docker save {ref} ({source_id[:19]})")
        docker(["save", "-o", str(saved), ref], code=BAD_ARCHIVE, what=f"docker save {ref}")
        secs["save"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        try:
            outer = tarfile.open(saved)
            dmanifest = json.load(outer.extractfile("manifest.json"))
            if len(dmanifest) != 1:
                raise UserError(f"docker save {ref}: expected one image in the archive, got {len(dmanifest)}",
                                BAD_ARCHIVE)
            cfg = json.load(outer.extractfile(dmanifest[0]["Config"]))
        except (KeyError, ValueError, tarfile.TarError, TypeError) as e:
            raise UserError(f"docker save {ref}: unexpected archive layout ({e})", BAD_ARCHIVE) from None
        overlay = Overlay()
        blobs = tmp / "blobs"
        blobs.mkdir()
        results: list[LayerResult] = []
        paths: list[tuple[str, Path]] = []
        for i, layer_path in enumerate(dmanifest[0]["Layers"]):
            staged = blobs / f"layer-{i}"
            ltar = tarfile.open(fileobj=outer.extractfile(layer_path))
            with open(staged, "wb") as f:
                res = normalise_layer(ltar, f, epoch, overlay, where=f"{ref} layer {i}")
            results.append(res)
            paths.append((res.diff_id, staged))
            if res.dropped:
                say(f"layer {i}: dropped {len(res.dropped)} build-litter file(s), e.g. {', '.join(res.dropped[:3])}")
        labels_before = (cfg.get("config") or {}).get("Labels") or {}
        stack_id = (overlay.watched.get("etc/ucx-dask-gpu/stack-id", b"").decode().split() or [None])[0] \
            or labels_before.get(LABEL_PREFIX + "stack-id")
        labels = oci_labels(st, labels_before, stack_id)
        extra_history = []
        sbom_bytes = None
        if with_sbom:
            from . import sbom as sbommod

            sbom_bytes = sbommod.sbom_from_overlay(st, overlay.watched, labels={**labels_before, **labels},
                                                   wheels=wheels)
            staged = blobs / "layer-sbom"
            with open(staged, "wb") as f:
                res = sbom_layer(f, epoch, sbom_bytes, overlay)
            results.append(res)
            paths.append((res.diff_id, staged))
            extra_history.append({"created": iso(epoch), "created_by": f"ucx-dask-gpu repro normalise: "
                                  f"SBOM (CycloneDX) at /{SBOM_IN_IMAGE}", "comment": "sbom"})
            labels[LABEL_PREFIX + "sbom.sha256"] = hashlib.sha256(sbom_bytes).hexdigest()
        diff_ids = [d for d, _ in paths]
        config = normalise_config(cfg, diff_ids, epoch, labels, extra_history)
        config_bytes = canonical_json(config)
        outer.close()
        saved.unlink()
        secs["normalise"] = round(time.monotonic() - t0, 1)
        annotations = {k: v for k, v in labels.items() if k.startswith("org.opencontainers.image.")}
        annotations[LABEL_PREFIX + "stack-id"] = labels.get(LABEL_PREFIX + "stack-id", "")
        ref_name = st.version
        t0 = time.monotonic()
        image_id = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        # An image with this id exists already (another build gave the same bytes): docker has every layer, so
        # the archive is only hashed (for its digest), not written, and nothing is loaded.
        present = load and image_inspect(image_id) is not None
        archive_tmp = tmp / ARCHIVE
        if keep_archive or (load and not present):
            with open(archive_tmp, "wb") as f:
                digests = write_archive(f, epoch, config_bytes, paths, ref_name, annotations)
        else:
            digests = write_archive(_NullWriter(), epoch, config_bytes, paths, ref_name, annotations)
        shutil.rmtree(blobs)
        secs["archive"] = round(time.monotonic() - t0, 1)
        if load and not present:
            t0 = time.monotonic()
            say(f"docker load {digests['image_id'][:19]} ({archive_tmp.stat().st_size / 1e9:.2f} GB)")
            docker(["load", "-q", "-i", str(archive_tmp)], code=BAD_ARCHIVE, what="docker load of the normalised image")
            secs["load"] = round(time.monotonic() - t0, 1)
        if load:
            loaded = image_inspect(digests["image_id"])
            if loaded is None or loaded.get("Id") != digests["image_id"]:
                raise UserError(f"docker load did not give image {digests['image_id']} (docker computed "
                                f"{(loaded or {}).get('Id')})", BAD_ARCHIVE)
            if present:
                say(f"{digests['image_id'][:19]} is in Docker already (same bytes as an earlier build): not loaded")
            docker(["tag", digests["image_id"], tag], code=BAD_ARCHIVE, what=f"docker tag {tag}")
        archive_path = None
        if keep_archive:
            archive_path = out_dir / ARCHIVE
            os.replace(archive_tmp, archive_path)
        files = {
            LAYERS_JSON: json.dumps({"config": config, "layers": [
                {"diff_id": r.diff_id, "size": r.size, "dropped": r.dropped, "rewritten": r.rewritten,
                 "entries": [e.as_list() for e in r.entries]} for r in results]}, separators=(",", ":")) + "\n",
        }
        if sbom_bytes is not None:
            files[SBOM_JSON] = sbom_bytes.decode()
        result = ImageResult(tag=tag, image_id=digests["image_id"], source_image_id=source_id,
                             manifest_digest=digests["manifest_digest"], archive_sha256=digests["archive_sha256"],
                             diff_ids=diff_ids, out_dir=str(out_dir), archive=str(archive_path) if archive_path else None,
                             sbom_sha256=hashlib.sha256(sbom_bytes).hexdigest() if sbom_bytes else None,
                             dropped={str(i): r.dropped for i, r in enumerate(results) if r.dropped},
                             pyc_fixed=sum(1 for r in results for p in r.rewritten if p.endswith(".pyc")),
                             seconds=secs)
        files[IMAGE_JSON] = json.dumps(result.__dict__, indent=2, sort_keys=True) + "\n"
        for name, text in files.items():
            atomic_write_text(out_dir / name, text)
    return result


def _previous(out_dir: Path) -> dict | None:
    try:
        data = json.loads((out_dir / IMAGE_JSON).read_text())
    except (OSError, ValueError):
        return None
    fields = set(ImageResult.__dataclass_fields__)
    return data if isinstance(data, dict) and fields <= set(data) else None


def build_wheels(st, cache: Path) -> dict[str, tuple[str, str]]:
    """The wheels an image build installs from: the verified wheelhouse of the lock, our UCXX wheels and our own
    wheel."""
    from .imagecmd import default_ucxx_wheels
    from .wheelhouse import wheelhouse_dir

    dirs = [d for d in (wheelhouse_dir(cache, st.lock_path()), default_ucxx_wheels(), cache / "pkg") if d.is_dir()]
    return wheels_from(dirs)


def finish_build(st, tag: str, cache: Path, extra_wheels: list[Path] = (), keep_archive: bool = False) -> ImageResult:
    """THE HOOK for the image build: call it right after `docker build` produced `tag` (and the stack id check).

    Normalises `tag` in place (the tag then names the reproducible image with its SBOM) and writes image.json,
    layers.json and sbom.cdx.json to <cache>/image/<tag>/repro. A warm rebuild that gives the same docker build
    output costs one `docker image inspect`.
    """
    wheels = build_wheels(st, cache)
    if extra_wheels:
        wheels.update(wheels_from([Path(w) for w in extra_wheels]))
    return normalise_image(st, tag, default_out_dir(cache, tag), tag=tag, wheels=wheels, keep_archive=keep_archive)


# --- two clean builds ------------------------------------------------------------------------------------------------------

def clean_bases(st) -> None:
    """Untag the Debian base images, so the next build bootstraps them again: new base image ids, hence no
    Docker build cache either. Images built on the old bases keep them (untagging deletes nothing they use)."""
    from .baseimage import KINDS, image_tag

    docker, _, image_inspect = _docker()
    for kind in KINDS:
        tag = image_tag(st, kind)
        if image_inspect(tag) is not None:
            docker(["rmi", tag], code=BAD_ARCHIVE, what=f"docker rmi {tag}")


def clean_build(st, cache: Path, tag: str) -> tuple[ImageResult, float]:
    """Bootstrap the bases again and build `tag` with nothing cached but the verified downloads; normalise it."""
    import time

    from .imagebuild import build_image
    from .imagecmd import default_ucxx_wheels

    t0 = time.monotonic()
    clean_bases(st)
    say(f"clean build of {tag}: bases bootstrapped again, no Docker build cache")
    build_image(st, cache, default_ucxx_wheels(), tag=tag)
    result = finish_build(st, tag, cache)
    return result, round(time.monotonic() - t0, 1)


def check(st, cache: Path, first: str | None = None, limit: int = 10) -> dict:
    """Two clean builds (or `first`, an image built already, and one clean build), then `compare`."""
    outs, timings = [], {}
    if first:
        res = finish_build(st, first, cache)
        outs.append(res)
        timings[first] = None
    for name in ("repro-a", "repro-b")[len(outs):]:
        tag = f"{st.image.name}:{name}"
        res, secs = clean_build(st, cache, tag)
        outs.append(res)
        timings[tag] = secs
    report = compare(Path(outs[0].out_dir), Path(outs[1].out_dir), limit=limit)
    report["builds"] = [{"tag": r.tag, "image_id": r.image_id, "docker_build_id": r.source_image_id,
                         "seconds": timings[r.tag], "normalise_seconds": r.seconds} for r in outs]
    return report


# --- root filesystem tarballs (debootstrap) ------------------------------------------------------------------------------

def normalise_rootfs_tar(src: Path, dest: Path, epoch: int) -> LayerResult:
    """The normal form of a root filesystem tar, with the same fixes as an image layer (litter, shadow days, .pyc
    headers); `dest` is written whole or not at all."""
    try:
        tf = tarfile.open(src)
    except (tarfile.TarError, OSError) as e:
        raise UserError(f"{src}: not a readable tar archive: {e}", BAD_ARCHIVE) from None
    with tf, atomic_path(dest) as tmp, open(tmp, "wb") as out:
        return normalise_layer(tf, out, epoch, Overlay(), where=str(src))


# --- comparing two builds --------------------------------------------------------------------------------------------------

FIELDS = ("type", "mode", "owner", "mtime", "size", "content", "xattrs")


def _load_dir(d: Path) -> tuple[dict, dict]:
    try:
        image = json.loads((d / IMAGE_JSON).read_text())
        layers = json.loads((d / LAYERS_JSON).read_text())
    except OSError as e:
        raise UserError(f"{d}: not a normalised build output ({e.filename}: {e.strerror})", USAGE) from None
    except ValueError as e:
        raise UserError(f"{d}: unreadable {IMAGE_JSON}/{LAYERS_JSON} ({e})", BAD_ARCHIVE) from None
    return image, layers


def _flatten(obj, prefix="") -> dict[str, str]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    if isinstance(obj, list) and prefix.endswith(("history", "diff_ids")):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: json.dumps(obj, sort_keys=True)}


def diff_layers(a: list, b: list, limit: int = 10) -> dict:
    """First differing paths between two layer listings (lists of Entry.as_list())."""
    ma = {e[0]: e for e in a}
    mb = {e[0]: e for e in b}
    out = {"only_a": [], "only_b": [], "differ": []}
    for p in sorted(set(ma) | set(mb), key=tarnorm.sort_key):
        if p not in mb:
            out["only_a"].append(p)
        elif p not in ma:
            out["only_b"].append(p)
        elif ma[p] != mb[p]:
            fields = [f for f, x, y in zip(FIELDS, ma[p][1:], mb[p][1:]) if x != y]
            out["differ"].append({"path": p, "fields": fields, "a": ma[p][1:], "b": mb[p][1:]})
    return {k: v[:limit] for k, v in out.items()} | {f"n_{k}": len(v) for k, v in out.items()}


def compare(a_dir: Path, b_dir: Path, limit: int = 10) -> dict:
    ia, la = _load_dir(a_dir)
    ib, lb = _load_dir(b_dir)
    report = {"a": {"dir": str(a_dir), "image_id": ia["image_id"], "archive_sha256": ia["archive_sha256"]},
              "b": {"dir": str(b_dir), "image_id": ib["image_id"], "archive_sha256": ib["archive_sha256"]},
              "identical": ia["image_id"] == ib["image_id"] and ia["archive_sha256"] == ib["archive_sha256"],
              "config": [], "layers": []}
    fa, fb = _flatten(la["config"]), _flatten(lb["config"])
    report["config"] = [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb))
                        if fa.get(k) != fb.get(k) and not k.startswith("rootfs.diff_ids")]
    for i in range(max(len(la["layers"]), len(lb["layers"]))):
        x = la["layers"][i] if i < len(la["layers"]) else None
        y = lb["layers"][i] if i < len(lb["layers"]) else None
        if x and y and x["diff_id"] == y["diff_id"]:
            continue
        entry = {"layer": i, "a": x and x["diff_id"], "b": y and y["diff_id"]}
        if x and y:
            entry.update(diff_layers(x["entries"], y["entries"], limit))
        report["layers"].append(entry)
    return report


def render_compare(r: dict) -> str:
    lines = [f"A {r['a']['image_id']}  archive sha256 {r['a']['archive_sha256']}  ({r['a']['dir']})",
             f"B {r['b']['image_id']}  archive sha256 {r['b']['archive_sha256']}  ({r['b']['dir']})"]
    if r["identical"]:
        lines.append("identical: same image id, same archive bytes")
        return "\n".join(lines)
    for c in r["config"]:
        lines.append(f"config {c['key']}: {c['a']} != {c['b']}")
    for layer in r["layers"]:
        lines.append(f"layer {layer['layer']}: {layer['a']} != {layer['b']}")
        if "differ" not in layer:
            continue
        lines.append(f"  {layer['n_differ']} differing, {layer['n_only_a']} only in A, {layer['n_only_b']} only in B")
        for d in layer["differ"]:
            detail = "; ".join(f"{f}: {x} != {y}" for f, x, y in zip(FIELDS, d["a"], d["b"]) if x != y)
            lines.append(f"  differs {d['path']}  ({detail})")
        lines += [f"  only A  {p}" for p in layer["only_a"]] + [f"  only B  {p}" for p in layer["only_b"]]
    return "\n".join(lines)


# --- CLI ------------------------------------------------------------------------------------------------------------------

def wheels_from(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """canonical name -> (file, sha256) from wheel files and wheelhouse directories (their wheelhouse.json)."""
    from .lockfile import canonical

    found: dict[str, tuple[str, str]] = {}
    for p in paths:
        if p.is_dir():
            manifest = p / "wheelhouse.json"
            files = json.loads(manifest.read_text())["files"] if manifest.is_file() else \
                {w.name: sha256_file(w) for w in sorted(p.glob("*.whl"))}
        elif p.is_file() and p.name.endswith(".whl"):
            files = {p.name: sha256_file(p)}
        else:
            raise UserError(f"--wheels {p}: not a wheel or a directory of wheels", USAGE)
        for fname, sha in files.items():
            found[canonical(fname.split("-", 1)[0])] = (fname, sha)
    return found


def _cmd_normalise(args) -> int:
    from .imagecmd import default_cache
    from .stack import load

    st = load(args.stack_file)
    tag = args.tag or args.image
    out = Path(args.out) if args.out else default_out_dir(default_cache(), tag)
    wheels = build_wheels(st, default_cache())
    wheels.update(wheels_from([Path(w) for w in args.wheels]))
    r = normalise_image(st, args.image, out, tag=tag, keep_archive=args.keep_archive, wheels=wheels,
                        with_sbom=not args.no_sbom, load=not args.no_load)
    print(f"image     {r.tag}")
    print(f"id        {r.image_id}   (was {r.source_image_id})")
    print(f"archive   sha256:{r.archive_sha256}" + (f"  {r.archive}" if r.archive else ""))
    print(f"manifest  {r.manifest_digest}")
    print(f"output    {r.out_dir}")
    return 0


def _cmd_rootfs(args) -> int:
    from .stack import load

    st = load(args.stack_file)
    res = normalise_rootfs_tar(Path(args.src), Path(args.dest), st.source_date_epoch)
    print(f"{args.dest}: {res.diff_id} ({len(res.entries)} entries, {len(res.dropped)} dropped, "
          f"{len(res.rewritten)} rewritten)")
    return 0


def _report_compare(r: dict, json_path: str | None) -> int:
    """Print the comparison, write it as JSON when asked, and fail (exit 30) unless the two builds are identical."""
    print(render_compare(r))
    if json_path:
        atomic_write_text(json_path, json.dumps(r, indent=2, sort_keys=True) + "\n")
    if not r["identical"]:
        raise UserError(f"not reproducible: {r['a']['image_id']} != {r['b']['image_id']} (first differences above)",
                        NOT_REPRODUCIBLE)
    return 0


def _cmd_check(args) -> int:
    from .imagecmd import default_cache
    from .stack import load

    st = load(args.stack_file)
    r = check(st, Path(args.cache) if args.cache else default_cache(), first=args.first, limit=args.limit)
    for b in r["builds"]:
        took = f"clean build + normalise {b['seconds']:.0f} s" if b["seconds"] is not None else "built before"
        print(f"{b['tag']}: {b['image_id']}  (docker build gave {b['docker_build_id'][:19]}; {took})")
    return _report_compare(r, args.json)


def _cmd_compare(args) -> int:
    r = compare(Path(args.a), Path(args.b), limit=args.limit)
    return _report_compare(r, args.json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repro", help="reproducible image: normalise a built image, compare two builds")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="repro_command", metavar="ACTION", required=True)
    n = s.add_parser("normalise", help="docker save IMAGE, normalise layers + config, add the SBOM, docker load")
    n.add_argument("image")
    n.add_argument("--tag", help="tag the normalised image (default: IMAGE)")
    n.add_argument("--out", help="output directory (default: <build cache>/image/out/<tag>)")
    n.add_argument("--wheels", action="append", default=[], metavar="PATH",
                   help="wheels / wheelhouse directories the image was installed from (exact hashes in the SBOM)")
    n.add_argument("--keep-archive", action="store_true", help=f"keep the OCI/docker archive as OUT/{ARCHIVE}")
    n.add_argument("--no-sbom", action="store_true", help="do not add the SBOM layer")
    n.add_argument("--no-load", action="store_true", help="do not docker load the result")
    n.set_defaults(func=_cmd_normalise)
    r = s.add_parser("rootfs", help="normalise a root filesystem tar (debootstrap): order, mtimes, owners, litter, "
                                    ".pyc headers, shadow dates")
    r.add_argument("src")
    r.add_argument("dest")
    r.set_defaults(func=_cmd_rootfs)
    k = s.add_parser("check", help="two clean builds (bases bootstrapped again, no Docker cache), same image id?")
    k.add_argument("--first", metavar="TAG", help="use this built image as the first build (e.g. the one the test "
                                                   "suite built); only one clean build then")
    k.add_argument("--cache", help="build cache directory (default: as `image build`)")
    k.add_argument("--limit", type=int, default=10, help="differences listed per layer and kind")
    k.add_argument("--json", help="also write the report as JSON")
    k.set_defaults(func=_cmd_check)
    c = s.add_parser("compare", help="compare two normalised build outputs; name the first differing files")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--limit", type=int, default=10, help="differences listed per layer and kind")
    c.add_argument("--json", help="also write the comparison as JSON")
    c.set_defaults(func=_cmd_compare)

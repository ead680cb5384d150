"""The image config and the archive of a normalised image, both deterministic.

The config is rebuilt from an allow-list: `created` and every history entry at SOURCE_DATE_EPOCH, no build
container, hostname, parent image or engine version. The archive is ONE tar that is both an OCI image layout
(oci-layout, index.json, blobs/sha256/...) and a `docker load` archive (manifest.json pointing at the same blobs).
Pure: bytes and files in, bytes out; no Docker.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BAD_ARCHIVE, UserError
from . import tarnorm

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
# Every label (and manifest annotation) of ours lives under this prefix; OCI's own keys are org.opencontainers.image.*.
LABEL_PREFIX = "io.ucx-dask-gpu."
# Container config keys an image config keeps (OCI image-spec config + Docker's Healthcheck/OnBuild/Shell).
# Everything else (Hostname, Domainname, Image = the parent's id, Attach*, Tty, ...) is build-host state.
CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir", "Labels", "StopSignal",
               "ArgsEscaped", "Healthcheck", "OnBuild", "Shell")


def iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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


class NullWriter:
    """A stream that only counts: write_archive into it computes the digests without writing the archive."""

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
    tee = tarnorm.HashingWriter(out)
    with tarfile.open(fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_outer_entry(d, 0, epoch, directory=True))
        for name in sorted(files, key=tarnorm.sort_key):
            data = files[name]
            if isinstance(data, Path):
                with open(data, "rb") as f:
                    tar.addfile(_outer_entry(name, data.stat().st_size, epoch), f)
            else:
                tar.addfile(_outer_entry(name, len(data), epoch), io.BytesIO(data))
    return {"image_id": cfg_digest, "manifest_digest": manifest_digest, "archive_sha256": tee.h.hexdigest()}

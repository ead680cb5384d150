"""The labels the image carries: OCI's own (title, version, created, revision, source) and ours (stack id, UCX build
info, pinned versions), set by `docker build` and kept, with the SBOM's, by the normalisation."""
from __future__ import annotations

import subprocess
from pathlib import Path

from ..fsutil import sha256_file
from ..oci.archive import LABEL_PREFIX, iso
from ..oci.sbom import SBOM_IN_IMAGE
from ..stack import Stack
from ..stack.lock import load_lock

# Packages whose versions are worth a label of their own (all of them are in the lock and the image's SBOM).
LABELLED_PACKAGES = ("dask", "distributed", "dask-cuda", "rmm-cu13", "numpy", "cupy-cuda13x")


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def git_revision(root: Path) -> str | None:
    """The checkout's HEAD commit (None outside a git checkout)."""
    return _git(root, "rev-parse", "HEAD")


def source_url(st: Stack) -> str | None:
    """Where the image's sources live: stack.toml [stack].source if written there, else git's `origin` remote."""
    return st.source or _git(st.root, "remote", "get-url", "origin")


def build_labels(st: Stack, stack_id: str, info: dict, ucxx_info: dict, base: str,
                 extra_wheels: list[Path]) -> dict[str, str]:
    """What `docker build --label` sets: versions, the stack id, the UCX and UCXX build info."""
    pins = load_lock(st.lock_path())
    src = info.get("source") or {}
    labels = {
        "org.opencontainers.image.title": st.name,
        "org.opencontainers.image.description": "One image for the Dask client, scheduler and workers over UCX",
        "org.opencontainers.image.version": st.version,
        "org.opencontainers.image.created": iso(st.source_date_epoch),
        "org.opencontainers.image.revision": git_revision(st.root) or "unknown",
        "org.opencontainers.image.base.name": base,
        LABEL_PREFIX + "stack-id": stack_id,
        LABEL_PREFIX + "stack-toml.sha256": sha256_file(st.path),
        LABEL_PREFIX + "python.lock.sha256": sha256_file(st.lock_path()),
        LABEL_PREFIX + "python.version": st.python.version,
        LABEL_PREFIX + "debian.suite": st.debian.suite,
        LABEL_PREFIX + "cuda.major": str(st.cuda_major),
        LABEL_PREFIX + "ucx.version": str(info.get("ucx_version", "unknown")),
        LABEL_PREFIX + "ucx.prefix": st.image.ucx_prefix,
        LABEL_PREFIX + "ucx.source": f"{src.get('tag', 'unknown')} {src.get('commit', '')}".strip(),
        LABEL_PREFIX + "ucx.content-tree": str(src.get("content_tree", "unknown")),
        LABEL_PREFIX + "ucx.patches": " ".join(p["name"] for p in info.get("patches") or []),
        LABEL_PREFIX + "ucx.modules": " ".join(info.get("modules") or []),
        LABEL_PREFIX + "ucx.build-info.sha256": str(info.get("_sha256", "")),
        LABEL_PREFIX + "ucxx.version": str(ucxx_info.get("ucxx_version", "unknown")),
        LABEL_PREFIX + "ucxx.source": " ".join(filter(None, ((ucxx_info.get("sources") or {}).get("UCXX", {})
                                                           .get(k) for k in ("tag", "commit")))),
        LABEL_PREFIX + "ucxx.wheels": " ".join(f"{p['wheel']}@sha256:{p['sha256']}"
                                                for p in ucxx_info.get("packages") or []),
    }
    for name in LABELLED_PACKAGES:
        if name in pins:
            labels[LABEL_PREFIX + f"version.{name}"] = pins[name].version
    if extra_wheels:
        labels[LABEL_PREFIX + "extra"] = " ".join(sorted(w.name for w in extra_wheels))
    return labels


def oci_labels(st: Stack, existing: dict[str, str], stack_id: str | None) -> dict[str, str]:
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

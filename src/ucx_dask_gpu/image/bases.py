"""Base images built from Debian packages, for machines that can reach a Debian mirror but no container registry.

`debootstrap --variant=minbase` of stack.toml [debian], scrubbed of host- and time-dependent files, tarred
deterministically in the normal form of an image layer (oci/layer.py) and `docker import`ed. Two bases from the same
mirror at the same time, so they carry the same python3 build: runtime (what the image runs on) and builder (where
UCX is compiled and the venv created, during a `docker build --network none`).

An imported base is labelled with a key (hash of everything that went into it); an existing image with the same
key is reused, so a warm rebuild neither bootstraps again nor changes the base's image id (which would invalidate
every cached layer above it).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..cliutil import Progress
from ..errors import BUILD_FAILED, SOURCE_UNREACHABLE, USAGE, UserError
from ..fsutil import atomic_path
from ..oci.archive import LABEL_PREFIX
from ..oci.layer import normalise_rootfs_tar
from ..stack import Stack
from ..ucxbuild.repro import fixed_umask
from .docker import docker, labels_of
from .paths import base_ref

KINDS = ("runtime", "builder")
KEY_LABEL = LABEL_PREFIX + "base.key"
# Bump when the rootfs recipe below changes in a way the key would not otherwise see.
RECIPE = 2   # 2: SOURCE_DATE_EPOCH for debootstrap's tools; rootfs tar in the normal form of an image layer

# Removed from the root filesystem before it is tarred: host copies debootstrap takes along (Docker provides its
# own /etc/hosts, resolv.conf, hostname at run time), apt/dpkg caches and logs, and files whose content is the
# time of the build. Paths are relative to the root; a trailing /* empties a directory but keeps it.
SCRUB = [
    "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/machine-id",
    "var/lib/apt/lists/*", "var/cache/apt/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
    "var/cache/ldconfig/aux-cache", "var/log/*", "tmp/*", "var/tmp/*", "dev/*", "proc/*", "sys/*",
    # Documentation, manuals and translations: the image runs services, nobody reads man pages in it.
    # Copyright files stay (usr/share/doc/*/copyright); a trailing / removes directories only (locale.alias stays).
    "usr/share/man/*", "usr/share/info/*", "usr/share/lintian/*", "usr/share/locale/*/",
]


def packages_for(st: Stack, kind: str) -> list[str]:
    if kind == "runtime":
        pkgs = list(st.debian.base_packages)
    elif kind == "builder":
        pkgs = [*st.debian.base_packages, *st.debian.ucx_build_packages, *st.debian.builder_packages]
    else:
        raise UserError(f"unknown base kind {kind!r} (expected {' or '.join(KINDS)})", USAGE)
    return sorted(set(pkgs))


def base_key(st: Stack, kind: str) -> str:
    spec = {"recipe": RECIPE, "kind": kind, "suite": st.debian.suite, "mirror": st.debian.mirror,
            "packages": packages_for(st, kind), "epoch": st.source_date_epoch, "scrub": SCRUB}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


say = Progress("base: ")


def _run(cmd: list[str], what: str, code: int = BUILD_FAILED, log: Path | None = None,
         env: dict | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        # debootstrap's own failures start with "E:"; the last of them names the cause.
        errs = [ln for ln in lines if ln.startswith("E:")] or lines[-1:] or ["(no output)"]
        raise UserError(f"{what}: {errs[-1].strip()}" + (f" (log: {log})" if log else ""), code)


def mounts_below(root: Path) -> list[str]:
    root_s = str(root.resolve())
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            point = line.split()[1].encode().decode("unicode_escape")
            if point == root_s or point.startswith(root_s + "/"):
                found.append(point)
    return found


def unmount_below(root: Path) -> None:
    """debootstrap can leave the target's /proc (or /sys) mounted; scrubbing through a mount would be a disaster."""
    for point in sorted(mounts_below(root), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)
    left = mounts_below(root)
    if left:
        raise UserError(f"cannot unmount {left[0]} (left mounted by debootstrap)", BUILD_FAILED)


def scrub(root: Path) -> None:
    for pattern in SCRUB:
        dirs_only = pattern.endswith("/")
        for path in root.glob(pattern.rstrip("/")):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif not dirs_only and (path.exists() or path.is_symlink()):
                path.unlink()
    for d in ("tmp", "var/tmp"):
        (root / d).mkdir(exist_ok=True)
        (root / d).chmod(0o1777)


def deterministic_tar(root: Path, out: Path, epoch: int) -> None:
    """GNU tar of `root`: sorted names, mtimes clamped to `epoch`, numeric owners, no atime/ctime, pax format."""
    _run(["tar", "--sort=name", f"--mtime=@{epoch}", "--clamp-mtime", "--numeric-owner", "--format=pax",
          "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime", "--xattrs",
          "-C", str(root), "-cf", str(out), "."], "tar of the base root filesystem")


def build_rootfs_tar(st: Stack, kind: str, out: Path, cache: Path) -> Path:
    """debootstrap + scrub + deterministic tar into `out` (written atomically)."""
    if not shutil.which("debootstrap"):
        raise UserError("debootstrap is not installed (apt-get install debootstrap)", USAGE)
    debs = (cache / "debootstrap").resolve()
    debs.mkdir(parents=True, exist_ok=True)
    pkgs = packages_for(st, kind)
    with tempfile.TemporaryDirectory(prefix=f"rootfs-{kind}.", dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        log = out.parent / f"debootstrap-{kind}.log"
        say(f"debootstrap {st.debian.suite} ({kind}: {len(pkgs)} packages) from {st.debian.mirror}")
        start = time.monotonic()
        try:
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(pkgs)}", f"--cache-dir={debs}",
                  st.debian.suite, str(root), st.debian.mirror], f"debootstrap {st.debian.suite} ({kind})",
                 SOURCE_UNREACHABLE, log=log,
                 # pwconv/useradd in maintainer scripts date /etc/shadow by it, not by today
                 env={**os.environ, "SOURCE_DATE_EPOCH": str(st.source_date_epoch)})
        finally:
            unmount_below(root)
        say(f"debootstrap {kind} done in {time.monotonic() - start:.0f} s")
        scrub(root)
        with atomic_path(out) as tar:
            raw = Path(tmp) / "raw.tar"
            deterministic_tar(root, raw, st.source_date_epoch)
            # The normal form of an image layer: Debian's timestamp .pyc files whose sources the mtime clamp made
            # newer than their .pyc become checked-hash .pyc files, shadow days are clamped, litter dropped.
            normalise_rootfs_tar(raw, tar, st.source_date_epoch)
            raw.unlink()
    return out


def ensure_base(st: Stack, kind: str, cache: Path, force: bool = False) -> str:
    """The base image tag for `kind`, bootstrapped and imported unless an image with the same key exists."""
    tag, key = base_ref(st, kind), base_key(st, kind)
    if not force and labels_of(tag).get(KEY_LABEL) == key:
        say(f"{tag}: up to date (key {key})")
        return tag
    work = cache / "rootfs"
    work.mkdir(parents=True, exist_ok=True)
    with fixed_umask():   # debootstrap creates files and directories with the caller's umask; the tar keeps modes
        tar = build_rootfs_tar(st, kind, work / f"{kind}-{key}.tar", cache)
    changes = [f"LABEL {KEY_LABEL}={key}",
               f"LABEL {LABEL_PREFIX}base.kind={kind}",
               f"LABEL {LABEL_PREFIX}base.suite={st.debian.suite}",
               "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "ENV LANG=C.UTF-8",
               'CMD ["/bin/bash"]']
    args = ["import"]
    for c in changes:
        args += ["--change", c]
    docker([*args, str(tar), tag], code=BUILD_FAILED, what=f"docker import {tag}", timeout=600)
    tar.unlink()
    say(f"{tag}: imported (key {key})")
    return tag


def base_from_image(st: Stack, kind: str, debian_image: str) -> str:
    """The base for `kind` built from a registry's Debian image (docker/base-from-registry.Dockerfile, with apt). Tagged
    apart from the debootstrapped bases (`…-from-registry`), so neither replaces the other."""
    tag = base_ref(st, kind) + "-from-registry"
    dockerfile = st.root / "docker" / "base-from-registry.Dockerfile"
    with tempfile.TemporaryDirectory(prefix="base-ctx.") as ctx:
        shutil.copyfile(dockerfile, Path(ctx) / "Dockerfile")
        say(f"{tag}: from {debian_image} + {len(packages_for(st, kind))} packages (apt, with network)")
        docker(["build", "-t", tag, "--build-arg", f"DEBIAN_IMAGE={debian_image}",
                "--build-arg", f"PACKAGES={' '.join(packages_for(st, kind))}",
                "--label", f"{LABEL_PREFIX}base.kind={kind}", "--label", f"{LABEL_PREFIX}base.from={debian_image}",
                "--label", f"{KEY_LABEL}=from-registry",
                ctx], code=BUILD_FAILED, what=f"building {tag} from {debian_image}", timeout=1800,
               env={"DOCKER_BUILDKIT": "0"})
    return tag

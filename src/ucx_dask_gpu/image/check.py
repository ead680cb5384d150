"""Is the image reproducible? Two clean builds (Debian bases bootstrapped again, no Docker build cache; only the
verified downloads are reused), each normalised, must give the same image id and the same archive bytes."""
from __future__ import annotations

import time
from pathlib import Path

from ..errors import BAD_ARCHIVE
from ..oci.compare import compare
from ..stack import Stack
from .bases import KINDS
from .build import build_image
from .docker import docker, image_inspect
from .normalise import ImageResult, finish_build, say
from .paths import base_ref, default_ucxx_wheels


def clean_bases(st: Stack) -> None:
    """Untag the Debian base images, so the next build bootstraps them again: new base image ids, hence no
    Docker build cache either. Images built on the old bases keep them (untagging deletes nothing they use)."""
    for kind in KINDS:
        tag = base_ref(st, kind)
        if image_inspect(tag) is not None:
            docker(["rmi", tag], code=BAD_ARCHIVE, what=f"docker rmi {tag}")


def clean_build(st: Stack, cache: Path, tag: str) -> tuple[ImageResult, float]:
    """Bootstrap the bases again and build `tag` with nothing cached but the verified downloads; normalise it."""
    t0 = time.monotonic()
    clean_bases(st)
    say(f"clean build of {tag}: bases bootstrapped again, no Docker build cache")
    build_image(st, cache, default_ucxx_wheels(), tag=tag)
    result = finish_build(st, tag, cache)
    return result, round(time.monotonic() - t0, 1)


def check(st: Stack, cache: Path, first: str | None = None, limit: int = 10) -> dict:
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

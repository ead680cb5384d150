"""The images our builds leave behind, and removing them (docs/image.md, "Leftovers"): each build records the images
it made or reused; after a successful build, those the previous build of the tag recorded and this one no longer uses
go with `docker rmi`, never forced (an image still tagged, used by a container or the parent of another stays).
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from ..fsutil import atomic_write_text, read_json
from .docker import docker_bin

RECORD = "images.json"
_STEP_ID = re.compile(r"^ ---> ([0-9a-f]{12,64})\s*$|^Successfully built ([0-9a-f]{12,64})\s*$")


def step_ids(log: str) -> list[str]:
    """The image ids a classic `docker build` log names: one per step (" ---> id") and the result."""
    out = []
    for line in log.splitlines():
        m = _STEP_ID.match(line)
        if m:
            out.append(m.group(1) or m.group(2))
    return list(dict.fromkeys(out))


def _short(image_id: str) -> str:
    return image_id.split(":", 1)[-1][:12]


def read_record(work: Path) -> dict:
    return read_json(work / RECORD, {"tags": [], "images": []})


def remove(ids: list[str]) -> int:
    """`docker rmi` each id that is still there (one call each: one refusal must not stop the rest)."""
    removed = 0
    for i in ids:
        proc = subprocess.run([docker_bin(), "rmi", i], capture_output=True, text=True)
        removed += proc.returncode == 0
    return removed


def record_and_prune(work: Path, tags: list[str], ids: list[str]) -> int:
    """Record this build's images; remove the previous build's that this one no longer uses. Returns the count."""
    ids = list(dict.fromkeys(_short(i) for i in ids if i))
    previous = read_record(work)
    atomic_write_text(work / RECORD, json.dumps({"tags": tags, "images": ids}, indent=2) + "\n")
    superseded = [i for i in previous.get("images", []) if i not in set(ids)]
    # The last step first: removing an untagged image takes its untagged parents that nothing else uses with it.
    return remove(list(reversed(superseded))) if superseded else 0


def clean(cache: Path) -> tuple[int, list[str]]:
    """Remove the tags and images every recorded build in `cache` made; (images removed, tags removed)."""
    removed, tags = 0, []
    for rec in sorted((cache / "image").glob(f"*/{RECORD}")):
        data = read_record(rec.parent)
        tags += [tag for tag in data.get("tags", []) if remove([tag])]
        # The last step first: an image goes only once the images made on top of it are gone.
        removed += remove(list(reversed(data.get("images", []))))
        rec.unlink()
    return removed, tags

"""Reproducible image: the same inputs give the same image id, byte for byte, on any build machine. Docker 20.10's
classic builder writes build times into layers, config and .pyc headers, so the image is made deterministic after
`docker build` (docs/reproducibility.md says how): its layers by oci/layer.py, the SBOM layer by oci/sbom.py, the
config and archive by oci/archive.py; image.json and layers.json beside it are what `compare` reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cliutil import Progress
from ..errors import BAD_ARCHIVE, USAGE, UserError
from ..fsutil import read_json, sha256_file, write_output_dir
from ..oci import sbom as sbommod
from ..oci.archive import LABEL_PREFIX, NullWriter, canonical_json, iso, normalise_config, write_archive
from ..oci.compare import IMAGE_JSON, LAYERS_JSON
from ..oci.layer import LayerResult, Overlay, STACK_ID_IN_LAYER, normalise_layer, sbom_layer
from ..oci.sbom import SBOM_IN_IMAGE
from ..stack import Stack
from ..stack.lock import canonical
from .docker import docker, image_inspect
from .labels import oci_labels
from .paths import default_ucxx_wheels, work_dir
from .wheelhouse import MANIFEST, wheelhouse_dir

SBOM_JSON = "sbom.cdx.json"
ARCHIVE = "image.tar"


say = Progress("repro: ")


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


class Timings(dict):
    """step name -> seconds it took (a build's and a normalisation's record)."""

    def step(self, name: str, fn, *a, **kw):
        t0 = time.monotonic()
        value = fn(*a, **kw)
        self[name] = round(time.monotonic() - t0, 1)
        return value


def default_out_dir(cache: Path, tag: str) -> Path:
    """<cache>/image/<tag>/repro: next to the build's own per-tag work directory."""
    return work_dir(cache, tag) / "repro"


def normalise_image(st: Stack, ref: str, out_dir: Path, *, tag: str | None = None, keep_archive: bool = False,
                    wheels: dict[str, tuple[str, str]] | None = None, with_sbom: bool = True,
                    load: bool = True) -> ImageResult:
    """docker save REF -> normalised layers + SBOM layer + config -> archive -> docker load -> tag. `wheels`: canonical
    name -> (wheel file name, sha256) of the wheels the image was installed from (the SBOM names the exact file and
    hash; without it, each pin is listed with all the hashes the lock allows)."""
    tag = tag or ref
    meta = image_inspect(ref)
    if meta is None:
        raise UserError(f"no image {ref!r} to normalise (build it first: scripts/build_image.sh)", BAD_ARCHIVE)
    source_id = meta["Id"]
    reused = _reuse_previous(ref, tag, source_id, out_dir, keep_archive)
    if reused is not None:
        return reused
    if LABEL_PREFIX + "sbom" in ((meta.get("Config") or {}).get("Labels") or {}):
        raise UserError(f"{ref} is a normalised image already (it has an SBOM layer) but {out_dir} does not record "
                        "it; normalise the image docker build made", BAD_ARCHIVE)
    out_dir.mkdir(parents=True, exist_ok=True)
    secs = Timings()
    with tempfile.TemporaryDirectory(prefix=".normalise.", dir=out_dir) as tmp_s:
        tmp = Path(tmp_s)
        saved = tmp / "saved.tar"
        say(f"docker save {ref} ({source_id[:19]})")
        secs.step("save", docker, ["save", "-o", str(saved), ref], code=BAD_ARCHIVE, what=f"docker save {ref}")
        blobs = tmp / "blobs"
        blobs.mkdir()
        results, paths, labels, config, sbom_bytes = secs.step("normalise", _normalise_saved, st, ref, saved, blobs,
                                                               with_sbom, wheels)
        config_bytes = canonical_json(config)
        saved.unlink()
        archive_tmp = tmp / ARCHIVE
        digests = _archive_and_load(st, config_bytes, paths, blobs, labels, archive_tmp, tag, keep_archive, load,
                                    secs)
        archive_path = None
        if keep_archive:
            archive_path = out_dir / ARCHIVE
            os.replace(archive_tmp, archive_path)
        result = ImageResult(tag=tag, image_id=digests["image_id"], source_image_id=source_id,
                             manifest_digest=digests["manifest_digest"], archive_sha256=digests["archive_sha256"],
                             diff_ids=[d for d, _ in paths], out_dir=str(out_dir),
                             archive=str(archive_path) if archive_path else None,
                             sbom_sha256=hashlib.sha256(sbom_bytes).hexdigest() if sbom_bytes else None,
                             dropped={str(i): r.dropped for i, r in enumerate(results) if r.dropped},
                             pyc_fixed=sum(1 for r in results for p in r.rewritten if p.endswith(".pyc")),
                             seconds=secs)
        _write_records(out_dir, result, config, results, sbom_bytes)
    return result


def _reuse_previous(ref: str, tag: str, source_id: str, out_dir: Path, keep_archive: bool) -> ImageResult | None:
    """The result recorded in `out_dir` when it was normalised from the same docker build output (tagged `tag`)."""
    previous = _previous(out_dir)
    if not (previous and source_id in (previous["image_id"], previous["source_image_id"])
            and image_inspect(previous["image_id"]) is not None and (not keep_archive or previous.get("archive"))):
        return None
    # A warm rebuild gave the same docker build output (or REF is our result already): same normalised image.
    if tag != ref or source_id != previous["image_id"]:
        docker(["tag", previous["image_id"], tag], code=BAD_ARCHIVE, what=f"docker tag {tag}")
    say(f"{tag}: {previous['image_id'][:19]} (normalised before from {previous['source_image_id'][:19]})")
    return ImageResult(**{**previous, "tag": tag})


def _normalise_saved(st: Stack, ref: str, saved: Path, blobs: Path, with_sbom: bool,
                     wheels: dict[str, tuple[str, str]] | None):
    """A `docker save` archive -> (layer results, (diff_id, staged layer) pairs, labels, config, SBOM bytes or None);
    every layer, the SBOM layer last, is staged under `blobs`."""
    epoch = st.source_date_epoch
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
    results: list[LayerResult] = []
    for i, layer_path in enumerate(dmanifest[0]["Layers"]):
        ltar = tarfile.open(fileobj=outer.extractfile(layer_path))
        with open(blobs / f"layer-{i}", "wb") as f:
            res = normalise_layer(ltar, f, epoch, overlay, where=f"{ref} layer {i}")
        results.append(res)
        if res.dropped:
            say(f"layer {i}: dropped {len(res.dropped)} build-litter file(s), e.g. {', '.join(res.dropped[:3])}")
    paths = [(res.diff_id, blobs / f"layer-{i}") for i, res in enumerate(results)]
    labels_before = (cfg.get("config") or {}).get("Labels") or {}
    stack_id = (overlay.watched.get(STACK_ID_IN_LAYER, b"").decode().split() or [None])[0] \
        or labels_before.get(LABEL_PREFIX + "stack-id")
    labels = oci_labels(st, labels_before, stack_id)
    extra_history = []
    sbom_bytes = None
    if with_sbom:
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
    config = normalise_config(cfg, [d for d, _ in paths], epoch, labels, extra_history)
    outer.close()
    return results, paths, labels, config, sbom_bytes


def _archive_and_load(st: Stack, config_bytes: bytes, paths: list[tuple[str, Path]], blobs: Path,
                      labels: dict[str, str], archive_tmp: Path, tag: str, keep_archive: bool, load: bool,
                      secs: Timings) -> dict:
    """Write (or only hash) the archive of the layers staged in `blobs` (removed then), `docker load` it unless
    Docker has that image already, tag it; the archive's digests."""
    epoch = st.source_date_epoch
    annotations = {k: v for k, v in labels.items() if k.startswith("org.opencontainers.image.")}
    annotations[LABEL_PREFIX + "stack-id"] = labels.get(LABEL_PREFIX + "stack-id", "")
    ref_name = st.version
    t0 = time.monotonic()
    image_id = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    # An image with this id exists already (another build gave the same bytes): docker has every layer, so
    # the archive is only hashed (for its digest), not written, and nothing is loaded.
    present = load and image_inspect(image_id) is not None
    if keep_archive or (load and not present):
        with open(archive_tmp, "wb") as f:
            digests = write_archive(f, epoch, config_bytes, paths, ref_name, annotations)
    else:
        digests = write_archive(NullWriter(), epoch, config_bytes, paths, ref_name, annotations)
    shutil.rmtree(blobs)
    secs["archive"] = round(time.monotonic() - t0, 1)
    if load and not present:
        say(f"docker load {digests['image_id'][:19]} ({archive_tmp.stat().st_size / 1e9:.2f} GB)")
        secs.step("load", docker, ["load", "-q", "-i", str(archive_tmp)], code=BAD_ARCHIVE,
                  what="docker load of the normalised image")
    if load:
        loaded = image_inspect(digests["image_id"])
        if loaded is None or loaded.get("Id") != digests["image_id"]:
            raise UserError(f"docker load did not give image {digests['image_id']} (docker computed "
                            f"{(loaded or {}).get('Id')})", BAD_ARCHIVE)
        if present:
            say(f"{digests['image_id'][:19]} is in Docker already (same bytes as an earlier build): not loaded")
        docker(["tag", digests["image_id"], tag], code=BAD_ARCHIVE, what=f"docker tag {tag}")
    return digests


def _write_records(out_dir: Path, result: ImageResult, config: dict, results: list[LayerResult],
                   sbom_bytes: bytes | None) -> None:
    """image.json, layers.json and (with an SBOM) sbom.cdx.json into `out_dir`."""
    files = {
        LAYERS_JSON: json.dumps({"config": config, "layers": [
            {"diff_id": r.diff_id, "size": r.size, "dropped": r.dropped, "rewritten": r.rewritten,
             "entries": [e.as_list() for e in r.entries]} for r in results]}, separators=(",", ":")) + "\n",
    }
    if sbom_bytes is not None:
        files[SBOM_JSON] = sbom_bytes.decode()
    files[IMAGE_JSON] = json.dumps(result.__dict__, indent=2, sort_keys=True) + "\n"
    # a directory holding an image.json of an earlier run is this command's own to overwrite
    write_output_dir(out_dir, files, what="the normalised image's records",
                     overwrite=_previous(out_dir) is not None)


def _previous(out_dir: Path) -> dict | None:
    data = read_json(out_dir / IMAGE_JSON)
    fields = set(ImageResult.__dataclass_fields__)
    return data if isinstance(data, dict) and fields <= set(data) else None


def build_wheels(st: Stack, cache: Path, extra: list[Path] = ()) -> dict[str, tuple[str, str]]:
    """The wheels an image build installs from: the verified wheelhouse of the lock, our UCXX wheels, our own wheel
    and `extra` wheels or wheel directories (replacing the lock's version of their distribution)."""
    dirs = [d for d in (wheelhouse_dir(cache, st.lock_path()), default_ucxx_wheels(), cache / "pkg") if d.is_dir()]
    return wheels_from(dirs + [Path(w) for w in extra])


def finish_build(st: Stack, tag: str, cache: Path, extra_wheels: list[Path] = ()) -> ImageResult:
    """The image build's last step, right after `docker build` produced `tag`: normalises `tag` in place, its records
    in <cache>/image/<tag>/repro. A warm rebuild that gives the same docker build output costs one `docker image
    inspect`."""
    return normalise_image(st, tag, default_out_dir(cache, tag), tag=tag, wheels=build_wheels(st, cache, extra_wheels))


def wheels_from(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """canonical name -> (file, sha256) from wheel files and wheelhouse directories (their wheelhouse.json)."""
    found: dict[str, tuple[str, str]] = {}
    for p in paths:
        if p.is_dir():
            manifest = p / MANIFEST
            files = json.loads(manifest.read_text())["files"] if manifest.is_file() else \
                {w.name: sha256_file(w) for w in sorted(p.glob("*.whl"))}
        elif p.is_file() and p.name.endswith(".whl"):
            files = {p.name: sha256_file(p)}
        else:
            raise UserError(f"--wheels {p}: not a wheel or a directory of wheels", USAGE)
        for fname, sha in files.items():
            found[canonical(fname.split("-", 1)[0])] = (fname, sha)
    return found

"""Reproducible from any checkout: two builds from two clones at different paths, under a different umask, locale
and time zone (what Debian's reprotest varies), must give byte-identical UCX prefixes (a normal-form tar of each),
UCXX wheels and image ids. It clones and builds a checkout of this repository, which no installed package has: the
workshop's check (tools/README.md), built on the product's normalisation and comparison.

Each clone is a fresh `git clone` of this checkout's commit (its `origin` set to this checkout's, so the image's
source label agrees) at its own depth, and builds with its own code and nothing cached: its own UCX work directory,
UCXX build cache and image build cache, the image with `docker build --no-cache` (`fresh_bases`: the Debian bases
bootstrapped again too). Only verified downloads are shared (source archives, the lock's wheels; each is checked
against its pin again). The first build may instead be this checkout's own (`against_checkout`: its UCX prefix,
UCXX wheels and an image built already), which halves the time: what CI runs.

On a mismatch the report names the first differing file (in the prefix, a wheel, or an image layer) and, where
`diffoscope` (Debian) is installed, writes its diff of the two differing files next to the report.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ucx_dask_gpu.cliutil import Progress
from ucx_dask_gpu.errors import BAD_ARCHIVE, BUILD_FAILED, OUTPUT_REFUSED, USAGE, UserError
from ucx_dask_gpu.fsutil import atomic_path, sha256_file
from ucx_dask_gpu.image import leftovers, normalise
from ucx_dask_gpu.image.bases import KINDS
from ucx_dask_gpu.image.build import link_or_copy
from ucx_dask_gpu.image.docker import docker, image_inspect
from ucx_dask_gpu.image.paths import (CACHE_ENV, UCX_SOURCES, UCXX_WHEELS_ENV, base_ref, default_cache, image_ref,
                                      stage_ref)
from ucx_dask_gpu.image.wheelhouse import wheelhouse_dir
from ucx_dask_gpu.oci.compare import compare as compare_images
from ucx_dask_gpu.oci.compare import render_compare
from ucx_dask_gpu.oci.tarnorm import NormaliseResult, normalise_tar, sort_key
from ucx_dask_gpu.stack import STACK_ENV, Stack
from ucx_dask_gpu.ucx.install import BUILD_INFO, read_ucxx_build_info
from ucx_dask_gpu.ucxbuild.fetch import CACHE_ENV as SOURCE_CACHE_ENV
from ucx_dask_gpu.ucxbuild.fetch import default_cache_dir, local_dirs

PREFIX_TAR = "ucx-prefix.tar"
DIFFOSCOPE_TIMEOUT_S = 600
# Variables of this process that would point a clone's build at this checkout's files.
_OURS = (STACK_ENV, SOURCE_CACHE_ENV, CACHE_ENV, UCXX_WHEELS_ENV, "UCX_PREFIX", "PYTHONPATH", "VIRTUAL_ENV",
         "MAKEFLAGS", "MAKELEVEL", "MFLAGS")


say = Progress("repro: ")


@dataclass(frozen=True)
class Variation:
    """What one build varies (reprotest's build path, umask, locale, time zone); the builds fix all but the path."""

    umask: int
    tz: str
    lang: str

    def record(self) -> dict:
        return {"umask": f"{self.umask:04o}", "TZ": self.tz, "LANG": self.lang}


VARIATIONS = (Variation(0o022, "GMT+12", "C.UTF-8"), Variation(0o077, "GMT-14", "POSIX"))


@dataclass
class Build:
    label: str
    checkout: Path
    variation: Variation | None           # None: this checkout, built however it was
    prefix: Path
    wheels_dir: Path
    source_cache: Path                    # verified downloads: source archives, CUDA wheels and .debs
    image_cache: Path                     # image build cache: verified wheelhouse, UCX sources, normalised outputs
    seconds: dict[str, float] = field(default_factory=dict)
    prefix_tar_sha256: str = ""
    prefix_entries: list = field(default_factory=list)
    wheels: dict[str, str] = field(default_factory=dict)   # wheel file -> sha256
    image: dict = field(default_factory=dict)              # tag, image_id, out_dir, cache

    @classmethod
    def in_clone(cls, label: str, clone: Path, variation: Variation) -> Build:
        """Where `make ucx ucxx` and `make image` put them in a fresh checkout."""
        return cls(label, clone, variation, clone / "build" / "ucx-prefix", clone / "build" / "ucxx-wheels",
                   clone / ".cache" / "sources", clone / "build" / "cache")

    @property
    def wheel_cache(self) -> Path:
        """The UCXX build lock's wheels, next to the source cache (ucxx.py)."""
        return self.source_cache.parent / "wheels"

    def record(self) -> dict:
        d = asdict(self)
        d.pop("prefix_entries")
        d.update({k: str(getattr(self, k))
                  for k in ("checkout", "prefix", "wheels_dir", "source_cache", "image_cache")})
        d["variation"] = self.variation.record() if self.variation else "this checkout's own build"
        return d


# --- clones and their builds -----------------------------------------------------------------------------------------

def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"git {' '.join(args[:2])} in {root}: {proc.stderr.strip() or proc.returncode}", USAGE)
    return proc.stdout.strip()


def _under(v: Variation, cmd: list[str]) -> list[str]:
    return ["sh", "-c", f'umask {v.umask:03o} && exec "$@"', "sh", *cmd]


def clone_env(v: Variation, clone: Path) -> dict[str, str]:
    """The environment of a clone's build: the variation, the clone's own code and outputs, none of ours."""
    env = {k: val for k, val in os.environ.items() if k not in _OURS and not k.startswith("LC_")}
    env.update(TZ=v.tz, LANG=v.lang, PYTHONPATH=str(clone / "src"), UCX_PREFIX=str(clone / "build" / "ucx-prefix"),
               UCXX_WHEELS=str(clone / "build" / "ucxx-wheels"))
    return env


def make_clone(st: Stack, dest: Path, commit: str, v: Variation, fetch: str = "HEAD") -> Path:
    """`git clone` of this checkout at `commit` into `dest` (new or empty), under the build's umask; its origin is
    this checkout's (the image labels its source with it). `fetch`: the name the commit was given by."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: not a new or empty directory (a clone goes there; nothing written or removed)",
                        OUTPUT_REFUSED)
    proc = subprocess.run(_under(v, ["git", "clone", "--quiet", "--no-checkout", str(st.root), str(dest)]),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"git clone into {dest} failed: {proc.stderr.strip()}", USAGE)
    # A revision that is none of the checkout's branches or tags (a remote-tracking branch) is not in a fresh clone.
    if subprocess.run(["git", "-C", str(dest), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode != 0:
        _git(dest, "fetch", "--quiet", str(st.root), fetch)
    proc = subprocess.run(_under(v, ["git", "-C", str(dest), "checkout", "--quiet", "--detach", commit]),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"git checkout {commit[:12]} in {dest} failed: {proc.stderr.strip()}", USAGE)
    origin = subprocess.run(["git", "-C", str(st.root), "remote", "get-url", "origin"], capture_output=True,
                            text=True).stdout.strip()
    if origin:
        _git(dest, "remote", "set-url", "origin", origin)
    else:
        _git(dest, "remote", "remove", "origin")
    return dest


def _run_step(b: Build, name: str, cmd: list[str], log: Path, stdout: Path | None = None) -> None:
    """One build step in the clone, its output in `log` (its stdout alone in `stdout`, if given); its time in
    b.seconds."""
    t0 = time.monotonic()
    say(f"{b.label}: {name} ({' '.join(cmd[:3])} ...), log {log}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err, open(stdout or os.devnull, "w") as out:
        proc = subprocess.run(_under(b.variation, cmd), cwd=b.checkout, env=clone_env(b.variation, b.checkout),
                              stdout=out if stdout else err, stderr=err)
    b.seconds[name] = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise UserError(f"build {b.label} ({b.checkout}): {name} failed (exit {proc.returncode}): {tail[0].strip()} "
                        f"(log: {log})", BUILD_FAILED)


def build_prefix_and_wheels(b: Build, logs: Path, sources: list[Path], find_links: list[Path], require: str,
                            offline: bool) -> None:
    script = str(b.checkout / "ucx-src-build" / "build.sh")
    src = [a for d in sources if d.is_dir() for a in ("--sources", str(d))] + (["--offline"] if offline else [])
    links = [a for d in find_links if d.is_dir() for a in ("--find-links", str(d))]
    _run_step(b, "ucx", [script, "build", "--prefix", str(b.prefix), "--work-dir", "build/ucx-work",
                         "--require", require, *src], logs / f"{b.label}-ucx.log")
    _run_step(b, "ucxx", [script, "ucxx", "--ucx-prefix", str(b.prefix), "--out", str(b.wheels_dir),
                          "--work-dir", "build/ucxx-work", *src, *links], logs / f"{b.label}-ucxx.log")


@contextlib.contextmanager
def holding_lock(path: Path | None):
    """Hold an exclusive flock on `path` (a Docker engine shared with other builders), if one is given; the test
    suite's workers share their engine with it too (tests/integration/conftest.py)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        say(f"waiting for the lock {path}")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def seed_image_cache(st: Stack, b: Build, inputs_from: Path) -> Path:
    """The clone's image build cache with only the verified downloads of another image build cache (the first
    build's, or for the first build this checkout's): the lock's wheelhouse and the UCX sources (linked; the build
    checks both against their pins again), so both images are made of the same files and no build is reused."""
    cache = b.image_cache
    lock = st.lock_path()
    for src, dest in ((wheelhouse_dir(inputs_from, lock), wheelhouse_dir(cache, lock)),
                      (inputs_from / UCX_SOURCES, cache / UCX_SOURCES)):
        if src.is_dir():
            _link_files(src, dest)
    return cache


def _link_files(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            link_or_copy(f, dest / f.name)


def clean_bases(st: Stack) -> None:
    """Untag the Debian base images, so the next build bootstraps them again: new base image ids, hence no Docker
    build cache either. Images built on the old bases keep them (untagging deletes nothing they use)."""
    for kind in KINDS:
        tag = base_ref(st, kind)
        if image_inspect(tag) is not None:
            docker(["rmi", tag], code=BUILD_FAILED, what=f"docker rmi {tag}")


def build_image(st: Stack, b: Build, logs: Path, fresh_bases: bool, lock: Path | None, inputs_from: Path) -> None:
    """The clone's image, with its own code and UCXX wheels, every step run again, under a tag of its own
    (<name>:repro-<label>-<this check's id>, which no other build uses); normalised (what `image build` does)."""
    tag = f"{st.image.name}:repro-{b.label}-{logs.parent.name.rsplit('-', 1)[-1]}"
    cache = seed_image_cache(st, b, inputs_from)
    out = logs / f"{b.label}-image.json"
    with holding_lock(lock):
        if fresh_bases:
            clean_bases(st)
        # Bases bootstrapped again have new ids: no layer of an earlier build can match, and the full build may
        # take the ucx stage this build has just made. On the same bases only --no-cache keeps earlier layers out
        # (at the price of building the ucx stage twice).
        no_cache = [] if fresh_bases else ["--no-cache"]
        _run_step(b, "image", [sys.executable, "-m", "ucx_dask_gpu", "image", "--cache", str(cache), "build",
                               "--tag", tag, *no_cache, "--ucxx-wheels", str(b.wheels_dir), "--json"],
                  logs / f"{b.label}-image.log", stdout=out)
    # The build's result (`--json`); its normalisation wrote image.json and layers.json into its cache.
    result = json.loads(out.read_text())
    b.image = {"tag": tag, "image_id": result["image_id"],
               "out_dir": str(normalise.default_out_dir(cache, tag)), "cache": str(cache)}


def remove_images(st: Stack, b: Build, lock: Path | None) -> None:
    """The images the clone's image build made (its cache records them) and its two tags (the image's and its UCX
    stage's, both of this check's own). Never a tag another build uses, nor an image that carries one (the Debian
    bases its first steps name), nor one other images are built on (`docker rmi` is never forced)."""
    if not b.image.get("cache"):
        return
    own = {b.image["tag"], stage_ref(st, b.image["tag"])}
    with holding_lock(lock):
        for rec in sorted((Path(b.image["cache"]) / "image").glob(f"*/{leftovers.RECORD}")):
            data = leftovers.read_record(rec.parent)
            for tag in own & set(data.get("tags", [])):
                docker(["rmi", tag], code=BUILD_FAILED, what=f"docker rmi {tag}", check=False)
            ids = [i for i in data.get("images", []) if not set((image_inspect(i) or {}).get("RepoTags") or []) - own]
            leftovers.remove(list(reversed(ids)))   # the last step first: its parents go with it


# --- what two builds made ------------------------------------------------------------------------------------------

def _owned_by_root(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def tar_tree(root: str | os.PathLike, dest: str | os.PathLike, epoch: int) -> NormaliseResult:
    """A directory (e.g. a UCX prefix) as a normal-form tar of its contents, owned by 0:0 (who built it must not
    matter), written to `dest` whole or not at all. Two trees give the same bytes exactly when their paths, types,
    permission bits, contents and link targets agree (mtimes are clamped to `epoch`)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory", BAD_ARCHIVE)
    with tempfile.TemporaryFile() as raw, atomic_path(dest) as tmp:
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
            t.add(root, arcname=".", filter=_owned_by_root)
        raw.seek(0)
        with tarfile.open(fileobj=raw, mode="r") as src, open(tmp, "wb") as out:
            return normalise_tar(src, out, epoch, where=str(root))


def record_outputs(st: Stack, b: Build, work: Path) -> None:
    """The prefix as a normal-form tar (its sha256 and entry list) and every wheel's sha256."""
    if not (b.prefix / BUILD_INFO).is_file():
        raise UserError(f"{b.prefix}: no UCX build there (make ucx)", USAGE)
    res = tar_tree(b.prefix, work / b.label / PREFIX_TAR, st.source_date_epoch)
    b.prefix_tar_sha256 = res.sha256
    b.prefix_entries = [e.as_list() for e in res.entries]
    info = read_ucxx_build_info(b.wheels_dir)
    if info is None:
        raise UserError(f"{b.wheels_dir}: no UCXX wheels there (make ucxx)", USAGE)
    b.wheels = {p["wheel"]: sha256_file(b.wheels_dir / p["wheel"]) for p in info["packages"]}


def first_zip_difference(a: Path, b: Path) -> dict | None:
    """The first member (in name order) whose bytes or metadata differ between two wheels."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        ia = {i.filename: i for i in za.infolist()}
        ib = {i.filename: i for i in zb.infolist()}
        for name in sorted(set(ia) | set(ib)):
            if name not in ib or name not in ia:
                return {"member": name, "only_in": "a" if name in ia else "b"}
            x, y = ia[name], ib[name]
            fields = [f for f in ("date_time", "external_attr", "compress_type", "CRC", "file_size")
                      if getattr(x, f) != getattr(y, f)]
            if fields:
                return {"member": name, "fields": fields}
        if [i.filename for i in za.infolist()] != [i.filename for i in zb.infolist()]:
            return {"member": None, "fields": ["order"]}
    return {"member": None, "fields": ["archive bytes"]}


def first_tree_difference(a: list, b: list) -> dict | None:
    ma, mb = {e[0]: e for e in a}, {e[0]: e for e in b}
    for p in sorted(set(ma) | set(mb), key=sort_key):
        if ma.get(p) != mb.get(p):
            return {"path": p, "a": ma.get(p), "b": mb.get(p)}
    return None


def diffoscope(a: Path, b: Path, out: Path) -> dict:
    """diffoscope's text diff of two files into `out` (Debian: diffoscope or diffoscope-minimal), or why not."""
    tool = shutil.which("diffoscope")
    if tool is None:
        return {"diffoscope": "not installed (Debian: apt-get install diffoscope-minimal)"}
    proc = subprocess.run([tool, "--no-progress", "--text", str(out), str(a), str(b)], capture_output=True,
                          text=True, timeout=DIFFOSCOPE_TIMEOUT_S)
    # diffoscope exits 1 when the files differ (what we expect here), 0 when they do not, 2 on errors.
    if proc.returncode == 2 or not out.is_file():
        return {"diffoscope": f"failed: {(proc.stderr.strip().splitlines() or ['exit 2'])[-1]}"}
    return {"diffoscope": str(out)}


def compare_builds(a: Build, b: Build, work: Path, limit: int) -> dict:
    report: dict = {"builds": [a.record(), b.record()]}
    prefix = {"identical": a.prefix_tar_sha256 == b.prefix_tar_sha256,
              "a": a.prefix_tar_sha256, "b": b.prefix_tar_sha256}
    if not prefix["identical"]:
        first = first_tree_difference(a.prefix_entries, b.prefix_entries)
        prefix["first_difference"] = first
        if first and first["a"] and first["b"] and first["a"][1] == "file":
            prefix.update(diffoscope(a.prefix / first["path"], b.prefix / first["path"],
                                     work / f"diffoscope-prefix-{Path(first['path']).name}.txt"))
    report["prefix"] = prefix
    wheels = {"identical": a.wheels == b.wheels, "a": a.wheels, "b": b.wheels}
    if not wheels["identical"]:
        names = sorted(set(a.wheels) | set(b.wheels))
        name = next(n for n in names if a.wheels.get(n) != b.wheels.get(n))
        first: dict = {"wheel": name}
        if name in a.wheels and name in b.wheels:
            first.update(first_zip_difference(a.wheels_dir / name, b.wheels_dir / name) or {})
            first.update(diffoscope(a.wheels_dir / name, b.wheels_dir / name, work / f"diffoscope-{name}.txt"))
        else:
            first["only_in"] = "a" if name in a.wheels else "b"
        wheels["first_difference"] = first
    report["wheels"] = wheels
    if a.image and b.image:
        report["image"] = compare_images(Path(a.image["out_dir"]), Path(b.image["out_dir"]), limit=limit)
    report["identical"] = prefix["identical"] and wheels["identical"] and \
        report.get("image", {}).get("identical", True)
    return report


def first_difference_line(r: dict) -> str:
    """One line naming the first differing file: for the error message."""
    if not r["prefix"]["identical"]:
        first = r["prefix"].get("first_difference") or {}
        return f"UCX prefix: {first.get('path', '?')} differs"
    if not r["wheels"]["identical"]:
        first = r["wheels"]["first_difference"]
        return f"{first['wheel']}: {first.get('member') or first.get('only_in') or 'archive'} differs"
    img = r.get("image") or {}
    for layer in img.get("layers", []):
        for d in layer.get("differ", []):
            return f"image layer {layer['layer']}: {d['path']} differs"
    return "image config differs" if img else "?"


def render(r: dict) -> str:
    lines = [f"commit {r['commit']}"] if r.get("commit") else []
    for b in r["builds"]:
        v = b["variation"]
        how = v if isinstance(v, str) else f"umask {v['umask']}, TZ={v['TZ']}, LANG={v['LANG']}"
        took = ", ".join(f"{k} {s:.0f} s" for k, s in b["seconds"].items())
        lines.append(f"build {b['label']}: {b['checkout']}  ({how}{'; ' + took if took else ''})")
        lines.append(f"  UCX prefix tar sha256 {b['prefix_tar_sha256']}")
        lines += [f"  {sha}  {w}" for w, sha in sorted(b["wheels"].items())]
        if b["image"]:
            lines.append(f"  image {b['image']['image_id']}  ({b['image']['tag']})")
    for what in ("prefix", "wheels"):
        part = r[what]
        state = "identical" if part["identical"] else f"DIFFER: {json.dumps(part.get('first_difference'))}"
        lines.append(f"{what}: {state}")
        if part.get("diffoscope"):
            lines.append(f"  diffoscope: {part['diffoscope']}")
        if part.get("first_difference", {}) and part["first_difference"].get("diffoscope"):
            lines.append(f"  diffoscope: {part['first_difference']['diffoscope']}")
    if "image" in r:
        lines.append("image: " + ("identical" if r["image"]["identical"] else "DIFFER"))
        if not r["image"]["identical"]:
            lines.append(render_compare(r["image"]))
    lines.append("REPRODUCIBLE" if r["identical"] else "NOT REPRODUCIBLE: " + first_difference_line(r))
    return "\n".join(lines)


# --- the check ------------------------------------------------------------------------------------------------------

def this_checkouts_build(st: Stack, first_image: str | None, image: bool) -> Build:
    """Build A = what `make ucx ucxx` (and `make image`, or FIRST) made in this checkout."""
    prefix = Path(os.environ.get("UCX_PREFIX") or st.root / "build" / "ucx-prefix")
    wheels = Path(os.environ.get(UCXX_WHEELS_ENV) or st.root / "build" / "ucxx-wheels")
    b = Build("a", st.root, None, (st.root / prefix).resolve(), (st.root / wheels).resolve(),
              default_cache_dir(st).resolve(), default_cache().resolve())
    if image:
        tag = first_image or image_ref(st)
        if image_inspect(tag) is None:
            raise UserError(f"no image {tag} to compare with: build it first (make image), give --first IMAGE, or "
                            f"--no-image", USAGE)
        b.image = {"tag": tag}
    return b


def run_check(st: Stack, *, against_checkout: bool = False, first_image: str | None = None,
              clone_dirs: list[Path] = (), revision: str = "HEAD", image: bool = True, fresh_bases: bool = False,
              require: str = "ib,cuda", sources: list[Path] = (), find_links: list[Path] = (), keep: bool = False,
              lock: Path | None = None, limit: int = 10) -> dict:
    """Two builds (or this checkout's and one from a clone), compared; the report (see the module docstring)."""
    _check_options(against_checkout, first_image, clone_dirs, revision)
    # One commit for both clones, resolved now: a branch may move while the first clone builds.
    commit = _git(st.root, "rev-parse", "--verify", f"{revision}^{{commit}}")
    if _git(st.root, "status", "--porcelain", "--untracked-files=no"):
        say(f"{st.root} has uncommitted changes: the clones build {revision} ({commit[:12]}) as committed")
    builds: list[Build] = [this_checkouts_build(st, first_image, image)] if against_checkout else []
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="udg-repro-"))
    # Unless named: two depths under one new directory (the build path is what varies most between users).
    default_dirs = {"a": work / "a" / "ucx-dask-gpu", "b": work / "some" / "deeper" / "path" / "b" / "ucx-dask-gpu"}
    labels = ["b"] if against_checkout else ["a", "b"]
    named = [Path(d).resolve() for d in clone_dirs]
    dirs = [named[i] if i < len(named) else default_dirs[label] for i, label in enumerate(labels)]
    try:
        for label, d in zip(labels, dirs):
            _add_clone_build(builds, st, label, d, commit, revision, work, sources, find_links, require, image,
                             fresh_bases, lock)
        for b in builds:
            record_outputs(st, b, work)
        if image and against_checkout:
            with holding_lock(lock):
                res = normalise.finish_build(st, builds[0].image["tag"], default_cache())
            builds[0].image.update(image_id=res.image_id, out_dir=res.out_dir)
        report = compare_builds(builds[0], builds[1], work, limit)
    except BaseException:
        say(f"kept for inspection: {work}" + "".join(f"; {b.checkout}, its image {b.image['tag']}" for b in builds
                                                      if b.variation is not None and b.image.get("tag")))
        raise
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["commit"] = commit
    report["work_dir"] = str(work)
    if report["identical"] and not keep:
        for b in builds:
            if b.variation is not None:
                remove_images(st, b, lock)
        shutil.rmtree(work, ignore_errors=True)    # the clones this check found a place for; named ones stay
        report["work_dir"] = None
    return report


def _check_options(against_checkout: bool, first_image: str | None, clone_dirs: list[Path], revision: str) -> None:
    """Refuse contradicting options and clone directories in use before anything runs."""
    n_clones = 1 if against_checkout else 2
    if len(clone_dirs) > n_clones:
        raise UserError(f"--clone-dir: {n_clones} at most {'with' if against_checkout else 'without'} "
                        f"--against-checkout", USAGE)
    if first_image and not against_checkout:
        raise UserError("--first IMAGE is this checkout's image: it needs --against-checkout", USAGE)
    if against_checkout and revision != "HEAD":
        raise UserError("--revision with --against-checkout: this checkout's own build is of its HEAD", USAGE)
    for d in clone_dirs:
        if Path(d).is_dir() and any(Path(d).iterdir()):
            raise UserError(f"--clone-dir {d}: not empty: give a new or empty directory for each clone (refused "
                            f"before anything ran; nothing written or removed)", OUTPUT_REFUSED)


def _add_clone_build(builds: list[Build], st: Stack, label: str, d: Path, commit: str, revision: str, work: Path,
                     sources: list[Path], find_links: list[Path], require: str, image: bool, fresh_bases: bool,
                     lock: Path | None) -> None:
    """Clone `commit` into `d` under build `label`'s variation, add it to `builds` (named when a step fails) and
    build UCX, the UCXX wheels (and the image) there."""
    v = VARIATIONS[0] if label == "a" else VARIATIONS[1]
    say(f"clone {label}: {d} (umask {v.umask:04o}, TZ={v.tz}, LANG={v.lang})")
    b = Build.in_clone(label, make_clone(st, d, commit, v, fetch=revision), v)
    # The first build fetches as any build does (this checkout's caches and mirrors first); the second uses
    # exactly the files the first used, offline: the source archives are held fixed.
    first = builds[0] if builds else None
    if first is None:
        srcs = [*sources, default_cache_dir(st).resolve(), *local_dirs(st)]
        links = [*find_links, default_cache_dir(st).resolve().parent / "wheels"]
    else:
        srcs, links = [first.source_cache, *sources], [first.wheel_cache, *find_links]
    builds.append(b)
    build_prefix_and_wheels(b, work / "logs", list(dict.fromkeys(srcs)), list(dict.fromkeys(links)),
                            require, offline=first is not None)
    if image:
        build_image(st, b, work / "logs", fresh_bases, lock,
                    inputs_from=first.image_cache if first else default_cache().resolve())

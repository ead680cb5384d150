"""`ucx-dask-gpu image …` (the verified inputs, the bases, the build, the cluster demo),
`ucx-dask-gpu repro …` (normalise a built image, compare two builds) and `ucx-dask-gpu sbom …` (check, generate)."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

from ..errors import NOT_REPRODUCIBLE, SBOM_INVALID, SBOM_MISMATCH, USAGE, VERDICT_FAILED, UserError
from ..cliutil import add_output
from ..fsutil import write_output_file
from ..oci import sbom as sbommod
from ..oci.compare import compare, render_compare
from ..oci.layer import normalise_rootfs_tar
from ..stack import load
from ..stack.lock import canonical, load_lock
from ..ucx.install import BUILD_INFO, INSTALLED_UCXX_BUILD_INFO
from . import compose, leftovers, normalise, rolehook
from .bases import KINDS, base_from_image, ensure_base
from .build import build_image
from .cluster import Cluster, remove_all_clusters
from .demo import demo_ok, render_demo, run_demo
from .docker import docker, engine_version
from .gpuhost import parse_gpus
from .paths import CACHE_ENV, default_cache, default_ucxx_wheels, image_ref
from .wheelhouse import build_own_wheel, ensure_wheelhouse


def _cache(args) -> Path:
    return Path(args.cache) if getattr(args, "cache", None) else default_cache()


# --- image ------------------------------------------------------------------------------------------------------------

def _cmd_wheelhouse(args) -> int:
    st = load(args.stack_file)
    dest = ensure_wheelhouse(st, _cache(args), lock_path=args.lock,
                             find_links=Path(args.find_links) if args.find_links else None)
    print(dest)
    if not args.no_own_wheel:
        print(build_own_wheel(st, _cache(args) / "pkg"))
    return 0


def _cmd_base(args) -> int:
    st = load(args.stack_file)
    engine_version()
    for kind in (KINDS if args.kind == "all" else (args.kind,)):
        if args.from_image:
            print(base_from_image(st, kind, args.from_image))
        else:
            print(ensure_base(st, kind, _cache(args), force=args.force))
    return 0


def _cmd_build(args) -> int:
    st = load(args.stack_file)
    ucxx = Path(args.ucxx_wheels) if args.ucxx_wheels else default_ucxx_wheels()
    result = build_image(st, _cache(args), ucxx, tag=args.tag, extra_wheels=[Path(w) for w in args.extra_wheel],
                         base_from=args.base_from, normalise=not args.no_normalise,
                         own_wheel=Path(args.own_wheel) if args.own_wheel else None, no_cache=args.no_cache)
    if args.json:
        print(json.dumps(result.__dict__, indent=2, sort_keys=True))
    else:
        print(f"image    {result.tag}")
        print(f"id       {result.image_id}")
        print(f"size     {result.size} bytes ({result.size / 1e9:.2f} GB)")
        print(f"stack id {result.stack_id}")
        print(f"UCX      {result.ucx_version}, UCXX {result.ucxx_version} (both built from source)")
        print("timings  " + ", ".join(f"{k} {v:.0f} s" for k, v in result.timings.items()))
    return 0


def _host_settings(args) -> dict:
    """--gpus / --infiniband / --cma as Cluster keyword arguments (GPU mode when --gpus is given)."""
    if not args.gpus:
        if args.infiniband or args.cma:
            raise UserError("--infiniband and --cma are GPU-host settings: give --gpus too", USAGE)
        return {}
    return {"gpu": True, "gpus": tuple(parse_gpus(args.gpus)), "infiniband": args.infiniband, "cma": args.cma}


def _add_host_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", metavar="N,M,...",
                   help="GPU host: one dask cuda worker per listed GPU (--gpus device=N), all sharing one IPC and "
                        "PID namespace so cuda_ipc works between them")
    p.add_argument("--infiniband", action="store_true",
                   help="GPU workers get /dev/infiniband, IPC_LOCK and unlimited memlock (InfiniBand hosts)")
    p.add_argument("--cma", action="store_true", help="GPU workers get SYS_PTRACE (UCX's cma between them)")


def _cmd_demo(args) -> int:
    st = load(args.stack_file)
    host = _host_settings(args)
    engine_version()
    rows = run_demo(args.image or image_ref(st), args.protocol or ["ucx", "tcp"], args.workers, **host)
    print(render_demo(rows))
    for r in rows:
        if r["logs"]:
            print(f"{r['protocol']}: container logs kept in {r['logs']}")
    if args.json:
        write_output_file(args.json, json.dumps(rows, indent=2, sort_keys=True) + "\n", what="the results")
    return 0 if demo_ok(rows) else VERDICT_FAILED


def _cmd_compose(args) -> int:
    st = load(args.stack_file)
    host = _host_settings(args)
    cluster = Cluster(args.image or image_ref(st), protocol=args.protocol, n_workers=args.workers, **host)
    words = [f"--protocol {args.protocol}"] + ([f"--gpus {args.gpus}"] if args.gpus else [f"--workers {args.workers}"])
    words += [w for w, on in (("--infiniband", args.infiniband), ("--cma", args.cma)) if on]
    text = compose.render(cluster, " ".join(words))
    if args.check:
        if _read(args.check, "the compose file") != text:
            raise UserError(f"{args.check} is not what `ucx-dask-gpu image compose {' '.join(words)}` writes: "
                            "regenerate it", VERDICT_FAILED)
        print(f"{args.check}: up to date")
    elif args.output:
        write_output_file(args.output, text, what="the compose file")
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_clean(args) -> int:
    engine_version()
    removed, tags = leftovers.clean(_cache(args))
    print(f"removed {removed} image(s) recorded by this checkout's builds" + (f", tags {' '.join(tags)}" if tags else
                                                                            ""))
    return 0


def _cmd_remove_clusters(args) -> int:
    engine_version()
    print(f"removed {remove_all_clusters()} container(s)/volume(s)/network(s) of ucx-dask-gpu clusters")
    return 0


def _cmd_role_hook(args) -> int:
    print(f"wrote {rolehook.install(args.dest)}")
    return 0


def _register_image_inputs(s: argparse._SubParsersAction) -> None:
    """wheelhouse, base: what a build needs, fetched and verified."""
    w = s.add_parser("wheelhouse", help="download + verify every wheel of the hashed lock, and build our own wheel")
    w.add_argument("--lock", type=Path, help="hashed requirements to fetch (default: stack.toml [python].lock)")
    w.add_argument("--find-links", metavar="DIR", help="take wheels from DIR instead of PyPI (no index)")
    w.add_argument("--no-own-wheel", action="store_true", help="skip building the ucx-dask-gpu wheel")
    w.set_defaults(func=_cmd_wheelhouse)

    b = s.add_parser("base", help="debootstrap + import the Debian base images (skipped when up to date)")
    b.add_argument("--kind", choices=["runtime", "builder", "all"], default="all")
    b.add_argument("--force", action="store_true", help="bootstrap again even when the image is up to date")
    b.add_argument("--from", dest="from_image", metavar="IMAGE",
                   help="build the bases from this registry image instead (e.g. debian:SUITE-slim@sha256:...)")
    b.set_defaults(func=_cmd_base)


def _register_image_build(s: argparse._SubParsersAction) -> None:
    """build: the image from the verified inputs."""
    bd = s.add_parser("build", help="fetch + verify every input, then docker build --network none")
    bd.add_argument("--tag", help="image tag (default: [image].name:[stack].version)")
    bd.add_argument("--extra-wheel", action="append", default=[], metavar="WHL",
                    help="install this wheel on top of the lock; repeatable (the stack id changes only when it is "
                         "a distribution of the environment contract: `ucx-dask-gpu guard show`)")
    bd.add_argument("--own-wheel", metavar="WHL",
                    help="install this ucx-dask-gpu wheel instead of one built from the checkout (a patched build "
                         "under another version: another stack id)")
    bd.add_argument("--base-from", metavar="IMAGE",
                    help="derive both bases from this registry image with apt (e.g. "
                         "debian:SUITE-slim@sha256:...) instead of debootstrap")
    bd.add_argument("--ucxx-wheels", metavar="DIR",
                    help="the UCXX wheels to install (`make ucxx`; default: $UCXX_WHEELS or build/ucxx-wheels)")
    bd.add_argument("--no-cache", action="store_true",
                    help="run every step again (docker build --no-cache): a clean build on the same bases")
    bd.add_argument("--json", action="store_true", help="print the result as JSON")
    bd.add_argument("--no-normalise", action="store_true",
                    help="keep docker build's own image: not reproducible, no SBOM (see `ucx-dask-gpu repro`)")
    bd.set_defaults(func=_cmd_build)


def _register_image_clusters(s: argparse._SubParsersAction) -> None:
    """demo, compose: the image run as a cluster on this host."""
    d = s.add_parser("demo", help="scheduler + workers + client from the image on an internal network: run the "
                                  "transpose and from-map workloads over ucx and tcp, report, stop")
    d.add_argument("--image", help="image to run (default: [image].name:[stack].version)")
    d.add_argument("--protocol", action="append", choices=["ucx", "tcp", "tls"],
                   help="protocol(s) to run (default: ucx and tcp)")
    d.add_argument("--workers", type=int, default=2)
    add_output(d, "--json", metavar="FILE", help="also write the full results to FILE")
    _add_host_settings(d)
    d.set_defaults(func=_cmd_demo)

    c = s.add_parser("compose", help="the same cluster as a compose file for one host (scheduler, workers, client)")
    c.add_argument("--image", help="image to run (default: [image].name:[stack].version)")
    c.add_argument("--protocol", choices=["ucx", "tcp"], default="ucx")
    c.add_argument("--workers", type=int, default=2, help="CPU workers (without --gpus)")
    _add_host_settings(c)
    add_output(c, "-o", "--output", metavar="FILE", help="write the compose file here (default: stdout)")
    c.add_argument("--check", metavar="FILE", help="exit 1 unless FILE is exactly what this would write")
    c.set_defaults(func=_cmd_compose)


def _register_image_upkeep(s: argparse._SubParsersAction) -> None:
    """clean, remove-clusters, role-hook: what builds and clusters leave, and the hook the Dockerfile installs."""
    c = s.add_parser("clean", help="remove the images this checkout's builds made (recorded in the build cache: "
                                   "every step's image, the normalised images, their tags); the next build is cold")
    c.set_defaults(func=_cmd_clean)

    r = s.add_parser("remove-clusters", help="remove every container/volume/network left by clusters of ours "
                                            "(after an interrupted run; also ends running ones)")
    r.set_defaults(func=_cmd_remove_clusters)

    h = s.add_parser("role-hook", help="install the start-up hook that sends Dask roles started without the image's "
                                       "entrypoint (Apptainer exec, --entrypoint '', python -m ...) through it "
                                       "(the Dockerfile runs this)")
    add_output(h, "--dest", kind="dir", metavar="DIR",
               help="the site-packages directory to write the hook's .pth file into (default: this Python's)")
    h.set_defaults(func=_cmd_role_hook)


def _register_image(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("image", help="build the one image for client, scheduler and workers (Docker)")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    p.add_argument("--cache", help=f"build cache directory (default: ${CACHE_ENV} or <checkout>/build/cache)")
    s = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)
    for register in (_register_image_inputs, _register_image_build, _register_image_clusters,
                     _register_image_upkeep):
        register(s)


# --- repro ------------------------------------------------------------------------------------------------------------

def _cmd_normalise(args) -> int:
    st = load(args.stack_file)
    tag = args.tag or args.image
    out = Path(args.out) if args.out else normalise.default_out_dir(default_cache(), tag)
    wheels = normalise.build_wheels(st, default_cache(), args.wheels)
    r = normalise.normalise_image(st, args.image, out, tag=tag, keep_archive=args.keep_archive, wheels=wheels,
                                  with_sbom=not args.no_sbom, load=not args.no_load)
    print(f"image     {r.tag}")
    print(f"id        {r.image_id}   (was {r.source_image_id})")
    print(f"archive   sha256:{r.archive_sha256}" + (f"  {r.archive}" if r.archive else ""))
    print(f"manifest  {r.manifest_digest}")
    print(f"output    {r.out_dir}")
    return 0


def _cmd_rootfs(args) -> int:
    st = load(args.stack_file)
    res = normalise_rootfs_tar(Path(args.src), Path(args.dest), st.source_date_epoch)
    print(f"{args.dest}: {res.diff_id} ({len(res.entries)} entries, {len(res.dropped)} dropped, "
          f"{len(res.rewritten)} rewritten)")
    return 0


def _cmd_compare(args) -> int:
    """Print the comparison, write it as JSON when asked, and fail (exit 30) unless the two builds are identical."""
    r = compare(Path(args.a), Path(args.b), limit=args.limit)
    print(render_compare(r))
    if args.json:
        write_output_file(args.json, json.dumps(r, indent=2, sort_keys=True) + "\n", what="the comparison")
    if not r["identical"]:
        raise UserError(f"not reproducible: {r['a']['image_id']} != {r['b']['image_id']} (first differences above)",
                        NOT_REPRODUCIBLE)
    return 0


def _register_repro(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repro", help="reproducible image: normalise a built image, compare two builds")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="repro_command", metavar="ACTION", required=True)
    n = s.add_parser("normalise", help="docker save IMAGE, normalise layers + config, add the SBOM, docker load")
    n.add_argument("image")
    n.add_argument("--tag", help="tag the normalised image (default: IMAGE)")
    add_output(n, "--out", kind="dir", help="output directory (default: <build cache>/image/out/<tag>)")
    n.add_argument("--wheels", action="append", default=[], metavar="PATH",
                   help="wheels / wheelhouse directories the image was installed from (exact hashes in the SBOM)")
    n.add_argument("--keep-archive", action="store_true",
                   help=f"keep the OCI/docker archive as OUT/{normalise.ARCHIVE}")
    n.add_argument("--no-sbom", action="store_true", help="do not add the SBOM layer")
    n.add_argument("--no-load", action="store_true", help="do not docker load the result")
    n.set_defaults(func=_cmd_normalise)
    r = s.add_parser("rootfs", help="normalise a root filesystem tar (debootstrap): order, mtimes, owners, litter, "
                                    ".pyc headers, shadow dates")
    r.add_argument("src")
    add_output(r, "dest", help="the normalised tar to write")
    r.set_defaults(func=_cmd_rootfs)
    c = s.add_parser("compare", help="compare two normalised build outputs; name the first differing files")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--limit", type=int, default=10, help="differences listed per layer and kind")
    add_output(c, "--json", metavar="FILE", help="also write the comparison as JSON")
    c.set_defaults(func=_cmd_compare)


# --- sbom -------------------------------------------------------------------------------------------------------------

def _read(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}", USAGE) from None


def _from_image(image: str, path: str) -> str:
    return docker(["run", "--rm", "--network", "none", "--entrypoint", "cat", image, path], code=SBOM_MISMATCH,
                  what=f"reading {path} from {image}").stdout


def _cmd_sbom_check(args) -> int:
    st = load(args.stack_file)
    if args.image:
        text = _read(args.sbom, "SBOM") if args.sbom else _from_image(args.image, "/" + sbommod.SBOM_IN_IMAGE)
        status = _from_image(args.image, "/var/lib/dpkg/status")
        info_text = _from_image(args.image, f"{st.image.ucx_prefix}/{BUILD_INFO}")
        ucxx_text = _from_image(args.image, f"{st.image.venv}/{INSTALLED_UCXX_BUILD_INFO}")
    else:
        if not args.sbom:
            raise UserError("sbom check: give an SBOM file, --image IMAGE, or both", USAGE)
        text = _read(args.sbom, "SBOM")
        status = _read(args.dpkg_status, "dpkg status")
        info_text = _read(args.build_info, "build info")
        ucxx_text = _read(args.ucxx_build_info, "UCXX build info")
    err = sbommod.validate(text)
    if err:
        raise UserError(f"SBOM is not valid CycloneDX 1.6: {err}", SBOM_INVALID)
    doc = json.loads(text)
    problems = sbommod.check_sbom(doc, pins=load_lock(st.lock_path()), dpkg_status=status,
                                  build_info=json.loads(info_text) if info_text else None,
                                  ucxx_info=json.loads(ucxx_text) if ucxx_text else None,
                                  extra_dists={canonical(n) for n in args.allow_extra} | {canonical(st.name)})
    for p in problems:
        print(p)
    if problems:
        raise UserError(f"SBOM disagrees with its sources: {problems[0]} ({len(problems)} problem(s))", SBOM_MISMATCH)
    kinds = Counter((c.get("purl") or "pkg:other/").split(":", 1)[1].split("/", 1)[0]
                    for c in doc.get("components", []))
    print(f"SBOM valid (CycloneDX {doc.get('specVersion')}) and consistent: " +
          ", ".join(f"{n} {t}" for t, n in sorted(kinds.items())))
    return 0


def _cmd_sbom_generate(args) -> int:
    st = load(args.stack_file)
    gen, gen_version = sbommod.generator(st)
    files: dict[str, bytes] = {}
    for d in args.site_packages:
        for meta in sorted(Path(d).glob("*.dist-info/METADATA")):
            files[str(meta.relative_to("/") if meta.is_absolute() else meta)] = meta.read_bytes()
    info_text = _read(args.build_info, "build info")
    data = sbommod.build_sbom(
        name=st.image.name, version=st.version, epoch=st.source_date_epoch,
        dpkg_status=_read(args.dpkg_status, "dpkg status"), os_release=_read(args.os_release, "os-release"),
        dists=sbommod.dists_from_files(files), pins=load_lock(st.lock_path()),
        build_info=json.loads(info_text) if info_text else None,
        build_info_sha256=hashlib.sha256(info_text.encode()).hexdigest() if info_text else None,
        ucx_repository=st.conda.about.ucx_dev_url, tools={gen: gen_version, st.name: st.version})
    if write_output_file(args.output, data, what="the SBOM"):
        print(f"wrote {args.output}")
    return 0


def _register_sbom(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sbom", help="CycloneDX SBOM of the image: generate, validate and cross-check")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="sbom_command", metavar="ACTION", required=True)
    c = s.add_parser("check", help="validate against the CycloneDX 1.6 schema and cross-check with the lock, the "
                                   "dpkg status and the UCX build info")
    c.add_argument("sbom", nargs="?", help="SBOM file (default with --image: the one inside the image)")
    c.add_argument("--image", help="read the SBOM, dpkg status and UCX build info from this image")
    c.add_argument("--dpkg-status", help="dpkg status file to compare with (without --image)")
    c.add_argument("--build-info", help="UCX build-info.json to compare with (without --image)")
    c.add_argument("--ucxx-build-info", help="UCXX ucxx-build-info.json to compare with (without --image)")
    c.add_argument("--allow-extra", action="append", default=[], metavar="NAME",
                   help="a Python distribution that may be installed without being in the lock (repeatable)")
    c.set_defaults(func=_cmd_sbom_check)
    g = s.add_parser("generate", help="SBOM of this host's files (bare-metal installs); images get theirs from "
                                      "`repro normalise`")
    g.add_argument("--dpkg-status", default="/var/lib/dpkg/status")
    g.add_argument("--os-release", default="/usr/lib/os-release")
    g.add_argument("--build-info", help="the UCX prefix's share/ucx-dask-gpu/build-info.json")
    g.add_argument("--site-packages", action="append", default=[], metavar="DIR")
    add_output(g, "-o", "--output", default="-", stdout_dash=True, metavar="FILE",
               help="where to write the SBOM ('-', the default: stdout)")
    g.set_defaults(func=_cmd_sbom_generate)


def register(sub: argparse._SubParsersAction) -> None:
    _register_image(sub)
    _register_repro(sub)
    _register_sbom(sub)

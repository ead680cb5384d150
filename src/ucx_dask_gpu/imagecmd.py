"""`ucx-dask-gpu image …`: the Docker engine, the image's verified inputs, the bases and the build itself."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

CACHE_ENV = "UCX_DASK_GPU_BUILD_CACHE"
UCXX_WHEELS_ENV = "UCXX_WHEELS"


def default_cache() -> Path:
    """$UCX_DASK_GPU_BUILD_CACHE, else <checkout>/build/cache (ignored by git; reused by warm rebuilds)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    from .dockerutil import repo_root

    return repo_root() / "build" / "cache"


def default_ucxx_wheels() -> Path:
    """$UCXX_WHEELS (the Makefile's), else <checkout>/build/ucxx-wheels: where `make ucxx` puts the UCXX wheels."""
    env = os.environ.get(UCXX_WHEELS_ENV)
    if env:
        return Path(env)
    from .dockerutil import repo_root

    return repo_root() / "build" / "ucxx-wheels"


def _stack(args):
    from .stack import load

    return load(args.stack_file)


def _cache(args) -> Path:
    return Path(args.cache) if args.cache else default_cache()


def _cmd_engine(args) -> int:
    from .dockerutil import ensure_engine

    print(f"Docker engine {ensure_engine(allow_start=not args.no_start)}")
    return 0


def _cmd_wheelhouse(args) -> int:
    from .wheelhouse import build_own_wheel, ensure_wheelhouse

    st = _stack(args)
    dest = ensure_wheelhouse(st, _cache(args), lock_path=args.lock,
                             find_links=Path(args.find_links) if args.find_links else None)
    print(dest)
    if not args.no_own_wheel:
        print(build_own_wheel(st, _cache(args) / "pkg"))
    return 0


def _cmd_base(args) -> int:
    from .baseimage import KINDS, base_from_image, ensure_base
    from .dockerutil import engine_version

    st = _stack(args)
    engine_version()
    for kind in (KINDS if args.kind == "all" else (args.kind,)):
        if args.from_image:
            print(base_from_image(st, kind, args.from_image))
        else:
            print(ensure_base(st, kind, _cache(args), force=args.force))
    return 0


def _cmd_build(args) -> int:
    from .imagebuild import build_image

    st = _stack(args)
    ucxx = Path(args.ucxx_wheels) if args.ucxx_wheels else default_ucxx_wheels()
    result = build_image(st, _cache(args), ucxx, tag=args.tag, extra_wheels=[Path(w) for w in args.extra_wheel],
                         base_from=args.base_from, normalise=not args.no_normalise)
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


def run_demo(image: str, protocols: list[str], workers: int = 2) -> list[dict]:
    """Per protocol: start the 3-role cluster, run transpose + from-map from a client container, stop cleanly."""
    from .dockercluster import Cluster

    rows = []
    for proto in protocols:
        cluster = Cluster(image, protocol=proto, n_workers=workers).start()
        try:
            transpose = cluster.workload("transpose")
            from_map = cluster.workload("from-map", "/data/from-map")
        finally:
            stopped = cluster.stop()
        logs = keep_logs(stopped, cluster.name) if stopped["tracebacks"] else None
        rows.append({"protocol": proto, "transpose": transpose, "from_map": from_map,
                     "tracebacks": stopped["tracebacks"], "exit_codes": stopped["exit_codes"], "logs": logs})
    return rows


def keep_logs(stopped: dict, name: str) -> str:
    """Write every container log of a cluster that logged a traceback (they are gone with the containers)."""
    from .fsutil import atomic_write_text

    where = default_cache().parent / "cluster-logs" / name
    for container, log in stopped["logs"].items():
        atomic_write_text(where / f"{container}.log", log)
    return str(where)


def render_demo(rows: list[dict]) -> str:
    head = f"{'protocol':8}  {'transpose 4000^2':18}  {'from-map columns read':22}  {'versions':9}  shutdown"
    lines = [head, "-" * len(head)]
    for r in rows:
        t, f = r["transpose"], r["from_map"]
        cols = " / ".join(",".join(c) for c in f["columns_read"]) or "none"
        transpose = f"{'ok' if t['ok'] else 'WRONG'} {t['wall_s']:.2f} s"
        read = f"{cols} {'ok' if f['ok'] else 'WRONG'}"
        versions = "same" if t["versions_identical"] else "DIFFER"
        shutdown = "clean" if not r["tracebacks"] else "tracebacks: " + ", ".join(r["tracebacks"])
        lines.append(f"{r['protocol']:8}  {transpose:18}  {read:22}  {versions:9}  {shutdown}")
    return "\n".join(lines)


def _cmd_demo(args) -> int:
    from .dockerutil import engine_version
    from .errors import VERDICT_FAILED

    st = _stack(args)
    engine_version()
    image = args.image or f"{st.image.name}:{st.version}"
    rows = run_demo(image, args.protocol or ["ucx", "tcp"], args.workers)
    print(render_demo(rows))
    for r in rows:
        if r["logs"]:
            print(f"{r['protocol']}: container logs kept in {r['logs']}")
    ok = all(r["transpose"]["ok"] and r["from_map"]["ok"] and r["transpose"]["versions_identical"]
             and not r["tracebacks"] for r in rows)
    if args.json:
        from .fsutil import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=2, sort_keys=True) + "\n")
    return 0 if ok else VERDICT_FAILED


def _cmd_remove_clusters(args) -> int:
    from .dockercluster import remove_all_clusters
    from .dockerutil import engine_version

    engine_version()
    print(f"removed {remove_all_clusters()} container(s)/volume(s)/network(s) of ucx-dask-gpu clusters")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("image", help="build the one image for client, scheduler and workers (Docker)")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    p.add_argument("--cache", help=f"build cache directory (default: ${CACHE_ENV} or <checkout>/build/cache)")
    s = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    e = s.add_parser("engine", help="make sure a Docker engine answers; start Debian's dockerd when none does (root)")
    e.add_argument("--no-start", action="store_true", help="only check; never install or start an engine")
    e.set_defaults(func=_cmd_engine)

    w = s.add_parser("wheelhouse", help="download + verify every wheel of the hashed lock, and build our own wheel")
    w.add_argument("--lock", type=Path, help="hashed requirements to fetch (default: stack.toml [python].lock)")
    w.add_argument("--find-links", metavar="DIR", help="take wheels from DIR instead of PyPI (no index)")
    w.add_argument("--no-own-wheel", action="store_true", help="skip building the ucx-dask-gpu wheel")
    w.set_defaults(func=_cmd_wheelhouse)

    b = s.add_parser("base", help="debootstrap + import the Debian base images (skipped when up to date)")
    b.add_argument("--kind", choices=["runtime", "builder", "all"], default="all")
    b.add_argument("--force", action="store_true", help="bootstrap again even when the image is up to date")
    b.add_argument("--from", dest="from_image", metavar="IMAGE",
                   help="build the bases from this registry image instead (e.g. debian:bookworm-slim@sha256:...)")
    b.set_defaults(func=_cmd_base)

    bd = s.add_parser("build", help="fetch + verify every input, then docker build --network none")
    bd.add_argument("--tag", help="image tag (default: [image].name:[stack].version)")
    bd.add_argument("--extra-wheel", action="append", default=[], metavar="WHL",
                    help="install this wheel on top of the lock (a deliberately different image: its stack id "
                         "differs); repeatable")
    bd.add_argument("--base-from", metavar="IMAGE",
                    help="derive both bases from this registry image with apt (e.g. "
                         "debian:bookworm-slim@sha256:...) instead of debootstrap")
    bd.add_argument("--ucxx-wheels", metavar="DIR",
                    help="the UCXX wheels to install (`make ucxx`; default: $UCXX_WHEELS or build/ucxx-wheels)")
    bd.add_argument("--json", action="store_true", help="print the result as JSON")
    bd.add_argument("--no-normalise", action="store_true",
                    help="keep docker build's own image: not reproducible, no SBOM (see `ucx-dask-gpu repro`)")
    bd.set_defaults(func=_cmd_build)

    d = s.add_parser("demo", help="scheduler + workers + client from the image on an internal network: run the "
                                  "transpose and from-map workloads over ucx and tcp, report, stop")
    d.add_argument("--image", help="image to run (default: [image].name:[stack].version)")
    d.add_argument("--protocol", action="append", choices=["ucx", "tcp", "tls"],
                   help="protocol(s) to run (default: ucx and tcp)")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--json", metavar="FILE", help="also write the full results to FILE")
    d.set_defaults(func=_cmd_demo)

    r = s.add_parser("remove-clusters", help="remove every container/volume/network left by clusters of ours "
                                            "(after an interrupted run; also ends running ones)")
    r.set_defaults(func=_cmd_remove_clusters)

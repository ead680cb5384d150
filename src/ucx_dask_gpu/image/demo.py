"""`ucx-dask-gpu image demo`: per protocol, the 3-role cluster from the image runs the client workloads, reports and
stops cleanly; the container logs of a cluster that logged a traceback are kept."""
from __future__ import annotations

from ..fsutil import atomic_write_text
from .cluster import Cluster
from .paths import default_cache


def run_demo(image: str, protocols: list[str], workers: int = 2, **host) -> list[dict]:
    """Per protocol: start the 3-role cluster, run transpose + from-map from a client container, stop cleanly.
    `host`: the GPU-host settings of `Cluster` (gpu, gpus, infiniband, cma); GPU workers compute on CuPy blocks."""
    rows = []
    backend = ["--backend", "cupy"] if host.get("gpu") else []
    for proto in protocols:
        cluster = Cluster(image, protocol=proto, n_workers=workers, **host).start()
        try:
            transpose = cluster.workload("transpose", *backend)
            from_map = cluster.workload("from-map", "/data/from-map")
        finally:
            stopped = cluster.stop()
        logs = keep_logs(stopped, cluster.name) if stopped["tracebacks"] else None
        rows.append({"protocol": proto, "transpose": transpose, "from_map": from_map,
                     "tracebacks": stopped["tracebacks"], "exit_codes": stopped["exit_codes"], "logs": logs})
    return rows


def keep_logs(stopped: dict, name: str) -> str:
    """Write every container log of a cluster that logged a traceback (they are gone with the containers)."""
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


def demo_ok(rows: list[dict]) -> bool:
    return all(r["transpose"]["ok"] and r["from_map"]["ok"] and r["transpose"]["versions_identical"]
               and not r["tracebacks"] for r in rows)

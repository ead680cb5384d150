"""`ucx-dask-gpu doctor`: what this environment really uses, one section per concern (UCX, UCXX, CUDA, GPUs, the
transports a Dask process will use, the dask config in force, the stack id); docs/building.md says what each shows.

Library probes run in child processes: loading two UCX builds into one process would let the first libucs.so.0
satisfy the second's dependency and report a mix. The probe of a prefix runs without site initialisation (`-S`), so a
venv's start-up preload of its own UCX (ucxbuild.ucxx.install_ucxx) does not pre-empt the prefix asked for.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from .. import nvml
from ..errors import UserError
from ..fsutil import sha256_file
from ..gate import identity
from ..gate.daskconfig import collect_for, in_force, search_path_for
from ..report import format_table
from ..stack import Stack, load
from . import info as ucxinfo
from . import transports
from .install import (BUILD_INFO, SHARE, UCXX_BUILD_INFO, at, choose, prefix_of_library, read_build_info,
                      read_ucxx_build_info, ucxx_can_use)


# Runs in a child: load UCX (a path/soname, or by importing UCXX as Dask does), then report which files the loader
# mapped and the version libucp itself reports. It finds this package at the path it is given (`-S`: no site).
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_PROBE = r"""
import ctypes, json, sys
mode, target = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
from ucx_dask_gpu.fsutil import mapped_library
del sys.path[0]
out = {}
try:
    if mode == "ucxx":
        import ucxx
        out["ucxx_file"] = ucxx.__file__
        out["ucx_version_from_ucxx"] = ".".join(map(str, ucxx.get_ucx_version()))
    else:
        ctypes.CDLL(target, ctypes.RTLD_LOCAL)
except ModuleNotFoundError as e:
    out["missing"] = str(e.name)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
libs = {name: path for name in ("libucp.so", "libucs.so", "libuct.so", "libucm.so")
        if (path := mapped_library(name)) is not None}
out["libraries"] = libs
if "libucp.so" in libs:
    fn = ctypes.CDLL(libs["libucp.so"], ctypes.RTLD_LOCAL).ucp_get_version_string
    fn.restype = ctypes.c_char_p
    out["version"] = fn().decode()
print(json.dumps(out))
"""


def _probe(mode: str, target: str, env: dict | None = None) -> dict:
    isolated = ["-S"] if mode == "load" else []  # loading a prefix needs only ctypes; importing UCXX needs site
    try:
        proc = subprocess.run([sys.executable, *isolated, "-c", _PROBE, mode, target, PACKAGE_PARENT],
                              capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "probe timed out"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": f"probe failed: {last}"}


# --- sections --------------------------------------------------------------------------------------------------

def stack_id() -> dict:
    """This environment's stack id, computed from its installed distributions as the guard computes it."""
    return {"id": identity.stack_id(), "source": "computed from this environment's installed distributions "
                                                 "(`ucx-dask-gpu guard show`)"}


def unresolved_libraries(path: Path) -> list[str]:
    """Sonames `ldd` cannot resolve for `path` in this environment (empty when all resolve or ldd is absent)."""
    try:
        proc = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({line.split("=>")[0].strip() for line in proc.stdout.splitlines() if "=> not found" in line})


def ucx_section(prefix_arg: str | None, st: Stack | None) -> dict:
    inst, how = choose(prefix_arg, st.image.ucx_prefix if st else None)
    prefix = inst.prefix if inst else None
    target = str(prefix / "lib" / "libucp.so.0") if prefix else "libucp.so.0"
    probe = _probe("load", target)
    libs = probe.get("libraries", {})
    loaded_prefix = prefix_of_library(libs.get("libucp.so"))
    out: dict = {"prefix": str(prefix) if prefix else None, "found_via": how, "requested": target,
                 "version": probe.get("version"), "libraries": libs, "error": probe.get("error")}
    dirs = {str(Path(p).parent) for p in libs.values()}
    out["mixed_builds"] = len(dirs) > 1  # e.g. LD_LIBRARY_PATH pulling another libucs.so.0 under our libucp
    info = read_build_info(loaded_prefix)
    out["ours"] = info is not None
    out["build_info"] = None if info is None else {
        "ucx_version": info.get("ucx_version"),
        "source": " ".join(filter(None, (info.get("source", {}).get(k) for k in ("tag", "commit")))),
        "patches": [p.get("name") for p in info.get("patches", [])],
        "capabilities_required": info.get("capabilities", {}).get("required")}
    base = loaded_prefix or prefix
    # UCX looks for modules in <directory of libucs.so>/ucx (dladdr), wherever that is.
    moddir = Path(libs["libucs.so"]).parent / "ucx" if "libucs.so" in libs else base / "lib" / "ucx" if base else None
    out["module_dir"] = str(moddir) if moddir else None
    out["modules"] = sorted(p.name for p in moddir.glob("*.so")) if moddir else []
    # A module whose dependencies do not resolve is skipped by UCX without a word (e.g. libuct_cuda.so without
    # libcudart.so.13 on the loader path): say which, and what it lacks.
    out["modules_unloadable"] = {m: missing for m in out["modules"]
                                 if (missing := unresolved_libraries(moddir / m))}  # type: ignore[operator]
    try:
        exe = (at(base).ucx_info if base else None) or ucxinfo.find_ucx_info()
        d = ucxinfo.devices(exe)
        out["ucx_info"] = str(exe)
        out["transports"] = d.transports
        out["devices"] = {t: d.devices(t) for t in d.transports}
    except UserError as e:
        out["ucx_info"], out["transports"], out["devices"] = None, [], {}
        out["ucx_info_error"] = str(e)
    return out


def _dist(*names: str):
    for n in names:
        try:
            return metadata.distribution(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def ucxx_provenance(share: Path | None = None) -> dict:
    """Are the installed UCXX libraries the ones our build made? Compares each shared library recorded in
    <sys.prefix>/share/ucx-dask-gpu/ucxx-build-info.json (or the one in `share`) with the installed file, by
    sha256."""
    share = share or Path(sys.prefix) / SHARE
    path = share / UCXX_BUILD_INFO
    info = read_ucxx_build_info(share)
    if info is None:
        return {"from_source": False, "why": f"no {path}"}
    differing, checked = [], 0
    for pkg in info.get("packages", []):
        dist = _dist(pkg["name"])
        if dist is None:
            differing.append(f"{pkg['name']} not installed")
            continue
        if dist.version != pkg["version"]:
            differing.append(f"{pkg['name']} {dist.version} installed, {pkg['version']} built")
            continue
        for rel, sha in pkg.get("shared_libraries", {}).items():
            installed = Path(str(dist.locate_file(rel)))
            checked += 1
            if not installed.is_file() or sha256_file(installed) != sha:
                differing.append(f"{rel} differs from the build")
    return {"from_source": not differing and checked > 0, "build_info": str(path), "checked": checked,
            "ucxx_source": (info.get("sources") or {}).get("UCXX", {}).get("tag"), "differing": differing,
            "built_against_ucx": (info.get("ucx") or {}).get("version")}


def ucxx_section(st: Stack | None) -> dict:
    ucxx = _dist("ucxx-cu13", "ucxx-cu12", "ucxx")
    dask_ucxx = _dist("distributed-ucxx-cu13", "distributed-ucxx-cu12", "distributed-ucxx")
    libucx = _dist("libucx-cu13", "libucx-cu12", "libucx")
    out = {"ucxx_version": ucxx.version if ucxx else None,
           "distributed_ucxx_version": dask_ucxx.version if dask_ucxx else None,
           "libucx_wheel_version": libucx.version if libucx else None}
    probe = _probe("ucxx", "-")
    if probe.get("missing"):
        out.update(loaded=None, runs_on="none", statement=f"UCXX: not installed (no module {probe['missing']!r})")
        return out
    libs = probe.get("libraries", {})
    ucp = libs.get("libucp.so")
    out.update(loaded=ucp, version=probe.get("version"), error=probe.get("error"),
               provenance=ucxx_provenance())
    ucp_prefix = prefix_of_library(ucp)
    wheel = ucp is not None and f"{os.sep}libucx{os.sep}" in ucp
    is_ours = ucp is not None and read_build_info(ucp_prefix) is not None
    v = probe.get("version")
    prov = out["provenance"]
    what = f"UCXX {out['ucxx_version']}" + (" (built from source)" if prov["from_source"] else
                                            f" (NOT our build: {'; '.join(prov.get('differing') or [prov.get('why', '')])})")
    if ucp is None:
        out["runs_on"] = "none"
        statement = f"UCXX: could not load any UCX ({probe.get('error') or 'no libucp mapped'})"
    elif is_ours:
        out["runs_on"] = "ours"
        statement = f"{what} on our UCX {v} ({ucp})"
    elif wheel:
        out["runs_on"] = "wheel"
        statement = f"{what} on the libucx WHEEL's UCX {v} ({ucp}), NOT ours: uninstall libucx-cu* (its loader wins)"
    else:
        out["runs_on"] = "other"
        statement = f"{what} on a UCX that is neither ours nor a wheel's: {v} ({ucp})"
    if v and st is not None and not ucxx_can_use(st, v):
        statement += f"; UCXX refuses UCX < {st.ucxx.min_ucx} at import, so `import ucxx` fails"
    out["statement"] = statement
    return out


def cuda_section() -> dict:
    out: dict = {}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        rc = lib.cuDriverGetVersion(ctypes.byref(v))
        out["driver_api"] = f"{v.value // 1000}.{v.value % 1000 // 10}" if rc == 0 else f"error {rc}"
    except OSError:
        out["driver_api"] = None
        out["driver_note"] = "no CUDA driver (libcuda.so.1 not loadable)"
    rt = _find_cudart()
    if rt:
        try:
            lib = ctypes.CDLL(rt)
            v = ctypes.c_int()
            rc = lib.cudaRuntimeGetVersion(ctypes.byref(v))
            out["runtime"] = f"{v.value // 1000}.{v.value % 1000 // 10}" if rc == 0 else f"error {rc}"
            out["runtime_library"] = rt
        except OSError as e:
            out["runtime"], out["runtime_note"] = None, f"{rt}: {e}"
    else:
        out["runtime"], out["runtime_note"] = None, "no libcudart found (loader path or nvidia-cuda-runtime wheel)"
    return out


def _find_cudart() -> str | None:
    for soname in ("libcudart.so.13", "libcudart.so.12"):
        try:
            ctypes.CDLL(soname)
            return soname
        except OSError:
            continue
    try:
        import nvidia  # optional: the namespace package of the nvidia-* wheels, only to find their files

        for base in getattr(nvidia, "__path__", []):
            for p in sorted(Path(base).glob("cu*/lib/libcudart.so.*")) + sorted(Path(base).glob("cuda_runtime/lib/libcudart.so.*")):
                return str(p)
    except ImportError:
        pass
    return None


def gpu_section() -> dict:
    try:
        gpus = nvml.discover()
        driver = nvml.driver_version()
    except UserError as e:
        return {"status": f"no GPU ({e})", "driver": None, "gpus": []}
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    return {
        "status": f"{len(gpus)} GPU(s)",
        "driver": driver,
        "gpus": [{"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid,
                  "nvlink_links": len(g.links),
                  "nvlink_peers": {str(by_bus.get(bus, bus)): n for bus, n in sorted(g.nvlink_peers.items())},
                  "link_speed_gbps": g.link_speed_gbps} for g in gpus],
    }


def transports_section(ucx: dict) -> dict:
    """What a Dask process started here, with this environment's dask config and variables, will use."""
    prefix = prefix_of_library(ucx["libraries"].get("libucp.so")) or ucx.get("prefix")
    try:
        config = collect_for(os.environ)
    except ImportError:  # no dask here: only the environment's UCX_TLS can set transports
        config = {}
    plan, host, why = transports.observe(config, os.environ, ucx_prefix=prefix)
    out = plan.as_dict()
    out.update(summary=transports.summary(plan, host), host=host.as_dict(), ucx_info_error=why)
    return out


def config_section() -> dict:
    """The dask config a Dask process started here will have: its files and the shipped tuned settings in it."""
    try:
        report = in_force(collect_for(os.environ), search_path_for(os.environ), os.environ)
    except ImportError:  # no dask here
        return {"line": "- (dask is not installed here)"}
    return report.as_dict() | {"line": report.line()}


def collect(prefix_arg: str | None) -> dict:
    try:
        st = load()
    except UserError:  # no readable stack.toml: the sections report without its UCX prefix and minimum
        st = None
    ucx = ucx_section(prefix_arg, st)
    return {"host": socket.gethostname(), "stack": stack_id(), "ucx": ucx, "ucxx": ucxx_section(st),
            "cuda": cuda_section(), "gpu": gpu_section(), "transports": transports_section(ucx),
            "config": config_section()}


# --- output --------------------------------------------------------------------------------------------------------

def render(r: dict) -> str:
    u, x, c, g, t = r["ucx"], r["ucxx"], r["cuda"], r["gpu"], r["transports"]
    if u.get("version"):
        ucx_line = f"{u['version']} — {u['libraries'].get('libucp.so')}"
    else:
        ucx_line = f"not loadable ({u.get('error') or 'no libucp'}; looked for {u['requested']})"
    built = "-"
    if u.get("build_info"):
        b = u["build_info"]
        built = f"ours: UCX {b['ucx_version']} from {b['source']}" + \
            (f" + {', '.join(b['patches'])}" if b.get("patches") else "")
    elif u.get("version"):
        built = f"not ours (no {BUILD_INFO} next to it)"
    rows = [
        ("stack id", f"{r['stack']['id']}  ({r['stack']['source']})"),
        ("UCX loaded", ucx_line),
        ("UCX found via", u["found_via"]),
        ("UCX build", built),
    ]
    if u.get("mixed_builds"):
        rows.append(("UCX WARNING", "libraries come from different directories: "
                     + ", ".join(f"{k}={v}" for k, v in sorted(u["libraries"].items()))))
    rows += [
        ("UCX transports", " ".join(u["transports"]) or f"- ({u.get('ucx_info_error', 'ucx_info not run')})"),
        ("UCX modules", " ".join(u["modules"]) or "-"),
        *[(f"  {m}", f"NOT loadable here: {', '.join(libs)} not found") for m, libs in u["modules_unloadable"].items()],
        ("UCXX", x["statement"]),
        ("CUDA driver", c.get("driver_api") or c.get("driver_note", "-")),
        ("CUDA runtime", f"{c['runtime']} ({c.get('runtime_library')})" if c.get("runtime")
         else c.get("runtime_note", "-")),
        ("GPUs", g["status"] + (f", driver {g['driver']}" if g.get("driver") else "")),
    ]
    for gpu in g["gpus"]:
        peers = ", ".join(f"GPU{p}×{n}" for p, n in gpu["nvlink_peers"].items()) or "no NVLink"
        rows.append((f"  GPU{gpu['index']}", f"{gpu['name']} {gpu['pci_bus_id']}: {gpu['nvlink_links']} NVLinks "
                                             f"({peers})"))
    tls = "automatic (UCX selects)" if t["automatic"] else f"UCX_TLS={t['ucx_tls']}"
    rows += [
        ("Dask config", r["config"]["line"]),
        ("Dask transports", f"{tls}; {t['source']}"),
        ("  GPU peers, this host", (", ".join(t["gpu_peers"]) or "none") if t["gpu"] else "- (UCX sees no GPU)"),
        ("  this host", ", ".join(t["same_host"]) or "none"),
        ("  other hosts", ", ".join(t["other_hosts"]) or "none"),
        *[("  left out by UCX_TLS", ", ".join(t["off"]))] * bool(t["off"]),
        *[("TRANSPORT CONFLICT", c) for c in t["conflicts"]],
        *[("TRANSPORT WARNING", w) for w in t["warnings"]],
    ]
    if t.get("ucx_info_error"):
        rows.append(("TRANSPORT WARNING", f"cannot list UCX's transports: {t['ucx_info_error']}"))
    return format_table(["item", "value"], rows)

"""The UCX installations verify-nvlink measures: which one (`--ucx-prefix DIR|pip|path`, resolved by ucx/install.py),
the environment its processes get, and what its own ucx_info says it can do (version, protocol tables, transports).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PERFTEST_FAILED, PERFTEST_MISSING, UserError
from ..ucx import info as ucxinfo
from ..ucx import perftest as pt
from ..ucx.install import UcxInstall, locate


@dataclass
class UcxUnderTest:
    """One UCX installation and what its own ucx_info says about it (filled in by `preflight`)."""

    install: UcxInstall
    version: str | None = None
    proto_used: bool = False        # accepts UCX_PROTO_INFO=used
    proto_v2_default: bool = False  # UCX_PROTO_ENABLE default
    transports: list[str] = field(default_factory=list)
    configure_line: str | None = None
    preflight_error: str | None = None  # --keep-going: this UCX could not start; its runs are reported as errors

    @property
    def label(self) -> str:
        return f"{self.install.kind} {self.version or '?'}"

    def describe(self) -> dict:
        kind, info = self.install.kind, self.install.build_info
        src = {"pip": "pip wheel libucx (libucx-cu13)", "path": "ucx_perftest found on PATH"}.get(kind, "prefix")
        if info:
            s = info.get("source") or {}
            src = (f"built from source by ucx-dask-gpu: {s.get('archive', '?')} "
                   f"({'FALLBACK: ' + str(s.get('fallback_reason')) if s.get('fallback') else 'production pin'})")
        return {"version": self.version, "source": src, "prefix": str(self.install.prefix), "kind": kind,
                "proto_info_used": self.proto_used, "proto_v2_default": self.proto_v2_default,
                "transports": self.transports, "configure": self.configure_line,
                "build_info": {k: info.get(k) for k in ("ucx_version", "source", "capabilities")} if info else None}


def resolve_install(spec: str) -> UcxUnderTest:
    """--ucx-prefix value -> a UCX with ucx_perftest. `pip`: the libucx wheel of this Python; `path`: ucx_perftest on
    PATH; `auto`: PATH, then the wheel; anything else: a UCX prefix directory."""
    if spec == "auto":
        for alt in ("path", "pip"):
            try:
                return resolve_install(alt)
            except UserError:
                continue
        raise UserError("ucx_perftest not found: not on PATH and no libucx wheel in this Python; pass --ucx-prefix "
                        "DIR (a UCX install prefix) or --ucx-prefix pip", PERFTEST_MISSING)
    inst = locate(spec, PERFTEST_MISSING)
    if inst.perftest is None:
        raise UserError(f"no executable bin/ucx_perftest in {inst.prefix} "
                        f"({'the libucx wheel' if inst.kind == 'pip' else spec})", PERFTEST_MISSING)
    return UcxUnderTest(inst)


def cuda_runtime_dirs(extra: list[str]) -> list[Path]:
    """Directories holding libcudart.so* for the UCX CUDA modules (a from-source prefix links them against it)."""
    cands = [Path(e) for e in extra]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands += [Path(os.environ[env]) / "lib64", Path(os.environ[env]) / "targets/x86_64-linux/lib"]
    cands += [Path("/usr/local/cuda/targets/x86_64-linux/lib"), Path("/usr/local/cuda/lib64")]
    try:
        spec = importlib.util.find_spec("nvidia")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cands += sorted(Path(loc).glob("cu*/lib")) + sorted(Path(loc).glob("cuda_runtime/lib"))
    except (ImportError, ValueError):
        pass
    out = []
    for d in cands:
        if d.is_dir() and any(d.glob("libcudart.so*")) and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def child_env(inst: UcxUnderTest, cuda_dirs: list[Path], ucx_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    ld = [str(d) for d in inst.install.lib_dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    ld += [str(d) for d in cuda_dirs]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(ld))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(ucx_env)
    return env


def _run_tool(cmd: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def preflight(inst: UcxUnderTest, env: dict[str, str]) -> None:
    """Version, protocol-info capability and transports of one UCX, through its own ucx_info, under the environment
    perftest will get. A UCX that cannot start or has no CUDA transport ends the run here (PERFTEST_FAILED)."""
    exe, prefix = inst.install.ucx_info, inst.install.prefix
    if exe is None:
        return
    r = _run_tool([str(exe), "-v"], env)
    if r.returncode != 0:
        raise UserError(f"UCX at {prefix} does not start (ucx_info -v exit {r.returncode}): "
                        f"{pt.error_line(r.stdout + r.stderr) or 'no output'}", PERFTEST_FAILED)
    try:
        v = ucxinfo.parse_version(r.stdout)
        inst.version, inst.configure_line = v.version, v.configure_line
    except ValueError:
        inst.version = None
    c = _run_tool([str(exe), "-c"], env)
    inst.proto_v2_default = pt.truthy(pt.config_value(c.stdout, "PROTO_ENABLE"))
    u = _run_tool([str(exe), "-c"], {**env, "UCX_PROTO_INFO": "used"})
    inst.proto_used = pt.accepts_proto_info_used(u.stdout, inst.version)
    d = _run_tool([str(exe), "-d"], env)
    devs = ucxinfo.parse_devices(d.stdout)
    inst.transports = devs.transports
    if d.returncode != 0 or not any(t.startswith("cuda") for t in inst.transports):
        why = (pt.error_line(d.stderr) if d.stderr.strip() else None) or \
            "no CUDA driver/GPU visible to it, or its CUDA modules did not load"
        raise UserError(f"UCX {inst.version or '?'} at {prefix} lists no CUDA transport in `ucx_info -d` "
                        f"(transports: {', '.join(inst.transports) or 'none'}): {why}", PERFTEST_FAILED)


def evidence_mode(inst: UcxUnderTest, env: dict[str, str], forced: str = "auto") -> str:
    if forced == "lanes":
        return "lanes"
    v2 = pt.truthy(env["UCX_PROTO_ENABLE"]) if "UCX_PROTO_ENABLE" in env else inst.proto_v2_default
    if v2:
        return "proto-used" if inst.proto_used else "proto-selected"
    return "lanes"


EVIDENCE_ENV = {"proto-used": {"UCX_PROTO_INFO": "used"}, "proto-selected": {"UCX_PROTO_INFO": "y"},
                "lanes": {"UCX_LOG_LEVEL": "info"}}

"""Checks on an installed UCX prefix, shared by `ucx verify` and the integration tests.

Everything runs with LD_LIBRARY_PATH removed, so a pass also proves the prefix finds its own libraries and modules
(RUNPATH relative to $ORIGIN, modules relative to libucs).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import PERFTEST_MISSING, UCX_NOT_FOUND, UserError
from ..stack import Stack
from ..ucx import info as ucxinfo
from ..ucx import perftest
from ..ucx.install import BUILD_INFO, read_build_info

# Host-memory transports every Linux build must offer (shared memory x3 + TCP).
HOST_TRANSPORTS = ("tcp", "posix", "sysv", "cma")
LOOPBACK_SIZE = 1 << 20
LOOPBACK_ITERATIONS = 1000


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def clean_env(extra: dict[str, str] | None = None, keep_ld_library_path: bool = False) -> dict[str, str]:
    """The caller's environment without loader overrides and UCX_* settings (they would decide the outcome).
    keep_ld_library_path: for hosts that provide system libraries (libnuma, libibverbs) from a private directory."""
    drop = ("LD_PRELOAD",) if keep_ld_library_path else ("LD_LIBRARY_PATH", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("UCX_")}
    env.update(extra or {})
    return env


def perftest_loopback(prefix: Path, *, size: int = LOOPBACK_SIZE, iterations: int = LOOPBACK_ITERATIONS,
                      timeout: float = 120, env: dict[str, str] | None = None, test: str = "tag_bw",
                      memory: str = "host") -> tuple[perftest.PerftestResult, str]:
    """Server + client ucx_perftest on 127.0.0.1 (`memory`: host, or cuda on a GPU host). Returns the client's
    result and output."""
    exe = prefix / "bin" / "ucx_perftest"
    if not exe.is_file():
        raise UserError(f"no ucx_perftest in {prefix / 'bin'}", PERFTEST_MISSING)
    env = env if env is not None else clean_env()
    with tempfile.TemporaryDirectory(prefix="ucx-verify-") as tmp:
        args = ["-t", test, "-s", str(size), "-n", str(iterations)] + (["-m", memory] if memory != "host" else [])
        out = perftest.run_pair(exe, args, env, env, Path(tmp), timeout=timeout)
    return perftest.result_or_raise(out, f"loopback, {memory} memory"), out.client_out


def verify_prefix(prefix: Path, stack: Stack, *, modules: tuple[str, ...] | None = None,
                  perftest: bool = True, keep_ld_library_path: bool = False) -> list[Check]:
    """All checks; never raises for a failed check (each is reported), only for unusable input."""
    if not prefix.is_dir():
        raise UserError(f"--prefix {prefix}: no such directory", UCX_NOT_FOUND)
    prefix = prefix.resolve()
    env = clean_env(keep_ld_library_path=keep_ld_library_path)
    checks: list[Check] = []
    info = read_build_info(prefix)
    checks.append(Check("build-info", info is not None,
                        f"{BUILD_INFO}: UCX {info['ucx_version']} from "
                        f"{info['source'].get('url') or info['source']['archive']}"
                        if info else f"no {BUILD_INFO}"))

    wanted = modules if modules is not None else stack.required_modules
    present = sorted(p.name for p in (prefix / "lib" / "ucx").glob("*.so"))
    missing = [m for m in wanted if m not in present]
    checks.append(Check("modules", not missing, f"missing {', '.join(missing)}" if missing
                        else f"lib/ucx: {' '.join(present)}"))

    try:
        exe = ucxinfo.find_ucx_info(prefix)
        v = ucxinfo.version(exe, env=env)
        expected = info["ucx_version"] if info else None
        ok = v.version == (expected or stack.ucx.version)
        checks.append(Check("ucx_info -v", ok, f"UCX {v.version}" + ("" if ok else
                            f", expected {expected or stack.ucx.version}")))
        d = ucxinfo.devices(exe, env=env)
        absent = [t for t in HOST_TRANSPORTS if t not in d.transports]
        checks.append(Check("ucx_info -d", not absent, f"transports: {' '.join(d.transports)}"
                            + (f"; missing {' '.join(absent)}" if absent else "")))
    except UserError as e:
        checks.append(Check("ucx_info", False, str(e)))

    if perftest:
        try:
            res, _ = perftest_loopback(prefix, env=env)
            checks.append(Check("ucx_perftest tag_bw (host, 127.0.0.1)", res.bw_overall_mbs > 0,
                                f"{res.gbps:.2f} GB/s, {res.iterations} x {LOOPBACK_SIZE >> 20} MiB"))
        except UserError as e:
            checks.append(Check("ucx_perftest tag_bw (host, 127.0.0.1)", False, str(e)))
    return checks

"""Run and parse `ucx_info`: `-v` (version, configure line) and `-d` (memory domains, transports, devices).

Shared by `ucx verify`, `doctor` and verify-nvlink. Standard library only: the UCX build runs it with a bare python3.
The parsers take text so they are tested on recorded output (tests/fixtures/ucx_info/).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UCX_NOT_FOUND, UserError
from . import install

# 1.13: "# Version 1.13.1"; 1.15+: "# Library version: 1.21.0" (+ "# Library path: ...", "# API headers version: ...")
_VERSION_RES = (re.compile(r"^#\s*Library version:\s*(\S+)", re.M), re.compile(r"^#\s*Version\s+(\S+)", re.M))
_LIBPATH_RE = re.compile(r"^#\s*Library path:\s*(.+?)\s*$", re.M)
_CONFIGURED_RE = re.compile(r"^#\s*Configured with:\s*(.*?)\s*$", re.M)
_REVISION_RE = re.compile(r"^#\s*Git branch '([^']*)', revision[ \t]*([^\s#]*)", re.M)


@dataclass(frozen=True)
class UcxVersion:
    version: str
    # ucx_info prints the configure arguments joined by spaces without quoting, so an argument with a space in it
    # (LDFLAGS="-La -Lb") cannot be recovered exactly; `configure_line` is the raw text, `configure_args` a split.
    configure_line: str
    configure_args: tuple[str, ...]
    library_path: str | None = None  # only printed by UCX >= 1.15
    revision: str | None = None


@dataclass(frozen=True)
class Resource:
    """One `Transport:` / `Device:` pair from `ucx_info -d`."""

    transport: str
    device: str
    memory_domain: str | None
    component: str | None
    type: str | None  # loopback, network, intra-node, accelerator, ...


@dataclass
class UcxDevices:
    resources: list[Resource] = field(default_factory=list)
    memory_domains: list[str] = field(default_factory=list)
    connection_managers: list[str] = field(default_factory=list)

    @property
    def transports(self) -> list[str]:
        """Distinct transport names, sorted."""
        return sorted({r.transport for r in self.resources})

    def devices(self, transport: str) -> list[str]:
        return sorted({r.device for r in self.resources if r.transport == transport})


def parse_version(text: str) -> UcxVersion:
    version = None
    for rx in _VERSION_RES:
        if m := rx.search(text):
            version = m.group(1)
            break
    if version is None:
        raise ValueError("no version line in `ucx_info -v` output")
    conf = _CONFIGURED_RE.search(text)
    lib = _LIBPATH_RE.search(text)
    rev = _REVISION_RE.search(text)
    line = conf.group(1) if conf else ""
    try:
        args = tuple(shlex.split(line))
    except ValueError:  # unbalanced quotes in an unquoted print-out
        args = tuple(line.split())
    return UcxVersion(
        version=version,
        configure_line=line,
        configure_args=args,
        library_path=lib.group(1) if lib else None,
        revision=(rev.group(2) or None) if rev else None,
    )


def parse_devices(text: str) -> UcxDevices:
    """Parse `ucx_info -d`. Each `Transport:` line is followed by its `Device:` and (usually) `Type:`."""
    out = UcxDevices()
    md = component = None
    pending: dict | None = None

    def flush():
        nonlocal pending
        if pending and pending.get("device"):
            out.resources.append(Resource(pending["transport"], pending["device"], md, component, pending.get("type")))
        pending = None

    for raw in text.splitlines():
        line = raw.lstrip("#").strip()
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "Memory domain":
            flush()
            md, component = value, None
            if value not in out.memory_domains:
                out.memory_domains.append(value)
        elif key == "Component" and pending is None:
            component = value
        elif key == "Connection manager":
            flush()
            out.connection_managers.append(value)
        elif key == "Transport":
            flush()
            pending = {"transport": value}
        elif key == "Device" and pending is not None and "device" not in pending:
            pending["device"] = value
        elif key == "Type" and pending is not None and "type" not in pending:
            pending["type"] = value
    flush()
    return out


# --- running the tool ---------------------------------------------------------------------------------------------

def find_ucx_info(prefix: str | os.PathLike | None = None) -> Path:
    """<prefix>/bin/ucx_info, or the one on PATH when no prefix is given."""
    if prefix is not None:
        exe = install.at(prefix).ucx_info
        if exe is None:
            raise UserError(f"no ucx_info in {Path(prefix) / 'bin'} (is {prefix} a UCX prefix?)", UCX_NOT_FOUND)
        return exe
    found = shutil.which("ucx_info")
    if found is None:
        raise UserError("ucx_info not found on PATH", UCX_NOT_FOUND)
    return Path(found)


def run_ucx_info(exe: str | os.PathLike, *args: str, env: dict | None = None, timeout: float = 60) -> str:
    try:
        proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=timeout)
    except OSError as e:
        raise UserError(f"cannot run {exe}: {e.strerror}", UCX_NOT_FOUND) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{exe} {' '.join(args)} did not finish in {timeout:.0f} s", UCX_NOT_FOUND) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"{exe} {' '.join(args)} failed (exit {proc.returncode}): {last}", UCX_NOT_FOUND)
    return proc.stdout


def version(exe: str | os.PathLike, env: dict | None = None) -> UcxVersion:
    return parse_version(run_ucx_info(exe, "-v", env=env))


def devices(exe: str | os.PathLike, env: dict | None = None) -> UcxDevices:
    return parse_devices(run_ucx_info(exe, "-d", env=env))

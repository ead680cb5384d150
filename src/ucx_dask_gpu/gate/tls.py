"""Mutual TLS for a cluster (`ucx-dask-gpu tls init|env`; docs/environment-gate.md, "Mutual TLS"): what keeps
strangers out, where the guard (guard.py) only catches accidents. distributed's Security requires the peer's
certificate both ways once every role has one; UCX has no encryption of its own, so a UCX cluster is protected by its
network only. The keys and certificates come from the `openssl` command (Debian's openssl package).
"""
from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import OUTPUT_REFUSED, TLS_INIT_FAILED, USAGE, UserError
from ..fsutil import check_names_free, record_written

ROLES = ("scheduler", "worker", "client")
CA_CERT, CA_KEY = "ca.pem", "ca.key"
ENV_PREFIX = "DASK_DISTRIBUTED__COMM__"


def cert_files(directory: Path, name: str) -> tuple[Path, Path]:
    return directory / f"{name}.pem", directory / f"{name}.key"


def _openssl(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        if shutil.disk_usage(cwd).free < 1 << 16:  # openssl says only that it could not write: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
        raise UserError(f"openssl {args[0]} failed: {last[0].strip()}", TLS_INIT_FAILED)


def _san(hosts: list[str]) -> str:
    out = []
    for h in hosts:
        try:
            out.append(f"IP:{ipaddress.ip_address(h)}")
        except ValueError:
            out.append(f"DNS:{h}")
    return "subjectAltName=" + ",".join(out)


def init(directory: Path, hosts: list[str], clients: list[str] = (), days: int = 365,
         cluster: str = "ucx-dask-gpu") -> list[Path]:
    """Create (or extend) DIR: the CA when missing, then a certificate for each role whose certificate or key is
    missing there and each named client. Made in a temporary directory and moved in at the end: a failure adds
    nothing to DIR (a DIR this run created is removed again); a name an earlier init did not write (fsutil's
    manifest) is refused before anything is made (exit 9)."""
    if not shutil.which("openssl"):
        raise UserError("tls init needs the openssl command (apt-get install openssl)", TLS_INIT_FAILED)
    if days < 1:
        raise UserError(f"--days must be at least 1 (got {days})", USAGE)
    directory = Path(directory).absolute()  # openssl runs in the scratch directory: a relative DIR is lost there
    ca_pem, ca_key = directory / CA_CERT, directory / CA_KEY
    if ca_pem.exists() and not ca_key.exists():
        raise UserError(f"{directory} has {CA_CERT} but not {CA_KEY}: new certificates need the CA's key", USAGE)
    names = [r for r in ROLES if not all(p.exists() for p in cert_files(directory, r))] + list(clients)
    made = ([] if ca_pem.exists() else [CA_CERT, CA_KEY]) + [f"{n}{ext}" for n in names for ext in (".pem", ".key")]
    check_names_free(directory, made)
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".tls-init.", dir=directory) as tmp_name:
            tmp = Path(tmp_name)
            if not ca_pem.exists():
                _openssl(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days), "-subj",
                          f"/CN={cluster} cluster CA", "-keyout", CA_KEY, "-out", CA_CERT], tmp)
                ca_pem, ca_key = tmp / CA_CERT, tmp / CA_KEY
            (tmp / "san.cnf").write_text(_san(hosts or ["localhost", "127.0.0.1"]) + "\n")
            for name in names:
                pem, key = cert_files(tmp, name)
                _openssl(["req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key.name,
                          "-out", f"{name}.csr"], tmp)
                _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", str(ca_pem), "-CAkey", str(ca_key),
                          "-CAserial", "ca.srl", "-CAcreateserial", "-days", str(days), "-extfile", "san.cnf",
                          "-out", pem.name], tmp)
            for name in made:
                os.chmod(tmp / name, 0o600 if name.endswith(".key") else 0o644)
                os.replace(tmp / name, directory / name)
            record_written(directory, made)
    except (OSError, UserError) as e:
        if created:  # made by this run a moment ago: gone again, as if never run
            shutil.rmtree(directory, ignore_errors=True)
        if isinstance(e, UserError):
            raise
        raise UserError(f"{directory}: cannot write the certificates ({e.strerror or e}); nothing added",
                        OUTPUT_REFUSED) from None
    return [directory / name for name in made]


def dask_env(directory: str | os.PathLike, role: str, name: str | None = None) -> dict[str, str]:
    """The environment that configures dask's TLS for `role` (scheduler, worker, client) with the certificate
    `name` (default: the role's own) from `directory` (as the process sees it, e.g. a container's mount point).
    Every role requires encryption: a plain tcp:// address is refused before anything is sent."""
    if role not in ROLES:
        raise UserError(f"unknown TLS role {role!r} (expected {', '.join(ROLES)})", USAGE)
    d = str(directory).rstrip("/")
    cert = name or role
    return {f"{ENV_PREFIX}REQUIRE_ENCRYPTION": "True", f"{ENV_PREFIX}TLS__CA_FILE": f"{d}/{CA_CERT}",
            f"{ENV_PREFIX}TLS__{role.upper()}__CERT": f"{d}/{cert}.pem",
            f"{ENV_PREFIX}TLS__{role.upper()}__KEY": f"{d}/{cert}.key"}

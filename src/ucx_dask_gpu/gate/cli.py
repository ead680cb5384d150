"""`ucx-dask-gpu guard show|id` (this environment's stack id and its contract terms) and `ucx-dask-gpu config
install|show` (the dask config that loads the guard on every role)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cliutil import add_output
from . import daskconfig, identity, tls


def _cmd_guard_show(args) -> int:
    terms = identity.own_contract()
    pkgs = identity.installed_packages()
    info = {"stack_id": identity.contract_id(terms), "contract": terms, "packages": len(pkgs),
            "packages_sha256": identity.packages_digest(pkgs), "python_executable": sys.executable}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"stack id {info['stack_id']}  (the environment contract of {sys.executable}; {len(pkgs)} distributions "
          "installed, only these count:)")
    for term, version in terms.items():
        print(f"  {term:<18} {version or 'missing'}")
    return 0


def _cmd_guard_id(args) -> int:
    print(identity.stack_id())
    return 0


def _cmd_tls_init(args) -> int:
    for path in tls.init(Path(args.dir), args.host, args.client, args.days):
        print(f"wrote {path}")
    for role in tls.ROLES:
        env = " ".join(f"{k}={v}" for k, v in tls.dask_env(Path(args.dir).resolve(), role).items())
        print(f"{role}: {env}")
    return 0


def _cmd_tls_env(args) -> int:
    for k, v in tls.dask_env(args.dir, args.role, args.name).items():
        print(f"export {k}={v}")
    return 0


def _cmd_config_install(args) -> int:
    for path in daskconfig.install(args.dest, args.transports, tuned=not args.no_tuned):
        print(f"wrote {path}")
    earlier = Path(args.dest) / daskconfig.INSTALLED_TUNED
    if args.no_tuned and earlier.exists():
        print(f"kept {earlier} (an earlier install): remove it to run without the tuned settings", file=sys.stderr)
    return 0


def _cmd_config_show(args) -> int:
    for name, text in daskconfig.render(args.transports, tuned=not args.no_tuned).items():
        sys.stdout.write(f"# ---- {name}\n{text}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("guard", help="the environment gate that refuses mismatched Dask workers and clients")
    s = p.add_subparsers(dest="guard_command", metavar="ACTION", required=True)
    sh = s.add_parser("show", help="print this environment's stack id and the contract terms it is computed from")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=_cmd_guard_show)
    s.add_parser("id", help="print this environment's stack id only (the same computation in a venv, the image and "
                            "a conda environment)").set_defaults(func=_cmd_guard_id)

    p = sub.add_parser("tls", help="mutual TLS for a cluster: a CA, a certificate per role, the dask settings")
    s = p.add_subparsers(dest="tls_command", metavar="ACTION", required=True)
    t = s.add_parser("init", help="create DIR with a CA and scheduler/worker/client certificates (openssl); "
                                  "add client certificates to an existing DIR with --client")
    add_output(t, "dir", kind="dir", help="the cluster's certificate directory",
               note="a directory, created when missing: the CA, and each role's certificate and key, are written only "
                    "where missing (a --client NAME is issued again); a name taken by a file no earlier init wrote, or a "
                    "file there, is refused (exit 9); nothing else in it is touched")
    t.add_argument("--host", action="append", default=[],
                   help="a name or address the scheduler and workers are reached by (repeatable; default localhost "
                        "and 127.0.0.1)")
    t.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="also issue NAME.pem/NAME.key for a client (repeatable)")
    t.add_argument("--days", type=int, default=365, help="validity (default 365)")
    t.set_defaults(func=_cmd_tls_init)
    e = s.add_parser("env", help="print the dask settings (environment) for one role's certificate")
    e.add_argument("dir", help="the directory as the process sees it")
    e.add_argument("--role", choices=tls.ROLES, required=True)
    e.add_argument("--name", help="certificate name in DIR (default: the role's own; a --client NAME of init)")
    e.set_defaults(func=_cmd_tls_env)

    p = sub.add_parser("config", help="the dask config shipped for the image and the conda package (guard preloads, "
                                      "UCX transports, the measured settings)")
    s = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    i = s.add_parser("install", help="write ucx-dask-gpu.yaml, ucx-dask-gpu-transports.yaml and ucx-dask-gpu-tuned.yaml "
                                     "into a dask config dir")
    add_output(i, "--dest", kind="dir", required=True, help="dask config directory, e.g. /etc/dask")
    i.add_argument("--transports", choices=["auto", "cpu", "gpu"], default="auto",
                   help="UCX transports: auto = UCX selects on every host (default); opt-in pins: cpu = UCX over "
                        "TCP only, gpu = NVLink + cuda_copy + TCP (no shared memory, no InfiniBand)")
    sh = s.add_parser("show", help="print the files `install` would write")
    sh.add_argument("--transports", choices=["auto", "cpu", "gpu"], default="auto")
    for a in (i, sh):
        a.add_argument("--no-tuned", action="store_true",
                       help="leave out ucx-dask-gpu-tuned.yaml (the measured settings of tuned-gpu.yaml): dask's and "
                            "distributed's own defaults")
    i.set_defaults(func=_cmd_config_install)
    sh.set_defaults(func=_cmd_config_show)

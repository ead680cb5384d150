"""`python -m tools.rootfs_runner export|receive|run`: the image's filesystem carried to a GPU host without Docker in
verified parts, and its roles run there chrooted (rootfs.py, chroot.py).

From the repository root; `receive` and `run` need only python3 >= 3.11 and the checkout (`PYTHONPATH=src`). Bad input
ends as the product's commands do: one line on stderr, the exit code of ucx_dask_gpu.errors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ucx_dask_gpu.cliutil import SIZE_HELP, Parser, add_output, parse_size, run_parsed, signals_deferred
from ucx_dask_gpu.errors import NO_GPU, ROOTFS_INVALID, VERDICT_FAILED, UserError
from ucx_dask_gpu.image.docker import engine_version
from ucx_dask_gpu.stack import load

from . import chroot, rootfs

PROG = "python -m tools.rootfs_runner"
UNSHARED_ENV = "UCX_DASK_GPU_ROOTFS_UNSHARED"


def _cmd_export(args) -> int:
    part = parse_size(args.part_size, "--part-size")
    engine_version()
    m = rootfs.export_rootfs(args.image, args.dir, part_size=part, level=args.level, compression=args.compression)
    print(f"{args.dir}: {m['image']} ({m['image_id'][:19]}), rootfs {m['rootfs_bytes'] / 1e6:.0f} MB -> "
          f"{m['archive_bytes'] / 1e6:.0f} MB {m['compression']} in {len(m['parts'])} parts of at most "
          f"{part / rootfs.MIB:.0f} MiB")
    for batch, p in zip(m["batches"], m["parts"]):
        print(f"  {args.dir}/{batch}  {p['name']}  {p['bytes'] / rootfs.MIB:.1f} MiB  sha256 {p['sha256'][:16]}")
    return 0


def _parts_dir(args) -> Path:
    return Path(args.parts or load(args.stack_file).gpu_host.parts_dir)


def _cmd_receive(args) -> int:
    parts = _parts_dir(args)
    r = rootfs.receive(args.batch, parts)
    left = f"missing {len(r['missing'])}: {', '.join(r['missing'])}" if r["missing"] else "all parts here"
    print(f"received {', '.join(r['moved']) or 'no part'} into {parts} ({r['image']}): "
          f"{r['parts'] - len(r['missing'])} of {r['parts']} parts; {left}")
    return 0


def _private_mount_namespace() -> None:
    """Re-run this command in a private mount namespace (its mounts end with it), where this machine allows one."""
    if os.environ.get(UNSHARED_ENV):
        return
    probe = ["unshare", "--mount", "--propagation", "private"]
    try:
        ok = subprocess.run([*probe, "true"], capture_output=True).returncode == 0
    except OSError:
        ok = False
    if not ok:
        os.environ[UNSHARED_ENV] = "no"
        print("rootfs: no private mount namespace here (unshare --mount failed): mounting in this one, binds made "
              "slaves, unmounted at the end", flush=True)
        return
    os.environ[UNSHARED_ENV] = "yes"
    os.execvp(probe[0], [*probe, sys.executable, "-m", __package__, *sys.argv[1:]])


def _cmd_run(args) -> int:
    if os.geteuid() != 0:
        raise UserError("run chroots, mounts and switches users: run it as root", ROOTFS_INVALID)
    st = load(args.stack_file)
    if args.unshare:
        _private_mount_namespace()
    parts, root = _parts_dir(args), Path(args.root or st.gpu_host.root)
    unpacked = rootfs.unpack(root, parts)
    m = unpacked["manifest"]
    print(f"rootfs: {m['image']} ({m['image_id'][:19]}, stack id {m['stack_id']}) "
          f"{'reused' if unpacked['reused'] else 'unpacked'} in {root}", flush=True)
    mounted = []
    try:
        added = _prepare_root(root, mounted, gpu=args.gpu)
        proof = chroot.Proof(gpu=args.gpu, size=args.size or (8000 if args.gpu else 4000),
                             chunk=args.chunk or (2000 if args.gpu else 1000))
        result = chroot.run_proof(root, rootfs.read_image_config(parts), Path(args.out), proof, st.image.ucx_prefix,
                                  extra={"driver_files": added, "stack_id": m["stack_id"], "image_id": m["image_id"]})
    finally:
        with signals_deferred():
            left = chroot.unmount_system(mounted)
        if left:
            print(f"rootfs: still mounted: {', '.join(left)}", flush=True)
    _print_result(result, args.out)
    return 0 if result["ok"] else VERDICT_FAILED


def _prepare_root(root: Path, mounted: list[Path], gpu: bool) -> list[str]:
    """What a container runtime does before the roles start: the machine's /proc /sys /dev, the network files, the
    driver's libraries; the driver files added."""
    notes = chroot.mount_system(root, mounted, private=os.environ.get(UNSHARED_ENV) == "yes")
    print(f"rootfs: mounted {', '.join('/' + str(p.relative_to(root)) for p in mounted)}"
          f"{''.join(f'; {n}' for n in notes)}", flush=True)
    chroot.write_network_files(root)
    libraries = chroot.find_driver_libraries()
    if gpu and "libcuda.so.1" not in libraries:
        raise UserError("no NVIDIA driver library libcuda.so.1 on this machine (ldconfig -p, driver directories): "
                        "not a GPU host, or use --cpu", NO_GPU)
    added = chroot.add_driver(root, libraries) if libraries else []
    print(f"rootfs: driver files added: {', '.join(added) or 'none (no driver here)'}", flush=True)
    return added


def _print_result(result: dict, out: str) -> None:
    for name, c in result["checks"].items():
        print(f"rootfs: check {name}: {'ok' if c['ok'] else 'FAILED'}  "
              f"{json.dumps({k: v for k, v in c.items() if k != 'ok'})[:400]}")
    if result.get("error"):
        print(f"rootfs: error: {result['error']}")
    print(f"rootfs: {'PASS' if result['ok'] else 'FAIL'}; results in {out}/image-rootfs.tgz")


def _register_export(s) -> None:
    x = s.add_parser("export", help="the image's filesystem as verified, compressed parts (+ its Config) for a "
                                    "machine without Docker; one batch directory per part")
    x.add_argument("image")
    add_output(x, "dir", kind="dir", help="where the parts go",
               note="new, or one this command exported into before (its manifest), made whole at the end; one holding "
                    "anything else, or a file, is refused (exit 9) naming it")
    x.add_argument("--part-size", default=rootfs.DEFAULT_PART_SIZE,
                   help=f"largest part, e.g. 200MiB (default {rootfs.DEFAULT_PART_SIZE}): size it for how the parts "
                        f"travel (a file-size or upload limit, removable media); {SIZE_HELP}")
    x.add_argument("--level", type=int, default=19, help="compression level (default 19; xz: at most 9)")
    x.add_argument("--compression", choices=sorted(rootfs.COMPRESSIONS), default=rootfs.DEFAULT_COMPRESSION,
                   help="xz (default: Python's standard library decodes it, nothing to install) or zstd (--long; the "
                        "host needs the zstd command or the zstandard module)")
    x.set_defaults(func=_cmd_export)


PARTS_HELP = "parts directory (default: stack.toml [gpu_host].parts_dir)"


def _register_receive(s) -> None:
    rv = s.add_parser("receive", help="move one batch of exported parts into the parts directory, check them, say "
                                      "which are missing")
    rv.add_argument("batch", help="a batch-NN directory of `export`")
    add_output(rv, "--parts", kind="dir", help=PARTS_HELP,
               note="a directory, created when missing: the parts, manifest.json and image-config.json are moved in "
                    "beside what else it holds; a name taken by a file no earlier receive wrote, or a file there, is "
                    "refused (exit 9)")
    rv.set_defaults(func=_cmd_receive)


def _register_run(s) -> None:
    rr = s.add_parser("run", help="as root, without Docker: unpack the received parts, mount /proc /sys /dev, add the "
                                  "host's NVIDIA driver, run scheduler + 2 workers + transpose client chrooted as the "
                                  "image's user, check, stop, write OUT/image-rootfs.tgz")
    add_output(rr, "out", kind="dir", help="directory for result.json and image-rootfs.tgz")
    rr.add_argument("--parts", help=PARTS_HELP)
    add_output(rr, "--root", kind="dir", help="where to unpack (default: stack.toml [gpu_host].root; reused when it "
                                              "holds this export)",
               note="new, empty, or one this command unpacked before (its manifest), which is replaced; one holding "
                    "anything else, or a file, is refused (exit 9) naming it")
    rr.add_argument("--no-unshare", dest="unshare", action="store_false",
                    help="mount in this mount namespace (as where none can be made); unmounted at the end")
    mode = rr.add_mutually_exclusive_group()
    mode.add_argument("--gpu", dest="gpu", action="store_true", default=True,
                      help="two dask cuda workers sharing GPU 0, CuPy blocks, cuda_ipc expected (default)")
    mode.add_argument("--cpu", dest="gpu", action="store_false", help="two dask workers, numpy blocks")
    rr.add_argument("--size", type=int, help="transpose size (default 8000 GPU, 4000 CPU)")
    rr.add_argument("--chunk", type=int, help="transpose chunk (default 2000 GPU, 1000 CPU)")
    rr.set_defaults(func=_cmd_run)


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="the image run from its exported filesystem on a GPU host without Docker, as "
                                      "root (chroot, namespaces): the workshop's runner (tools/README.md)")
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="command", metavar="ACTION", required=True, parser_class=Parser)
    _register_export(s)
    _register_receive(s)
    _register_run(s)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_parsed(args, f"{PROG} {args.command}")

"""Tests of tools/rootfs_runner (the workshop's no-Docker runner, not the product): the image exported in verified
parts, copied batch by batch, reassembled, unpacked and run chrooted as its user through its entrypoint, by the GPU-host
script (tools/gpu-host/image_rootfs.sh) itself, here in CPU mode (numpy, two `dask worker`s); on the GPU host the same
script only adds the GPU.

The export here is compressed at a low level (quick); the format (xz), the parts and everything after are the same as
the `-9` export copied to the GPU host.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from test_signals import assert_ended, assert_one_line, interrupt
from tools.rootfs_runner import chroot
from ucx_dask_gpu.errors import ROOTFS_INVALID

pytestmark = [pytest.mark.integration, pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu-host" / "image_rootfs.sh"
MIB = 1 << 20


def runner(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.rootfs_runner", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def session(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """The GPU-host script as it runs there: bash, the machine's python3 (no venv), from any directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd="/")


@pytest.fixture(scope="module")
def exported(image, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rootfs") / "export"
    proc = runner("export", image["tag"], str(d), "--level", "1", "--part-size", "40MiB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d


def test_export_is_verified_parts_one_per_batch_and_the_image_config(exported, image):
    m = json.loads((exported / "manifest.json").read_text())
    cfg = json.loads((exported / "image-config.json").read_text())
    assert m["image"] == image["tag"] and m["stack_id"] == image["stack_id"] and m["compression"] == "xz"
    assert len(m["parts"]) == len(m["batches"]) > 1 and all(p["bytes"] <= 40 * MIB for p in m["parts"])
    assert m["rootfs_bytes"] > m["archive_bytes"] == sum(p["bytes"] for p in m["parts"])
    for batch, part in zip(m["batches"], m["parts"]):
        assert sorted(f.name for f in (exported / batch).iterdir()) == sorted(
            ["manifest.json", "image-config.json", part["name"]])
    assert cfg["Entrypoint"][:3] == ["/usr/bin/tini", "-s", "--"] and cfg["User"] and cfg["WorkingDir"]
    assert any(e.startswith("PATH=") for e in cfg["Env"]) and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in cfg["Env"]
    assert not (exported.parent / "export.partial").exists()


def test_a_damaged_part_is_refused_in_one_line(exported, tmp_path):
    batch = shutil.copytree(exported / "batch-01", tmp_path / "batch-01")
    part = next(f for f in batch.iterdir() if f.name.startswith("rootfs.tar.xz."))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    proc = session("receive", str(batch), "--parts", str(tmp_path / "parts"))
    assert proc.returncode == ROOTFS_INVALID, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"{part.name}: sha256 differs from the manifest: copy it again" in line
    assert not (tmp_path / "parts" / part.name).exists()
    proc = session("run", str(tmp_path / "out"), "--cpu", "--parts", str(tmp_path / "parts"),
                   "--root", str(tmp_path / "root"))
    assert proc.returncode == ROOTFS_INVALID and "parts not usable" in proc.stderr and "missing" in proc.stderr


def _processes_under(root: Path) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.readlink(d / "root").startswith(str(root)):
                out.append(f"{d.name} {(d / 'comm').read_text().strip()}")
        except OSError:
            continue
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="the session script unpacks, mounts and chroots: it needs root")
def test_the_gpu_session_script_runs_the_image_from_its_parts(exported, image, st, tmp_path):
    parts, out, root = tmp_path / "parts", tmp_path / "out", tmp_path / "root"
    m = json.loads((exported / "manifest.json").read_text())
    for i, batch in enumerate(m["batches"]):  # one copy each: the copied batch is moved away
        copied = shutil.copytree(exported / batch, tmp_path / "copied" / batch)
        proc = session("receive", str(copied), "--parts", str(parts))
        assert proc.returncode == 0, proc.stderr
        left = len(m["batches"]) - i - 1
        assert (f"missing {left}:" in proc.stdout) if left else "all parts here" in proc.stdout, proc.stdout
        assert not any(f.name.startswith("rootfs.tar") for f in copied.iterdir())
    try:
        proc = session("run", str(out), "--cpu", "--parts", str(parts), "--root", str(root))
        result = json.loads((out / "result.json").read_text())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert result["ok"] and set(result["checks"]) == {"answer", "libucp", "proto_info"}
        w = result["workload"]
        assert w["ok"] and w["protocol"] == "ucx" and w["workers_start"] == 2 and w["backend"] == "numpy"
        libs = result["checks"]["libucp"]
        assert all(p.startswith(f"{root}{st.image.ucx_prefix}/lib/libucp.so") for p in libs["processes"].values())
        assert len(libs["processes"]) >= 5  # scheduler, 2 x (worker + its nanny), client roles read from inside
        assert set(libs["reported_by_roles"]) >= {"client", "scheduler"}
        assert result["checks"]["proto_info"]["transports"]
        assert all(code in (0, -15, 143) for code in result["exit_codes"].values()), result["exit_codes"]
        with tarfile.open(out / "image-rootfs.tgz") as tar:
            names = tar.getnames()
        assert {"image-rootfs/result.json", "image-rootfs/scheduler.log", "image-rootfs/worker-a.log",
                "image-rootfs/client.json"} <= set(names)
        # Stopped and unmounted: nothing runs from the root, and its mounts ended with the script's namespace.
        assert _processes_under(root) == []
        assert [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(root) in ln] == []
        # A second run reuses the unpacked root; without a private mount namespace (as where none can be made) its
        # mounts are undone at the end all the same.
        again = session("run", str(tmp_path / "out2"), "--cpu", "--parts", str(parts), "--root", str(root),
                        "--size", "1000", "--chunk", "500", "--no-unshare")
        assert again.returncode == 0 and "reused" in again.stdout, again.stdout[-2000:]
        assert [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(root) in ln] == []
        assert _processes_under(root) == []
        # Cut short once its roles run (Ctrl-C at the terminal, a `timeout` or a job's end): one line, 130/143, every
        # role it started gone, nothing left mounted.
        for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True)):
            cmd = [sys.executable, "-m", "tools.rootfs_runner", "run", str(tmp_path / f"out-{sig.name}"), "--cpu",
                   "--parts", str(parts), "--root", str(root), "--size", "20000", "--chunk", "500"]
            rc, _, lines, started = interrupt(cmd, {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}, tmp_path,
                                              sig, lambda _: bool(_processes_under(root)), group=group)
            assert_one_line(rc, lines, sig, "python -m tools.rootfs_runner run")
            assert_ended(started)
            assert _processes_under(root) == []
            assert [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(root) in ln] == []
        # The driver goes in as the toolkit puts it: the file under its own name, the soname linked to it, known to
        # the root's loader cache (a library of this machine stands in for libcuda here).
        real = Path(chroot.parse_ldconfig(subprocess.run(["ldconfig", "-p"], capture_output=True,
                                                         text=True).stdout)["libz.so.1"]).resolve()
        assert chroot.add_driver(root, {"libz.so.1": real})[0] == "libz.so.1"
        lib = root / chroot.LIB_DIR
        assert os.readlink(lib / "libz.so.1") == real.name and (lib / real.name).read_bytes() == real.read_bytes()
        cache = subprocess.run(["chroot", str(root), "ldconfig", "-p"], capture_output=True, text=True).stdout
        assert "libz.so.1 (libc6,x86-64)" in cache, cache[-2000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)

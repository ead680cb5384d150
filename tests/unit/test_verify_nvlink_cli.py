"""verify-nvlink's bad-input paths, run for real where this machine allows: the real CLI, the real pip ucx_perftest
(host memory works here, CUDA memory fails here for real), the real NVML (absent here), the real CuPy probe."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu import nvml, stack
from ucx_dask_gpu.ucx import perftest as pt
from ucx_dask_gpu.nvlink import cli as nvlink_cli
from ucx_dask_gpu.nvlink import report, undertest, verify
from ucx_dask_gpu.ucx.install import pip_wheel_prefix
from ucx_dask_gpu.errors import (NO_GPU, NO_NVLINK, NVML_UNAVAILABLE, ONE_GPU, OUTPUT_REFUSED, PERFTEST_FAILED,
                                 PERFTEST_MISSING, USAGE, UserError)

REPO = Path(__file__).resolve().parents[2]


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # noqa: BLE001
        return False


NVML_WORKS = _nvml_works()
PIP = pip_wheel_prefix()
needs_pip_ucx = pytest.mark.skipif(PIP is None or not (PIP / "bin" / "ucx_perftest").is_file(),
                                   reason="the libucx wheel (libucx-cu13) is not installed in this Python")
# Our own build (`make ucx`): a real ucx_perftest for the runner tests wherever the suite runs.
OURS = str(Path(os.environ.get("UCX_PREFIX", REPO / "build" / "ucx-prefix")).resolve())
needs_our_ucx = pytest.mark.skipif(not (Path(OURS) / "bin" / "ucx_perftest").is_file(),
                                   reason=f"no UCX build at {OURS} (make ucx, or set UCX_PREFIX)")
no_gpu_here = pytest.mark.skipif(NVML_WORKS, reason="this machine has an NVIDIA driver: the no-GPU paths are not real")


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "verify-nvlink", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def cli_inproc(capsys, *args: str) -> tuple[int, str, str]:
    """The same CLI in this process (argument errors need no fresh interpreter)."""
    from ucx_dask_gpu.cli import main

    try:
        rc = main(["verify-nvlink", *args])
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- the CLI, end to end -------------------------------------------------------------------------------------------

@no_gpu_here
@needs_our_ucx
def test_no_driver_is_nvml_unavailable_and_writes_nothing(tmp_path):
    out = tmp_path / "report"
    r = cli("--ucx-prefix", OURS, "--out", str(out))
    assert r.returncode == NVML_UNAVAILABLE
    assert "NVML unavailable" in _one_line(r.stderr)
    assert not out.exists() and r.stdout == ""


def test_missing_perftest_is_its_own_exit(tmp_path):
    empty = tmp_path / "prefix"
    (empty / "bin").mkdir(parents=True)
    out = tmp_path / "report"
    r = cli("--ucx-prefix", str(empty), "--out", str(out))  # the real CLI, end to end
    assert r.returncode == PERFTEST_MISSING and "no executable bin/ucx_perftest" in _one_line(r.stderr)
    assert not out.exists() and r.stdout == ""


def test_missing_perftest_variants(capsys, tmp_path):
    """Checked before NVML: a wrong --ucx-prefix is reported as such on any machine, GPU or not."""
    empty = tmp_path / "prefix"
    (empty / "bin").mkdir(parents=True)
    (empty / "bin" / "ucx_perftest").write_text("")  # not executable: not a perftest
    for prefix, what in ((empty, "no executable bin/ucx_perftest"), (tmp_path / "nope", "no such directory")):
        rc, _, err = cli_inproc(capsys, "--ucx-prefix", str(prefix), "--ucx-prefix", "pip")
        assert rc == PERFTEST_MISSING and what in _one_line(err)


@pytest.mark.parametrize("args, what", [
    (["--sizes", "1Q"], "--sizes '1Q': not a byte size"),
    (["--target-bytes", "1Q"], "--target-bytes: '1Q': not a byte size"),
    (["--ucx-env", "CUDA_VISIBLE_DEVICES=0,1"], "set by verify-nvlink itself"),
    (["--variant", "LD_LIBRARY_PATH=/tmp"], "set by verify-nvlink itself"),
    (["--gpus", "zero"], "--gpus"),
    (["--iters", "3"], "--iters"),
    (["--min-ratio", "0"], "out of range"),
    (["--goals", "1MiB"], "--goals"),
])
def test_usage_errors(capsys, args, what):
    rc, out, err = cli_inproc(capsys, *args)
    assert rc == USAGE and what in _one_line(err) and out == ""


def test_module_entry_point_without_the_other_subcommands(capsys, tmp_path):
    """`python -m ucx_dask_gpu.nvlink` (what the GPU session runs) behaves like the subcommand."""
    assert nvlink_cli.main(["--sizes", "1Q"]) == USAGE
    assert nvlink_cli.main(["--ucx-prefix", str(tmp_path / "nope")]) == PERFTEST_MISSING
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("ucx-dask-gpu verify-nvlink: error:") for e in err)
    line = "ucx-dask-gpu --out 'a b' --sizes 1MiB"
    assert report.recorded_command(line, "/repo/src/ucx_dask_gpu/nvlink/__main__.py") == \
        "python3 -m ucx_dask_gpu.nvlink --out 'a b' --sizes 1MiB"
    assert report.recorded_command(line, "/usr/bin/ucx-dask-gpu") == line


def test_out_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    rc, _, err = cli_inproc(capsys, "--out", str(f))
    assert rc == OUTPUT_REFUSED and "not a directory" in _one_line(err) and f.read_text() == "keep me"


def test_wrapper_script_passes_through(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "verify_nvlink.sh"), "--ucx-prefix", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert r.returncode == PERFTEST_MISSING and "no such directory" in _one_line(r.stderr)


# --- discovery / pair selection ------------------------------------------------------------------------------------

def test_pair_selection_bad_machines(h200):
    g0, g1 = h200.smi_gpus()
    with pytest.raises(UserError) as e:
        verify.select_pairs([])
    assert e.value.exit_code == NO_GPU
    with pytest.raises(UserError) as e:
        verify.select_pairs([g0])
    assert e.value.exit_code == ONE_GPU and g0.pci_bus_id in str(e.value)
    with pytest.raises(UserError) as e:
        verify.select_pairs([g0, g1], only=[0])
    assert e.value.exit_code == ONE_GPU
    with pytest.raises(UserError) as e:
        verify.select_pairs([g0, g1], only=[0, 5])
    assert e.value.exit_code == USAGE
    bare = [nvml.Gpu(g.index, g.uuid, g.pci_bus_id, g.name) for g in (g0, g1)]  # same GPUs, no active link
    with pytest.raises(UserError) as e:
        verify.select_pairs(bare, all_pairs=True)
    assert e.value.exit_code == NO_NVLINK
    assert [(a.index, b.index) for a, b in verify.select_pairs([g0, g1])] == [(0, 1), (1, 0)]


@no_gpu_here
def test_nvml_discover_without_driver():
    with pytest.raises(UserError) as e:
        nvml.discover()
    assert e.value.exit_code == NVML_UNAVAILABLE


# --- UCX under test --------------------------------------------------------------------------------------------------

@needs_pip_ucx
def test_pip_prefix_resolves_to_the_wheel():
    inst = undertest.resolve_install("pip")
    assert inst.install.prefix == PIP and inst.install.perftest == PIP / "bin" / "ucx_perftest"
    assert inst.install.kind == "pip" and PIP / "lib" in inst.install.lib_dirs
    env = undertest.child_env(inst, [], {"UCX_RNDV_SCHEME": "get_zcopy"})
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(PIP / "lib")
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and "CUDA_VISIBLE_DEVICES" not in env
    assert env["UCX_RNDV_SCHEME"] == "get_zcopy"


@no_gpu_here
@needs_our_ucx
def test_preflight_rejects_a_ucx_without_cuda_transports():
    inst = undertest.resolve_install(OURS)
    with pytest.raises(UserError) as e:
        undertest.preflight(inst, undertest.child_env(inst, [], {}))
    assert e.value.exit_code == PERFTEST_FAILED and "no CUDA transport" in str(e.value)
    # what it learned before refusing is real: our build's version and its protocol-info capability
    assert inst.version == stack.load(REPO / "stack.toml").ucx.version and inst.proto_v2_default
    assert not inst.proto_used  # 1.20 has no `UCX_PROTO_INFO=used` mode: selection tables it is
    assert undertest.evidence_mode(inst, {}) == "proto-selected"
    assert undertest.evidence_mode(inst, {"UCX_PROTO_ENABLE": "n"}) == "lanes"
    assert undertest.evidence_mode(inst, {}, forced="lanes") == "lanes"


# --- the runner, for real ------------------------------------------------------------------------------------------

@needs_our_ucx
def test_run_pair_host_memory_for_real(tmp_path):
    inst = undertest.resolve_install(OURS)
    env = {**undertest.child_env(inst, [], {}), **undertest.EVIDENCE_ENV["proto-selected"]}  # 1.20: selection tables
    size = 1 << 20
    out = pt.run_pair(inst.install.perftest, ["-t", "tag_bw", "-m", "host", "-s", str(size), "-n", "200", "-w", "20"],
                      env, env, tmp_path, timeout=60)
    res = pt.result_or_raise(out, "host loopback")
    assert out.ok and res.iterations == 200 and res.gbps > 0
    assert res.gbps * 1e9 == pytest.approx(size / (res.lat_overall_us * 1e-6), rel=0.01)
    sides = [t for t in pt.parse_proto_tables(out.client_out) if t.is_send and t.mem_is("host")]
    assert sides and any(r.covers(size) and r.transports for r in sides[0].rows)
    assert (tmp_path / "client.out").read_text() == out.client_out


@no_gpu_here
@needs_our_ucx
def test_run_pair_cuda_without_gpu_fails_with_the_cause(tmp_path):
    inst = undertest.resolve_install(OURS)
    env = undertest.child_env(inst, [], {})
    out = pt.run_pair(inst.install.perftest, ["-t", "tag_bw", "-m", "cuda", "-s", "1048576", "-n", "10", "-w", "1"],
                      env, env, tmp_path, timeout=60)
    assert not out.ok
    with pytest.raises(UserError) as e:
        pt.result_or_raise(out, "GPU0->GPU1 1 MiB")
    assert e.value.exit_code == PERFTEST_FAILED
    msg = str(e.value)
    assert "GPU0->GPU1 1 MiB" in msg and "exit" in msg and "cuda" in msg.lower() and "\n" not in msg


def test_loader_error_is_reported(h200):
    """Recorded (tests/fixtures/verify_nvlink/README.md): a perftest without its libraries -- the server exits 127
    before listening, so run_pair never starts the client."""
    stem = h200.FIX / "verify_nvlink" / "cpu-ucx-1.13.1-source" / "perftest-relocated-without-lib"
    out = pt.PairOutput(Path(f"{stem}.server.txt").read_text(), Path(f"{stem}.client.txt").read_text(),
                        127, None, 1, -1, 0.01)
    with pytest.raises(UserError) as e:
        pt.result_or_raise(out, "source 1.13.1")
    msg = str(e.value)
    assert e.value.exit_code == PERFTEST_FAILED and "libucp.so.0: cannot open shared object file" in msg
    assert "client exit None, server exit 127" in msg and "\n" not in msg


def test_free_port_and_listening():
    import socket

    port = pt.free_port()
    assert not pt.listening(port)
    with socket.socket() as s:
        s.bind(("", port))
        s.listen()
        assert pt.listening(port)


@no_gpu_here
def test_cuda_probe_fails_in_one_line_without_a_driver():
    r = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.nvlink.gpuprobe", "visible"], capture_output=True,
                       text=True, timeout=120)
    if "No module named 'cupy'" in r.stderr:
        pytest.skip("cupy is not installed here")
    assert r.returncode == 1 and r.stdout == "" and _one_line(r.stderr).startswith("gpuprobe visible:")

"""The environment gate on real processes: a `dask scheduler` with the shipped dask config (the guard on every role),
and workers / clients in environments of their own: the same venv with one contract distribution at another version
(the installed cloudpickle packed again under a .post1 version and installed by pip into a directory ahead on their
sys.path), with a distribution outside the contract, or without the guard."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from ucx_dask_gpu.errors import ENV_MISMATCH
from ucx_dask_gpu.gate import identity

pytestmark = pytest.mark.integration

CLOUDPICKLE = version("cloudpickle")
CHANGED = f"{CLOUDPICKLE}.post1"

CLIENT = textwrap.dedent("""
    import json, sys
    from distributed import Client
    try:
        with Client(sys.argv[1] if len(sys.argv) > 1 else {address!r}, timeout=60) as c:
            if {wait_workers}:
                c.wait_for_workers({wait_workers}, timeout=90)
            info = c.scheduler_info(n_workers=-1)["workers"]
            out = {{"connected": True, "workers": sorted(w["name"] for w in info.values()),
                    "sum": c.submit(sum, range(10)).result() if info else None}}
    except Exception as e:
        out = {{"connected": False, "type": type(e).__name__, "message": str(e)}}
    print(json.dumps(out))
""")


def client_in_own_env(procs, address: str, env: dict, wait_workers: int = 0) -> dict:
    proc = procs.run_python(CLIENT.format(address=address, wait_workers=wait_workers), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def changed_pin(tmp_path_factory, wheels):
    """A directory that makes the venv an environment with cloudpickle CHANGED (real code, another version)."""
    d = tmp_path_factory.mktemp("changed-pin")
    return wheels.pip_target([wheels.installed_as_wheel("cloudpickle", CHANGED, d / "wheel")], d / "site")


@pytest.fixture(scope="module")
def outside_contract(tmp_path_factory, wheels, make_wheel):
    """A directory that adds a distribution the contract does not name (a site's own library)."""
    d = tmp_path_factory.mktemp("outside")
    return wheels.pip_target([make_wheel(d, "site-library", "9.9", payload="x")], d / "site")


@pytest.fixture(scope="module")
def scheduler_a(procs, tmp_path_factory, shipped_config):
    tmp = tmp_path_factory.mktemp("sched-a")
    proc, address = procs.start_scheduler(tmp, procs.env_for(tmp, shipped_config))
    yield tmp, address, proc
    proc.stop()


def new_lines(proc, before: int) -> list[str]:
    return proc.text().splitlines()[before:]


def test_a_refused_worker_says_why_in_one_line_and_exits_8(procs, scheduler_a, shipped_config, changed_pin, tmp_path):
    """As the image runs it: `dask worker` with the guard as nanny preload (the entrypoint adds it)."""
    tmp, address, sched = scheduler_a
    before = len(sched.text().splitlines())
    worker = procs.start_worker(tmp_path, procs.env_for(tmp_path, shipped_config, changed_pin), address,
                                "refused-worker", extra_args=("--preload-nanny", identity.GUARD))
    rc = worker.wait(timeout=120)
    worker.stop()
    lines = worker.text().splitlines()
    assert rc == ENV_MISMATCH, worker.text()[-3000:]
    errors = [ln for ln in lines if " - ERROR - " in ln]
    assert len(errors) == 1 and "refused worker refused-worker" in errors[0], worker.text()
    assert f"cloudpickle: {CLOUDPICKLE} vs {CHANGED}" in errors[0]
    # The rest is dask's own start-up INFO (the preload being loaded) and its last word: no traceback.
    assert "Traceback" not in worker.text() and len(lines) <= 8, worker.text()
    # The scheduler: one line for the refusal, nothing else (no CommClosedError traceback).
    after = new_lines(sched, before)
    assert [ln for ln in after if "refused" in ln] == [ln for ln in after if " - ERROR - " in ln]
    assert len([ln for ln in after if "refused worker" in ln]) == 1 and "Traceback" not in "\n".join(after), after
    seen = client_in_own_env(procs, address, procs.env_for(tmp_path, shipped_config))
    assert seen["connected"] and "refused-worker" not in seen["workers"], seen


def test_a_worker_started_without_the_nanny_preload_is_still_refused(procs, scheduler_a, shipped_config, changed_pin,
                                                                    tmp_path):
    """Plain `dask worker` with the dask config only (it never loads distributed.nanny.preload): refused when its
    worker process registers, and it exits by itself, with dask's own tracebacks (docs/environment-gate.md says to add
    the preload)."""
    _, address, sched = scheduler_a
    worker = procs.start_worker(tmp_path, procs.env_for(tmp_path, shipped_config, changed_pin), address, "plain")
    rc = worker.wait(timeout=120)
    worker.stop()
    assert rc != 0
    assert f"cloudpickle: {CLOUDPICKLE} vs {CHANGED}" in worker.text() and "refused worker" in sched.text()


def test_a_client_with_a_changed_pin_gets_the_message_from_client_creation(procs, scheduler_a, shipped_config,
                                                                          changed_pin, tmp_path):
    _, address, _ = scheduler_a
    out = client_in_own_env(procs, address, procs.env_for(tmp_path, shipped_config, changed_pin))
    assert out["connected"] is False and out["type"] == "ImportError"
    assert "refused client" in out["message"] and f"cloudpickle: {CLOUDPICKLE} vs {CHANGED}" in out["message"]


def test_the_workload_cli_refused_is_one_line_and_exit_8(procs, scheduler_a, changed_pin, tmp_path):
    """Our own client needs no dask config: it loads the guard itself."""
    _, address, _ = scheduler_a
    proc = procs.workload(procs.env_for(tmp_path, None, changed_pin), "transpose", "--scheduler", address)
    assert proc.returncode == ENV_MISMATCH, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "refused client" in proc.stderr and f"cloudpickle: {CLOUDPICKLE} vs {CHANGED}" in proc.stderr


def test_a_client_without_the_guard_is_told_how_to_load_it(procs, scheduler_a, tmp_path):
    _, address, _ = scheduler_a
    out = client_in_own_env(procs, address, procs.env_for(tmp_path, None))  # no dask config: no preload
    assert out["connected"] is False and out["type"] == "ImportError"
    assert "did not send its environment" in out["message"] and f"import {identity.GUARD}" in out["message"]


def test_the_same_contract_is_accepted_whatever_else_is_installed(procs, scheduler_a, shipped_config,
                                                                 outside_contract, tmp_path):
    _, address, sched = scheduler_a
    env = procs.env_for(tmp_path, shipped_config, outside_contract)
    worker = procs.start_worker(tmp_path, env, address, "good-worker")
    try:
        out = client_in_own_env(procs, address, env, wait_workers=1)
    finally:
        worker.stop()
    assert out["connected"], out
    assert "good-worker" in out["workers"] and out["sum"] == 45
    # Accepted, and the difference outside the contract noted in one info line.
    assert "packages outside the contract differ" in sched.text() and "site-library: missing vs 9.9" in sched.text()


def test_local_cuda_cluster_workers_carry_the_identity(procs, shipped_config, tmp_path):
    """LocalCUDACluster passes its own worker preloads (dask_cuda.initialize); its workers must still be accepted.

    dask-cuda's test switches let it start without a GPU; the scheduler checks the contract, so a worker without the
    guard would be refused and the cluster would never get a worker.
    """
    pytest.importorskip("dask_cuda")
    env = procs.env_for(tmp_path, shipped_config)
    env.update(CUDA_VISIBLE_DEVICES="0", DASK_CUDA_TEST_SINGLE_GPU="1", DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC="1")
    code = textwrap.dedent("""
        import json
        from dask_cuda import LocalCUDACluster
        from distributed import Client
        with LocalCUDACluster(protocol="tcp", dashboard_address=":0", device_memory_limit=None) as cluster, \\
                Client(cluster, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            preloads = client.run(lambda dask_worker: [p.name for p in dask_worker.preloads])
            print(json.dumps({"sum": client.submit(sum, range(10)).result(), "preloads": list(preloads.values())}))
    """)
    proc = procs.run_python(code, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sum"] == 45
    # dask-cuda's own list, then every configured worker preload (the guard in the nanny adds them back).
    assert out["preloads"] == [["dask_cuda.initialize", "ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup",
                                "ucx_dask_gpu.gate.quietclose"]]
    assert "refused" not in proc.stderr


BAD_PEER = textwrap.dedent("""
    import asyncio, json, sys
    from distributed.comm import connect
    from distributed.core import rpc

    address = sys.argv[1]
    FORGED = "w\\n2026-01-01 00:00:00,000 - distributed.scheduler - INFO - forged line"

    async def ask(**kw):
        r = rpc(address)
        try:
            return await asyncio.wait_for(r.ucx_dask_gpu_admit(**kw), 30)
        finally:
            await r.close_rpc()

    async def register(msg):
        comm = await connect(address)
        try:
            await comm.write(msg)
            return await asyncio.wait_for(comm.read(), 30)
        finally:
            await comm.close()

    async def main():
        out = {}
        out["admit: 100 KB role"] = await ask(role="r" * 100_000, peer="w", ident=None, versions=None)
        out["admit: versions a list"] = await ask(role="worker", peer="w", ident=None, versions=[1, 2])
        out["admit: packages a string"] = await ask(role="worker", peer="w", versions={"packages": "dask"})
        out["admit: identity a string"] = await ask(role="worker", peer="w", ident="x")
        out["admit: a newline in the name"] = await ask(role="worker", peer=FORGED, ident=None, versions=None)
        out["admit: unknown fields"] = await ask(role="worker", peer="w", surprise=1)
        out["client: versions a list"] = await register({"op": "register-client", "client": "Client-1",
                                                         "versions": [1]})
        out["client: a newline in its id"] = await register({"op": "register-client", "client": FORGED,
                                                             "versions": {}})
        out["client: no versions"] = await register({"op": "register-client", "client": "Client-2"})
        out["worker: versions a string"] = await register({"op": "register-worker", "address": "tcp://127.0.0.1:9",
                                                           "name": "w", "versions": "x", "extra": {}})
        out["worker: packages a list"] = await register({"op": "register-worker", "address": "tcp://127.0.0.1:9",
                                                         "name": "w", "versions": {"packages": ["dask"]}})
        out["worker: a newline in its name"] = await register({"op": "register-worker",
                                                               "address": "tcp://127.0.0.1:9", "name": FORGED,
                                                               "versions": {}, "extra": {}})
        out["worker: extra a list"] = await register({"op": "register-worker", "address": "tcp://127.0.0.1:9",
                                                      "name": "w", "versions": {}, "extra": [1]})
        print(json.dumps(out, default=repr))

    asyncio.run(main())
""")


def _refusal(answer) -> str:
    """The refusal text of an answer to admit, register-client (a stream-start batch) or register-worker."""
    if isinstance(answer, list):
        answer = answer[0]
    return answer.get("refusal") or answer.get("error") or answer.get("message") or ""


def test_a_peer_sending_malformed_fields_is_answered_and_the_log_stays_one_line_each(procs, scheduler_a):
    """A raw distributed comm to the real scheduler (the guard loaded by the shipped config) sends what no dask peer
    sends: a 100 KB role, non-mappings where mappings belong, names with a newline. Every request gets an answer
    (a refusal naming what is wrong), the scheduler logs one escaped, bounded line per refusal and no traceback, and
    it still accepts a real client afterwards."""
    tmp, address, sched = scheduler_a
    before = len(sched.text().splitlines())
    proc = subprocess.run([sys.executable, "-c", BAD_PEER, address], env=procs.env_for(tmp, None),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(answers) == 13
    for what, answer in answers.items():
        refusal = _refusal(answer)
        assert refusal.startswith(identity.REFUSAL_PREFIX), (what, answer)
        assert "\n" not in refusal and len(refusal) < 2000, (what, refusal[:300])
    assert "malformed request: role has 100000 characters" in _refusal(answers["admit: 100 KB role"])
    assert "versions is a list, expected a mapping" in _refusal(answers["client: versions a list"])
    assert "versions.packages is a list" in _refusal(answers["worker: packages a list"])
    assert "its name contains control characters" in _refusal(answers["worker: a newline in its name"])
    after = new_lines(sched, before)
    assert "Traceback" not in "\n".join(after), after
    assert not [ln for ln in after if ln.startswith("2026-01-01")], after  # the newline did not start a line
    refusals = [ln for ln in after if "ucx-dask-gpu guard: refused" in ln]
    assert len(refusals) == 13 and all(len(ln) < 2000 for ln in refusals), after
    assert not [ln for ln in after if "Register worker" in ln or "Receive client connection" in ln], after
    # Still serving: a real client with the guard is accepted.
    assert client_in_own_env(procs, address, procs.env_for(tmp, None, None) | {
        "DASK_DISTRIBUTED__CLIENT__PRELOAD": f"['{identity.GUARD}']"})["connected"]

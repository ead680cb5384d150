"""Workload pieces that need no cluster: the client-side answers, the projecting reader, argument checks."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from ucx_dask_gpu.proof import from_map, localworkers, transpose
from ucx_dask_gpu.gate import identity
from ucx_dask_gpu.errors import DATA_INVALID, SCHEDULER_UNREACHABLE, USAGE, UserError


@pytest.mark.parametrize("size,chunk", [(10, 3), (9, 9), (7, 2)])
def test_transpose_expected_is_the_numpy_answer(size, chunk):
    # Assemble x from its blocks and let numpy do the whole expression.
    sizes = transpose._chunk_sizes(size, chunk)
    x = np.block([[transpose._random_block(5, i, j, (ri, rj)) for j, rj in enumerate(sizes)]
                  for i, ri in enumerate(sizes)])
    assert x.shape == (size, size)
    assert transpose.transpose_expected(size, chunk, 5) == pytest.approx(float((x + x.T).sum()), rel=1e-12)


def test_the_transpose_sums_split_every_is_the_workloads_not_the_clients_config():
    """The shipped config sets no split_every (dask applies it to every reduction): the workload's sum carries the
    measured one itself, so a client left at dask's default 4 still builds the graph that was measured."""
    import dask
    import dask.array as da

    x = da.ones((40, 40), chunks=4)  # 10x10 blocks: one aggregate task at 100, more levels at 4
    with dask.config.set(split_every=4):
        ours, configs = transpose.transpose_sum(x), (x + x.T).sum()
    with dask.config.set(split_every=transpose.SPLIT_EVERY):
        measured = (x + x.T).sum()
    assert dict(ours.__dask_graph__()).keys() == dict(measured.__dask_graph__()).keys()
    assert len(dict(ours.__dask_graph__())) < len(dict(configs.__dask_graph__()))
    assert float(ours.compute(scheduler="sync")) == 2 * 40 * 40


def test_compare_versions_reports_each_differing_package():
    same = {"packages": {"python": "3.11.7", "dask": "2026.7.1", "numpy": "2.4.6"}}
    other = {"packages": {"python": "3.11.7", "dask": "2026.7.1", "numpy": "2.3.0"}}
    assert identity.compare_versions({"client": same, "scheduler": same, "workers": {"w1": same}}) == \
        {"identical": True, "differences": []}
    out = identity.compare_versions({"client": same, "scheduler": same, "workers": {"w1": same, "w2": other}})
    assert out["identical"] is False
    assert out["differences"] == [{"package": "numpy", "client": "2.4.6", "scheduler": "2.4.6",
                                   "workers": {"w1": "2.4.6", "w2": "2.3.0"}}]


@pytest.mark.parametrize("fmt", ["parquet", "feather"])
def test_reader_reads_only_the_projected_columns(tmp_path, fmt):
    paths, columns = from_map.prepare_dataset(tmp_path, fmt, files=2, rows=100, columns=["b", "d"])
    full = from_map.dataset_table(1, 100, 0)
    part = from_map.ArrowFileReader(fmt, "t")(str(paths[1]), columns=columns)
    assert list(part.columns) == ["b", "d"]
    assert part["b"].sum() == full.column("b").to_numpy().sum()


def test_dask_pushes_the_selection_into_the_reader(tmp_path):
    import dask.dataframe as dd

    paths, _ = from_map.prepare_dataset(tmp_path, "parquet", files=2, rows=10)
    template = from_map.dataset_table(0, 1, 0)
    reader = from_map.ArrowFileReader("parquet", "t")
    df = dd.from_map(reader, [str(p) for p in paths], meta=from_map._meta(template), enforce_metadata=False)
    assert sorted(from_map._find_projection(df[["d", "a"]].sum())) == ["a", "d"]
    assert from_map._find_projection(df.sum(numeric_only=True)) is None


@pytest.mark.parametrize("kwargs,code", [
    ({"columns": ["c"]}, USAGE),            # the string column has no sum to check
    ({"columns": ["a", "a"]}, USAGE),
    ({"files": 0}, USAGE),
    ({"fmt": "csv"}, USAGE),
    ({"write": False}, DATA_INVALID),       # empty directory
])
def test_prepare_dataset_rejects_bad_input(tmp_path, kwargs, code):
    with pytest.raises(UserError) as err:
        from_map.prepare_dataset(tmp_path / "data", **kwargs)
    assert err.value.exit_code == code


def test_prepare_dataset_rejects_foreign_files(tmp_path):
    (tmp_path / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError) as err:
        from_map.prepare_dataset(tmp_path, write=False)
    assert err.value.exit_code == DATA_INVALID


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "workload", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_bad_columns_fail_before_any_cluster_starts(tmp_path):
    proc = _cli("from-map", str(tmp_path), "--columns", "c")
    assert proc.returncode == USAGE
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--columns" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_unreachable_scheduler_has_its_own_exit_code():
    proc = _cli("transpose", "--scheduler", "tcp://127.0.0.1:9", "--timeout", "1")
    assert proc.returncode == SCHEDULER_UNREACHABLE
    assert len(proc.stderr.strip().splitlines()) == 1 and "tcp://127.0.0.1:9" in proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--scheduler", ""], "--scheduler is empty"),
    (["--scheduler", "  "], "--scheduler is empty"),
    (["--min-workers", "0"], "--min-workers must be at least 1 (got 0)"),
    (["--min-workers", "-3"], "--min-workers must be at least 1 (got -3)"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds"),
    (["--wait-workers", "nan"], "--wait-workers a number not below 0"),
    (["--n-workers", "0"], "--n-workers and --threads-per-worker must be at least 1"),
])
def test_cli_waits_without_a_bound_are_refused_before_anything_starts(tmp_path, args, says):
    """Every wait has a bound: a value that would wait forever, or start a local cluster nobody asked for, is one
    line (USAGE) before dask is even imported."""
    for workload in (["transpose"], ["from-map", str(tmp_path / "data")]):
        proc = _cli(*workload, *args)
        assert proc.returncode == USAGE, proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and says in proc.stderr
    assert not (tmp_path / "data").exists()  # from-map wrote nothing


def test_an_import_error_from_client_is_named_for_what_it_is():
    """distributed raises ImportError both for our guard's refusal and for a library that does not load."""
    from ucx_dask_gpu.errors import BINDING_NOT_LOADABLE, ENV_MISMATCH
    from ucx_dask_gpu.proof.client import import_failure

    refusal = f"{identity.REFUSAL_PREFIX} client Client-1: its environment breaks the contract: ..."
    assert import_failure(ImportError(refusal), "ucx://s:8786", "tcp").exit_code == ENV_MISMATCH
    unloadable = ImportError("libucxx.so: cannot open shared object file: No such file or directory")
    ucx = import_failure(unloadable, "ucx://s:8786", "tcp")
    assert ucx.exit_code == BINDING_NOT_LOADABLE and str(ucx).startswith("UCX binding not loadable: ImportError: "
                                                                         "libucxx.so: cannot open")
    assert "ucx-src-build/build.sh install-ucxx" in str(ucx)
    assert import_failure(unloadable, None, "ucx").exit_code == BINDING_NOT_LOADABLE  # a local ucx cluster
    tcp = import_failure(ModuleNotFoundError("No module named 'pyarrow'"), "tcp://s:8786", "tcp")
    assert tcp.exit_code == BINDING_NOT_LOADABLE and "not loadable: ModuleNotFoundError" in str(tcp)


def test_closing_the_client_after_the_scheduler_went_away_keeps_the_runs_outcome():
    """distributed's Client.close() reconnects first once its scheduler is gone; over UCX that connect can raise
    UCXX's own error (not an OSError), which must not replace the run's answer or its one line."""
    ucxx = pytest.importorskip("ucxx", reason="the UCX binding is not installed in this Python")
    from ucx_dask_gpu.proof.client import close_client

    class ClosesLikeAClientWhoseSchedulerRejects:
        closed = 0

        def __init__(self, error: BaseException):
            self.error = error

        def close(self):
            self.closed += 1
            raise self.error

    rejected = ClosesLikeAClientWhoseSchedulerRejects(
        ucxx.exceptions.UCXRejectedError("Endpoint 0x7f5940ac9080 error: Operation rejected by remote peer"))
    close_client(rejected)
    assert rejected.closed == 1
    interrupted = ClosesLikeAClientWhoseSchedulerRejects(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):  # the user's ^C is not a close error
        close_client(interrupted)


def sigint_blocked_in_a_child() -> bool:
    """Whether a process spawned from this thread now starts with SIGINT blocked (its Python reads its own mask)."""
    code = "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "True"


def test_worker_processes_are_spawned_with_sigint_blocked_and_the_thread_gets_its_mask_back():
    """A local cluster's nannies start on one event loop thread at once: the block holds until the last one is done,
    and the thread ends with the mask it had."""
    result = {}

    def loop_thread():
        with localworkers.sigint_blocked_in_children():
            with localworkers.sigint_blocked_in_children():
                result["nested"] = sigint_blocked_in_a_child()
            result["outer"] = sigint_blocked_in_a_child()
        result["after"] = sigint_blocked_in_a_child()
        result["thread_mask"] = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert result == {"nested": True, "outer": True, "after": False, "thread_mask": False}

"""Timestamps of every step of a worker-to-worker transfer, taken inside the worker processes.

`PhaseTracer` is a distributed WorkerPlugin; installed on a worker it wraps, in that process only:
  - the worker's `gather_dep` (fetching side), its `get_data` handler (sending side), `execute`, `handle_stimulus`
    (which state-machine event arrived when) and its connection pool's `connect`;
  - the comm classes' `read` / `write` (TCP and, where loaded, distributed-ucxx's UCXX), the frame
    (de)serialisation they call (`to_frames` / `from_frames`), and for UCXX each `Endpoint.send` / `recv`, the
    receive-buffer allocation (`host_array` / `device_array`) and the device synchronisation before a send or recv.
Each wrapper appends (time.perf_counter(), name, edge, ident, nbytes) to a per-process buffer; `pop_events` returns
and clears it. perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of a host, so the fetching and
the sending worker's events (and the client's) line up on one time axis.

A wrapper costs about a microsecond per call and one transfer makes a few dozen calls: traced runs are for the
breakdown; the timed runs of the measurement are taken without the tracer.
"""
from __future__ import annotations

import functools
import time
from collections import deque

import distributed.comm.tcp as tcp_comm
from distributed import SchedulerPlugin, WorkerPlugin
from distributed.utils import nbytes as buffer_nbytes

MAX_EVENTS = 200_000
EVENTS: deque = deque(maxlen=MAX_EVENTS)
_CLASS_PATCHES: set[str] = set()
_clock = time.perf_counter


def record(name: str, edge: str, ident: int = 0, size: int = -1) -> None:
    EVENTS.append((_clock(), name, edge, ident, size))


def _sized(obj) -> int:
    try:
        return int(buffer_nbytes(obj))
    except Exception:
        return -1


def _comm_ident(comm) -> int:
    """A comm and, for UCXX, its endpoint are tagged with the same number: the comm's id."""
    return id(comm)


def wrap_async(fn, name: str, ident=None, size=None):
    @functools.wraps(fn)
    async def traced(*args, **kwargs):
        i = ident(args, kwargs) if ident else 0
        record(name, "b", i, size(args, kwargs) if size else -1)
        try:
            return await fn(*args, **kwargs)
        finally:
            record(name, "e", i)
    traced.__traced__ = True
    return traced


def wrap_sync(fn, name: str, ident=None, size=None):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        i = ident(args, kwargs) if ident else 0
        record(name, "b", i, size(args, kwargs) if size else -1)
        try:
            return fn(*args, **kwargs)
        finally:
            record(name, "e", i)
    traced.__traced__ = True
    return traced


def _patch(owner, attr: str, wrapper) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "__traced__", False):
        return
    setattr(owner, attr, wrapper(fn))


def _first_arg_ident(args, kwargs):
    return _comm_ident(args[0]) if args else 0


def _ep_ident(args, kwargs):
    # ucxx Endpoint.send/recv(self, buffer, ...): tag the event with the endpoint; comms record which endpoint they use
    return id(args[0]) if args else 0


def _buffer_size(args, kwargs):
    return _sized(args[1]) if len(args) > 1 else -1


def _size_arg(args, kwargs):
    return int(args[0]) if args else -1


def install_comm_patches() -> list[str]:
    """Wrap the comm layer of this process (once). Returns what was wrapped."""
    done = []
    if "tcp" not in _CLASS_PATCHES:
        _patch(tcp_comm.TCP, "read", lambda f: wrap_async(f, "comm.read", _first_arg_ident))
        _patch(tcp_comm.TCP, "write", lambda f: wrap_async(f, "comm.write", _first_arg_ident))
        _patch(tcp_comm, "to_frames", lambda f: wrap_async(f, "to_frames"))
        _patch(tcp_comm, "from_frames", lambda f: wrap_async(f, "from_frames"))
        _CLASS_PATCHES.add("tcp")
    done.append("tcp")
    try:
        import distributed_ucxx.ucxx as ucxx_comm
    except ImportError:
        return done
    if "ucxx" not in _CLASS_PATCHES:
        _patch(ucxx_comm.UCXX, "read", lambda f: wrap_async(f, "comm.read", _ucxx_comm_ident))
        _patch(ucxx_comm.UCXX, "write", lambda f: wrap_async(f, "comm.write", _ucxx_comm_ident))
        _patch(ucxx_comm, "to_frames", lambda f: wrap_async(f, "to_frames"))
        _patch(ucxx_comm, "from_frames", lambda f: wrap_async(f, "from_frames"))
        _patch(ucxx_comm, "host_array", lambda f: wrap_sync(f, "alloc.host", size=_size_arg))
        _patch(ucxx_comm, "synchronize_stream", lambda f: wrap_sync(f, "cuda.sync"))
        from ucxx._lib_async.endpoint import Endpoint

        _patch(Endpoint, "send", lambda f: wrap_async(f, "ep.send", _ep_ident, _buffer_size))
        _patch(Endpoint, "recv", lambda f: wrap_async(f, "ep.recv", _ep_ident, _buffer_size))
        _patch(Endpoint, "send_multi", lambda f: wrap_async(f, "ep.send_multi", _ep_ident))
        _patch(Endpoint, "recv_multi", lambda f: wrap_async(f, "ep.recv_multi", _ep_ident))
        _CLASS_PATCHES.add("ucxx")
    # device_array is chosen when UCXX initialises (first comm): wrap it whenever it is there and not yet wrapped
    if getattr(ucxx_comm, "device_array", None) is not None:
        _patch(ucxx_comm, "device_array", lambda f: wrap_sync(f, "alloc.device", size=_size_arg))
    done.append("ucxx")
    return done


def _ucxx_comm_ident(args, kwargs):
    comm = args[0]
    ep = getattr(comm, "_ep", None)
    if ep is not None:
        EP_OWNER[id(ep)] = id(comm)
    return id(comm)


# endpoint id -> comm id, filled as UCXX comms are used (the analysis maps ep.* events to their comm)
EP_OWNER: dict[int, int] = {}


def _handler_comm_ident(args, kwargs):
    # a handler is called as handler(comm, **msg)
    return _comm_ident(kwargs.get("comm", args[0] if args else None))


def install_worker_patches(worker) -> None:
    """Wrap this worker instance's transfer path (instance attributes: other workers of the process unaffected)."""
    if getattr(worker, "_ucx_dask_gpu_traced", False):
        return
    worker.gather_dep = wrap_async(worker.gather_dep, "gather_dep")
    worker.execute = wrap_async(worker.execute, "execute")
    get_data = worker.handlers["get_data"]
    worker.handlers["get_data"] = wrap_async(get_data, "get_data", _handler_comm_ident)
    handle_stimulus = worker.handle_stimulus

    @functools.wraps(handle_stimulus)
    def traced_stimulus(*stims):
        t = _clock()
        for s in stims:
            EVENTS.append((t, "stimulus:" + type(s).__name__, "i", 0, -1))
        return handle_stimulus(*stims)

    worker.handle_stimulus = traced_stimulus
    connect = worker.rpc.connect

    @functools.wraps(connect)
    async def traced_connect(addr, *args, **kwargs):
        record("connect", "b")
        comm = await connect(addr, *args, **kwargs)
        record("connect", "e", _comm_ident(comm))
        return comm

    worker.rpc.connect = traced_connect
    worker._ucx_dask_gpu_traced = True


class PhaseTracer(WorkerPlugin):
    """Install the tracer on a worker: `client.register_plugin(PhaseTracer())`."""

    name = "ucx-dask-gpu-phase-tracer"

    def setup(self, worker):
        install_comm_patches()
        install_worker_patches(worker)


class TransitionTracer(SchedulerPlugin):
    """The scheduler's task transitions, timestamped on the same clock as the workers' events."""

    name = "ucx-dask-gpu-transition-tracer"

    def __init__(self):
        self.events: deque = deque(maxlen=MAX_EVENTS)

    def transition(self, key, start, finish, *args, **kwargs):
        self.events.append((_clock(), f"{start}>{finish}", str(key)))


def pop_events(dask_worker=None) -> dict:
    """This process's events since the last call (and forget them), with the endpoint -> comm map."""
    install_comm_patches()  # device_array appears once UCXX is initialised: wrap it as soon as it exists
    out = list(EVENTS)
    EVENTS.clear()
    return {"events": out, "ep_owner": dict(EP_OWNER)}


def pop_transitions(dask_scheduler=None) -> list:
    plugin = dask_scheduler.plugins.get(TransitionTracer.name)
    if plugin is None:
        return []
    out = list(plugin.events)
    plugin.events.clear()
    return out

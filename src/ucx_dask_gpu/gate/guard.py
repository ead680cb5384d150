"""Dask preload: the scheduler refuses any worker or client whose environment breaks the contract (identity.py).

Since distributed 2023.4 the scheduler deserializes task graphs, so every role must share one environment; Dask
itself only warns about mismatched versions. Load this module on every role through dask config:

    distributed.scheduler.preload: [ucx_dask_gpu.gate.guard]
    distributed.worker.preload:    [ucx_dask_gpu.gate.guard]
    distributed.client.preload:    [ucx_dask_gpu.gate.guard]
    distributed.nanny.preload:     [ucx_dask_gpu.gate.guard]

How each role takes part (distributed 2026.7):
- scheduler: `dask_setup` wraps the "register-worker" and "register-client" handlers, adds an "admit" handler that
  answers a worker's question before it registers, and marks its "identity" answer so peers know it checks.
  Connections wait for the scheduler to finish starting (preloads included), so no peer gets in before the wrap.
  Each refusal is ONE line in the scheduler's log.
- nanny: `dask_setup` asks the scheduler first ("admit"); a refused nanny logs the scheduler's one-line reason and
  ends its process with exit code ENV_MISMATCH before it starts a worker process, so there is nothing to unwind and
  no traceback. It also adds this module to the preloads the nanny gives its worker process, because launchers that
  pass their own list (`dask cuda worker`, LocalCUDACluster) replace distributed.worker.preload. (`dask worker
  --preload X` also replaces it, and that CLI ignores distributed.nanny.preload: add `--preload
  ucx_dask_gpu.gate.guard`.)
- worker: `dask_setup` adds our identity to the worker's startup information, which the worker sends as `extra` in
  "register-worker"; a worker without a nanny asks "admit" first, as a nanny does. A worker refused at registration
  (it skipped the question) gets status "error", so `Worker.start` raises and the process exits.
- client: a client's preloads start only after it has registered, but the module is imported in
  `Client.__init__`, before connecting. Importing it adds our identity to `distributed.versions.get_versions()`,
  which the client sends in "register-client"; a refusal comes back as the "stream-start" error that makes
  `Client(...)` raise ImportError with our message.
A peer that did not load this module is refused too (it cannot show its environment); the message says how to load
it.
"""
from __future__ import annotations

import logging
from time import time

import distributed.versions as _versions
from distributed import Nanny, Scheduler, Worker

from ..errors import ENV_MISMATCH
from . import identity
from .daskconfig import add_worker_preload

# Under "distributed." so that dask's logging config (format, level, handler) applies to our lines too.
logger = logging.getLogger("distributed.ucx_dask_gpu.guard")
# The scheduler handler a nanny (or a worker without one) asks before registering; rpc names ops with underscores.
ADMIT = "ucx_dask_gpu_admit"


def _add_identity_to_versions() -> None:
    """Make distributed.versions.get_versions() carry our identity (what a client sends when registering)."""
    original = _versions.get_versions
    if getattr(original, "_ucx_dask_gpu", False):
        return

    def get_versions(packages=None):
        out = original(packages)
        out[identity.KEY] = identity.identity()
        return out

    get_versions._ucx_dask_gpu = True
    _versions.get_versions = get_versions


_add_identity_to_versions()


def _peer_identity(extra: dict | None, versions: dict | None) -> dict | None:
    ident = (extra or {}).get(identity.KEY) or (versions or {}).get(identity.KEY)
    return ident if isinstance(ident, dict) else None


def _judge(scheduler, ours: dict, role: str, peer: str, ident: dict | None, versions: dict | None,
           note_accepted: bool = True) -> str | None:
    """The refusal (logged as one line, and recorded as a scheduler event) or None; an accepted peer whose packages
    outside the contract differ gets an info line (`note_accepted`)."""
    refusal = identity.check_peer(ours, role, peer, ident, versions)
    if refusal:
        logger.error("%s", refusal)
        scheduler.log_event("ucx-dask-gpu-guard", {"action": f"refuse-{role}", role: peer, "message": refusal})
        return refusal
    others = identity.other_differences(ours, ident) if note_accepted else []
    if others:
        logger.info("ucx-dask-gpu guard: accepted %s %s (stack id %s); %d packages outside the contract differ "
                    "(scheduler vs %s): %s", role, peer, ours["stack-id"], len(others), role,
                    identity.format_diff(others, limit=5))
    return None


def _install_on_scheduler(scheduler) -> None:
    ours = identity.identity()
    add_worker = scheduler.handlers["register-worker"]
    add_client = scheduler.handlers["register-client"]
    ident_handler = scheduler.handlers["identity"]

    async def admit(comm=None, role="worker", peer="?", ident=None, versions=None):
        # Accepted peers are noted when they register; a refused one never gets that far.
        return {"refusal": _judge(scheduler, ours, role, peer, ident, versions, note_accepted=False)}

    def identity_with_guard(*args, **kwargs):
        out = ident_handler(*args, **kwargs)
        out[identity.KEY] = {"guard": ADMIT, "stack-id": ours["stack-id"]}
        return out

    async def register_worker(comm, **msg):
        peer = msg.get("address", "?")
        ident = _peer_identity(msg.get("extra"), msg.get("versions"))
        refusal = _judge(scheduler, ours, "worker", peer, ident, msg.get("versions"))
        if refusal:
            # The reply a worker with a taken name gets: the worker logs it and its start fails.
            await comm.write({"status": "error", "message": refusal, "time": time()})
            return
        return await add_worker(comm, **msg)

    async def register_client(comm, client, versions, **msg):
        refusal = _judge(scheduler, ours, "client", client, _peer_identity(None, versions), versions)
        if refusal:
            # Client._ensure_connected reads one batch and raises ImportError(error) from a "stream-start".
            await comm.write([{"op": "stream-start", "error": refusal}])
            return
        return await add_client(comm, client=client, versions=versions, **msg)

    scheduler.handlers[ADMIT] = admit
    scheduler.handlers["identity"] = identity_with_guard
    scheduler.handlers["register-worker"] = register_worker
    scheduler.handlers["register-client"] = register_client
    logger.info("ucx-dask-gpu guard: scheduler accepts only stack id %s (%s)", ours["stack-id"],
                ", ".join(f"{k} {v or 'missing'}" for k, v in identity.own_contract().items()))


def _label(server) -> str:
    """How the scheduler's log names a worker that asks: its name and the address it listens on."""
    name = getattr(server, "name", None)
    return server.address if name in (None, "", server.address) else f"{name} ({server.address})"


async def _admit_or_exit(server) -> None:
    """Ask the scheduler whether this worker may join; refused: its one-line reason, then exit ENV_MISMATCH.

    A scheduler that cannot be reached, or runs no guard, is not asked: the worker's own registration then
    reaches it (or times out) as usual.
    """
    try:
        info = await server.scheduler.identity()
    except Exception:  # unreachable or not a scheduler: distributed's own start-up says so
        return
    if not isinstance(info, dict) or not isinstance(info.get(identity.KEY), dict):
        return
    reply = await server.scheduler.ucx_dask_gpu_admit(role="worker", peer=_label(server), ident=identity.identity(),
                                                      versions=_versions.get_versions())
    refusal = (reply or {}).get("refusal")
    if refusal:
        logger.error("%s", refusal)
        # BaseException: not caught by the preload runner or Server.start, so nothing is logged twice; the CLI
        # (`dask worker`) ends with this exit code.
        raise SystemExit(ENV_MISMATCH)


async def dask_setup(dask_object) -> None:
    if isinstance(dask_object, Scheduler):
        _install_on_scheduler(dask_object)
    elif isinstance(dask_object, Nanny):
        # without this, `dask cuda worker`'s workers would register without an identity
        add_worker_preload(dask_object, __name__)
        await _admit_or_exit(dask_object)
    elif isinstance(dask_object, Worker):
        dask_object.startup_information[identity.KEY] = lambda worker: identity.identity()
        if dask_object.nanny is None:
            await _admit_or_exit(dask_object)
    # Client: nothing left to do; importing this module already made its registration carry the identity.

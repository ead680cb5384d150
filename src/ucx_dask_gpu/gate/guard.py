"""Dask preload: the scheduler refuses any worker or client whose stack id differs from its own, at connect time.

Since distributed 2023.4 the scheduler deserializes task graphs, so every role must share one environment; Dask
itself only warns about mismatched versions. Load this module on every role through dask config:

    distributed.scheduler.preload: [ucx_dask_gpu.gate.guard]
    distributed.worker.preload:    [ucx_dask_gpu.gate.guard]
    distributed.client.preload:    [ucx_dask_gpu.gate.guard]
    distributed.nanny.preload:     [ucx_dask_gpu.gate.guard]

How each role takes part (distributed 2026.7):
- scheduler: `dask_setup` wraps the "register-worker" and "register-client" handlers. Connections wait for the
  scheduler to finish starting (preloads included), so no peer gets in before the wrap.
- worker: `dask_setup` runs before the worker registers; it adds our identity to the worker's startup
  information, which the worker sends as `extra` in "register-worker". A refused worker gets status "error", so
  `Worker.start` raises and the process exits instead of retrying.
- nanny: `dask_setup` adds this module to the preloads the nanny gives its worker process, because launchers
  that pass their own list (`dask cuda worker`, LocalCUDACluster) replace distributed.worker.preload. (`dask worker
  --preload X` also replaces it, and that CLI ignores distributed.nanny.preload: add
  `--preload ucx_dask_gpu.gate.guard`.)
- client: a client's preloads start only after it has registered, but the module is imported in
  `Client.__init__`, before connecting. Importing it adds our identity to `distributed.versions.get_versions()`,
  which the client sends in "register-client"; a refusal comes back as the "stream-start" error that makes
  `Client(...)` raise ImportError with our message.
A peer that did not load this module is refused too (it cannot show a stack id); the message says so.
Without a stack id of its own (outside the image) the scheduler warns once and checks nothing.
"""
from __future__ import annotations

import logging
from time import time

import distributed.versions as _versions
from distributed import Nanny, Scheduler, Worker

from . import identity

# Under "distributed." so that dask's logging config (format, level, handler) applies to our lines too.
logger = logging.getLogger("distributed.ucx_dask_gpu.guard")
_warned_no_id = False


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


def _note_same_id_other_packages(ours: dict, role: str, peer: str, ident: dict | None) -> None:
    # Same stack id is the contract; a changed package list inside it (a pip install in one container) is worth a line.
    if ident and ident.get("packages-sha256") != ours["packages-sha256"]:
        diff = identity.package_diff(identity.decode_packages(ours["packages"]),
                                    identity.decode_packages(ident.get("packages") or ""))
        logger.warning("ucx-dask-gpu guard: %s %s has stack id %s but different packages (scheduler vs %s): %s",
                       role, peer, ours["stack-id"], role, identity.format_diff(diff))


def _install_on_scheduler(scheduler) -> None:
    global _warned_no_id
    ours = identity.identity()
    if ours["stack-id"] is None:
        if not _warned_no_id:
            _warned_no_id = True
            logger.warning("ucx-dask-gpu guard: this scheduler has no stack id (%s unset, %s absent): not in the "
                           "image, so workers and clients are not checked", identity.STACK_ID_ENV,
                           identity.STACK_ID_FILE)
        return
    add_worker = scheduler.handlers["register-worker"]
    add_client = scheduler.handlers["register-client"]

    async def register_worker(comm, **msg):
        peer = msg.get("address", "?")
        ident = _peer_identity(msg.get("extra"), msg.get("versions"))
        refusal = identity.check_peer(ours, "worker", peer, ident, msg.get("versions"))
        if refusal:
            logger.error("%s", refusal)
            scheduler.log_event("ucx-dask-gpu-guard", {"action": "refuse-worker", "worker": peer,
                                                       "message": refusal})
            # The reply a worker with a taken name gets: the worker logs it and its start fails.
            await comm.write({"status": "error", "message": refusal, "time": time()})
            return
        _note_same_id_other_packages(ours, "worker", peer, ident)
        return await add_worker(comm, **msg)

    async def register_client(comm, client, versions, **msg):
        ident = _peer_identity(None, versions)
        refusal = identity.check_peer(ours, "client", client, ident, versions)
        if refusal:
            logger.error("%s", refusal)
            scheduler.log_event("ucx-dask-gpu-guard", {"action": "refuse-client", "client": client,
                                                       "message": refusal})
            # Client._ensure_connected reads one batch and raises ImportError(error) from a "stream-start".
            await comm.write([{"op": "stream-start", "error": refusal}])
            return
        _note_same_id_other_packages(ours, "client", client, ident)
        return await add_client(comm, client=client, versions=versions, **msg)

    scheduler.handlers["register-worker"] = register_worker
    scheduler.handlers["register-client"] = register_client
    logger.info("ucx-dask-gpu guard: scheduler accepts only stack id %s", ours["stack-id"])


def _add_to_worker_preloads(nanny) -> None:
    """Make the nanny's worker process load this module too, even when the launcher passed its own preload list.

    `dask cuda worker` and LocalCUDACluster give the nanny preload=[..., "dask_cuda.initialize"], which replaces
    distributed.worker.preload from config; without this their workers would register without an identity.
    """
    preload = [nanny.preload] if isinstance(nanny.preload, str) else list(nanny.preload or [])
    if __name__ in preload:
        return
    argv = list(nanny.preload_argv or [])
    if argv and not isinstance(argv[0], str):  # one argv list per preload: ours takes none
        argv.append([])
    nanny.preload = preload + [__name__]
    nanny.preload_argv = argv


def dask_setup(dask_object) -> None:
    if isinstance(dask_object, Scheduler):
        _install_on_scheduler(dask_object)
    elif isinstance(dask_object, Worker):
        dask_object.startup_information[identity.KEY] = lambda worker: identity.identity()
    elif isinstance(dask_object, Nanny):
        _add_to_worker_preloads(dask_object)
    # Client: nothing left to do; importing this module already made its registration carry the identity.

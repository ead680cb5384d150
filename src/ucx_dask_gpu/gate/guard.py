"""Dask preload: the scheduler refuses any worker or client whose environment breaks the contract (identity.py).

Since distributed 2023.4 the scheduler deserializes task graphs, so every role must share one environment; Dask
itself only warns about mismatched versions. Load this module on every role through dask config
(`distributed.{scheduler,worker,nanny,client}.preload`, as the shipped config does).

How each role takes part (distributed 2026.7):
- scheduler: `dask_setup` wraps the "register-worker" and "register-client" handlers, adds an "admit" handler that
  answers a worker's question before it registers, and marks its "identity" answer so peers know it checks.
  Connections wait for the scheduler to finish starting (preloads included), so no peer gets in before the wrap.
  Each refusal is ONE line in the scheduler's log.
- nanny: `dask_setup` makes sure a scheduler answers and asks it ("admit", `_admit_or_exit`) before it starts a
  worker process: a refused nanny logs the scheduler's one-line reason and ends with ENV_MISMATCH, with nothing to
  unwind and no traceback. It also adds this module to its worker's preloads (`add_worker_preloads`).
- worker: `dask_setup` adds our identity to the worker's startup information, which the worker sends as `extra` in
  "register-worker"; a worker without a nanny asks "admit" first, as a nanny does. A worker refused at registration
  (it skipped the question) gets status "error", so `Worker.start` raises and the process exits.
- client: a client's preloads start only after it has registered, but the module is imported in
  `Client.__init__`, before connecting. Importing it adds our identity to `distributed.versions.get_versions()`,
  which the client sends in "register-client"; a refusal comes back as the "stream-start" error that makes
  `Client(...)` raise ImportError with our message.
"""
from __future__ import annotations

import asyncio
import logging
import os
from time import time

import distributed.versions as _versions
from distributed import Nanny, Scheduler, Worker

from ..errors import ENV_MISMATCH, NOT_A_SCHEDULER, UserError
from . import identity, peermsg
from .peer import await_scheduler, parse_address
from .daskconfig import add_worker_preloads, configured_worker_preloads

# Under "distributed." so that dask's logging config (format, level, handler) applies to our lines too.
logger = logging.getLogger("distributed.ucx_dask_gpu.guard")
# The scheduler handler a nanny (or a worker without one) asks before registering; rpc names ops with underscores.
ADMIT = "ucx_dask_gpu_admit"
# How long after its process started a worker gives up waiting for its scheduler when no --death-timeout is given
# (docs/image.md); at least MIN_WAIT_S of waiting, whenever the pre-check starts.
START_WAIT_S = 30.0
MIN_WAIT_S = 10.0
# With --death-timeout, dask ends the whole start then: the pre-check ends this much earlier, with its line.
DEATH_MARGIN_S = 2.5


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
    """The identity a peer sent (a worker in its startup information, a client in its versions), checked
    (peermsg.ident); None when it sent none."""
    ident = (extra or {}).get(identity.KEY)
    if ident is None:
        ident = (versions or {}).get(identity.KEY)
    return peermsg.ident(ident)


def _refuse(scheduler, role: str, label: str, refusal: str) -> str:
    logger.error("%s", refusal)
    scheduler.log_event("ucx-dask-gpu-guard", {"action": f"refuse-{role}", role: label, "message": refusal})
    return refusal


def _judge(scheduler, ours: dict, role: str, label: str, ident: dict | None, versions: dict | None,
           note_accepted: bool = True) -> str | None:
    """The refusal (logged as one line, and recorded as a scheduler event) or None; an accepted peer whose packages
    outside the contract differ gets an info line (`note_accepted`). `label` is already fit for a log line
    (peermsg.shown); `ident` and `versions` were checked by peermsg."""
    refusal = identity.check_peer(ours, role, label, ident, versions)
    if refusal:
        return _refuse(scheduler, role, label, refusal)
    others = identity.other_differences(ours, ident) if note_accepted else []
    if others:
        logger.info("ucx-dask-gpu guard: accepted %s %s (stack id %s); %d packages outside the contract differ "
                    "(scheduler vs %s): %s", role, label, ours["stack-id"], len(others), role,
                    identity.format_diff(others, limit=5))
    return None


def _malformed(scheduler, role: str, label: str, problem: Exception) -> str:
    return _refuse(scheduler, role, label, f"{identity.REFUSAL_PREFIX} {role} {label}: malformed request: {problem}")


def _install_on_scheduler(scheduler) -> None:
    ours = identity.identity()
    ident_handler = scheduler.handlers["identity"]

    def identity_with_guard(*args, **kwargs):
        out = ident_handler(*args, **kwargs)
        out[identity.KEY] = {"guard": ADMIT, "stack-id": ours["stack-id"]}
        return out

    scheduler.handlers[ADMIT] = _admit_handler(scheduler, ours)
    scheduler.handlers["identity"] = identity_with_guard
    scheduler.handlers["register-worker"] = _register_worker_handler(scheduler, ours,
                                                                     scheduler.handlers["register-worker"])
    scheduler.handlers["register-client"] = _register_client_handler(scheduler, ours,
                                                                     scheduler.handlers["register-client"])
    logger.info("ucx-dask-gpu guard: scheduler accepts only stack id %s (%s)", ours["stack-id"],
                ", ".join(f"{k} {v or 'missing'}" for k, v in identity.own_contract().items()))


def _admit_handler(scheduler, ours: dict):
    """The ADMIT handler: a joining peer's question, answered with a refusal or None."""
    async def admit(comm=None, role="worker", peer="?", ident=None, versions=None, name=None, address=None,
                    **_ignored):
        # Accepted peers are noted when they register; a refused one never gets that far. Whatever a peer sent, it
        # gets an answer: a malformed question is refused like a mismatched environment.
        label = peermsg.shown(peer)
        try:
            role = peermsg.role(role)
            if address is not None:  # a name and its address apart: each has the limit it has when it registers
                label = _label_of("" if name is None else peermsg.name("its name", name),
                                  peermsg.name("its address", address))
            else:  # a guard of an earlier version sends the label only
                label = peermsg.label(peer)
            checked = peermsg.ident(ident), peermsg.versions(versions)
        except peermsg.PeerMessageError as e:
            return {"refusal": _malformed(scheduler, "worker" if role not in peermsg.ROLES else role, label, e)}
        return {"refusal": _judge(scheduler, ours, role, label, *checked, note_accepted=False)}
    return admit


def _register_worker_handler(scheduler, ours: dict, add_worker):
    """register-worker that refuses a worker of another environment before distributed's own handler sees it."""
    async def register_worker(comm, **msg):
        label = peermsg.shown(msg.get("address", "?"))
        try:
            address = peermsg.name("its address", msg.get("address"))
            name = msg.get("name")
            label = _label_of("" if name is None else peermsg.name("its name", name), address)
            extra = peermsg.mapping("extra", msg.get("extra"))
            versions = peermsg.versions(msg.get("versions"))
            refusal = _judge(scheduler, ours, "worker", label, _peer_identity(extra, msg.get("versions")), versions)
        except peermsg.PeerMessageError as e:
            refusal = _malformed(scheduler, "worker", label, e)
        if refusal:
            # The reply a worker with a taken name gets: the worker logs it and its start fails.
            await comm.write({"status": "error", "message": refusal, "time": time()})
            return
        return await add_worker(comm, **msg)
    return register_worker


def _register_client_handler(scheduler, ours: dict, add_client):
    """register-client that refuses a client of another environment before distributed's own handler sees it."""
    async def register_client(comm, client=None, versions=None, **msg):
        label = peermsg.shown(client)
        try:
            label = peermsg.name("its client id", client)
            checked = peermsg.versions(versions)
            refusal = _judge(scheduler, ours, "client", label, _peer_identity(None, versions), checked)
        except peermsg.PeerMessageError as e:
            refusal = _malformed(scheduler, "client", label, e)
        if refusal:
            # Client._ensure_connected reads one batch and raises ImportError(error) from a "stream-start".
            await comm.write([{"op": "stream-start", "error": refusal}])
            return
        return await add_client(comm, client=client, versions=versions, **msg)
    return register_client


def _label_of(name: str, address: str) -> str:
    """How the scheduler's log names a worker: its name and the address it listens on."""
    return address if name in ("", address) else f"{name} ({address})"


def _label(server) -> str:
    """How the scheduler's log names a worker that asks: its name and the address it listens on."""
    name = getattr(server, "name", None)
    return _label_of("" if name is None else str(name), server.address)


async def _admit_or_exit(server) -> None:
    """Make sure a Dask scheduler answers, then ask it whether this worker may join; else one line and exit with its
    code. One deadline for both (await_scheduler says what it waits out): `--death-timeout` when given, else
    START_WAIT_S after the process started. The nanny's own connection comes after, to a scheduler that answered; a
    scheduler that runs no guard is not asked."""
    try:
        addr = parse_address(server.scheduler.addr, "the scheduler address")
    except UserError:  # an address form dask knows and we do not (inproc://, a file): dask's own start handles it
        return
    if server.death_timeout:
        # dask stops the whole start at --death-timeout (a TimeoutError, no word on why): end a little earlier, with
        # the line that says why.
        wait = max(server.death_timeout - DEATH_MARGIN_S, server.death_timeout / 2)
        what = f"--death-timeout {server.death_timeout:g} s"
    else:
        # Counted from the process's start, which is when the user asked for a worker (a loaded host can take many
        # seconds to import dask), with some time left for the scheduler to answer at all.
        wait = max(START_WAIT_S - _process_age(), MIN_WAIT_S)
        what = f"no --death-timeout given: until {START_WAIT_S:.0f} s after the start"
    try:
        info = await await_scheduler(addr, server.scheduler.identity, wait,
                                     lambda line: logger.info("ucx-dask-gpu guard: %s", line), what)
        if not isinstance(info.get(identity.KEY), dict):
            return
        reply = await asyncio.wait_for(server.scheduler.ucx_dask_gpu_admit(
            role="worker", peer=_label(server), name=server.name, address=server.address, ident=identity.identity(),
            versions=_versions.get_versions()),
            max(START_WAIT_S, wait))
    except UserError as e:
        _exit(str(e), e.exit_code)
    except (OSError, asyncio.TimeoutError) as e:
        _exit(f"the scheduler at {addr} answered, then not the guard's question ({type(e).__name__}: {e})",
              NOT_A_SCHEDULER)
    refusal = reply.get("refusal") if isinstance(reply, dict) else None
    if refusal:
        _exit(refusal, ENV_MISMATCH)


def _process_age() -> float:
    """Seconds since this process started (0 where /proc does not say)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(float(f.read().split()[0]) - started, 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def _exit(line: str, code: int) -> None:
    logger.error("%s", line if line.startswith("ucx-dask-gpu guard:") else f"ucx-dask-gpu guard: {line}")
    # BaseException: not caught by the preload runner or Server.start, so nothing is logged twice; the CLI
    # (`dask worker`) ends with this exit code.
    raise SystemExit(code)


async def dask_setup(dask_object) -> None:
    if isinstance(dask_object, Scheduler):
        _install_on_scheduler(dask_object)
    elif isinstance(dask_object, Nanny):
        # Without this, `dask cuda worker`'s workers would register without an identity, and without the configured
        # worker preloads (transports line, quiet close): every launcher's workers load the same list.
        add_worker_preloads(dask_object, [__name__, *configured_worker_preloads()])
        await _admit_or_exit(dask_object)
    elif isinstance(dask_object, Worker):
        dask_object.startup_information[identity.KEY] = lambda worker: identity.identity()
        if dask_object.nanny is None:
            await _admit_or_exit(dask_object)
    # Client: nothing left to do; importing this module already made its registration carry the identity.

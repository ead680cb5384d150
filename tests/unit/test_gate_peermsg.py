"""What a peer sends the guard, checked before use (type, size), and peer text made fit for one log line. The real
scheduler fed these payloads over a real connection is tests/integration/test_guard_cluster.py."""
from __future__ import annotations

import pytest

from ucx_dask_gpu.gate import identity, peermsg
from ucx_dask_gpu.gate.peermsg import PeerMessageError


def test_shown_escapes_control_characters_and_cuts_long_text():
    assert peermsg.shown("w1\n2026-12-02 00:00:00 - distributed.scheduler - INFO - forged") == \
        "w1\\n2026-12-02 00:00:00 - distributed.scheduler - INFO - forged"
    assert peermsg.shown("a\rb\x1b[31mc\x00") == "a\\rb\\x1b[31mc\\x00"
    assert peermsg.shown("gpu-ü-0") == "gpu-ü-0"  # printable text stays as it is
    long = peermsg.shown("r" * 100_000)
    assert long == "r" * peermsg.SHOWN_CHARS + f"...(+{100_000 - peermsg.SHOWN_CHARS} chars)"
    assert peermsg.shown(["not", "text"]) == "['not', 'text']"
    assert "\n" not in peermsg.shown("\n" * 500)


@pytest.mark.parametrize("value, says", [
    ("w\n1", "contains control characters"),
    ("x" * 300, "has 300 characters, at most 255"),
    (["w"], "is a list, expected text"),
    (None, "is nothing, expected text"),
    (b"w", "is bytes, expected text"),
])
def test_names_are_printable_bounded_text(value, says):
    with pytest.raises(PeerMessageError) as err:
        peermsg.name("its name", value)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_names_dask_allows_are_accepted():
    assert peermsg.name("its name", "gpu-0 (tcp://10.0.0.1:40000)") == "gpu-0 (tcp://10.0.0.1:40000)"
    assert peermsg.name("its name", 3) == "3"  # LocalCluster names workers 0, 1, ...
    assert peermsg.label("w-1 (tcp://127.0.0.1:1)") == "w-1 (tcp://127.0.0.1:1)"
    with pytest.raises(PeerMessageError):
        peermsg.label("w\n1 (tcp://127.0.0.1:1)")


def test_a_role_is_one_of_two_words():
    assert peermsg.role("worker") == "worker"
    for bad in ("r" * 100_000, "scheduler", 1, None):
        with pytest.raises(PeerMessageError) as err:
            peermsg.role(bad)
        assert len(str(err.value)) < 200


@pytest.mark.parametrize("versions, says", [
    (["a"], "versions is a list, expected a mapping"),
    ("x", "versions is a string, expected a mapping"),
    ({"packages": ["dask"]}, "versions.packages is a list, expected a mapping"),
    ({"packages": "dask==1"}, "versions.packages is a string, expected a mapping"),
    ({"host": 3}, "versions.host is a number, expected a mapping"),
    ({"packages": {"dask": {"v": 1}}}, "versions.packages[dask] is a mapping, expected text"),
    ({"packages": {"dask": "1" * 1000}}, "has 1000 characters"),
    ({"packages": {f"p{i}": "1" for i in range(peermsg.MAX_PACKAGES + 1)}}, "entries, at most"),
    ({"packages": {1: "1"}}, "a versions.packages key is a number, expected text"),
])
def test_malformed_versions_are_named(versions, says):
    with pytest.raises(PeerMessageError) as err:
        peermsg.versions(versions)
    assert says in str(err.value)


def test_versions_as_distributed_sends_them_pass():
    sent = {"host": {"python": "3.11.7.final.0", "python-bits": 64, "OS": "Linux"},
            "packages": {"dask": "2026.7.1", "cupy": None}, identity.KEY: {"stack-id": "x"}}
    assert peermsg.versions(sent) == {"host": {"python": "3.11.7.final.0", "python-bits": "64", "OS": "Linux"},
                                      "packages": {"dask": "2026.7.1", "cupy": None}}
    assert peermsg.versions(None) is None and peermsg.versions({}) == {}


@pytest.mark.parametrize("ident, says", [
    ("abc", "its identity is a string, expected a mapping"),
    ({"packages": ["dask==1"]}, "identity field packages is a list, expected text"),
    ({"packages": "x" * (peermsg.MAX_PACKAGES_CHARS + 1)}, "characters, at most"),
    ({"python": "3" * 300}, "identity field python has 300 characters"),
    ({7: "x"}, "has a key that is a number"),
])
def test_malformed_identities_are_named(ident, says):
    with pytest.raises(PeerMessageError) as err:
        peermsg.ident(ident)
    assert says in str(err.value)


def test_a_real_identity_passes_unchanged():
    ours = identity.identity()
    assert peermsg.ident(ours) == ours


def test_a_refusal_shows_peer_versions_escaped_on_one_line():
    """A peer without the guard reports its own versions: a version with a newline must not start a log line."""
    ours = identity.identity()
    versions = peermsg.versions({"packages": {"dask": "1.0\nERROR forged", "python": "3.11.1"}})
    refusal = identity.check_peer(ours, "client", "Client-1", None, versions)
    assert "\n" not in refusal and "1.0\\nERROR forged" in refusal


class _Scheduler:
    """What the guard's scheduler side touches: its handlers and its event log."""

    def __init__(self):
        self.handlers = {"register-worker": None, "register-client": None, "identity": lambda: {}}
        self.events: list = []

    def log_event(self, topic, msg):
        self.events.append(msg)


@pytest.mark.parametrize("name, address, refused", [
    ("n" * peermsg.MAX_NAME_CHARS, "ucx://[fd00::1]:" + "1" * 200, None),   # each within its own limit
    ("n" * (peermsg.MAX_NAME_CHARS + 1), "tcp://10.0.0.1:1", "its name has 256 characters"),
    ("w-1", "tcp://" + "a" * peermsg.MAX_NAME_CHARS, "its address has 261 characters"),
    ("w\n1", "tcp://10.0.0.1:1", "its name contains control characters"),
])
def test_the_guard_bounds_a_workers_name_and_address_each_on_its_own(name, address, refused):
    """The name's limit is the one register-worker applies: the address does not count against it."""
    import asyncio

    from ucx_dask_gpu.gate import guard

    scheduler = _Scheduler()
    guard._install_on_scheduler(scheduler)
    ours = identity.identity()
    reply = asyncio.run(scheduler.handlers[guard.ADMIT](role="worker", peer=f"{name} ({address})"[:600], name=name,
                                                         address=address, ident=ours, versions=None))
    if refused is None:
        assert reply == {"refusal": None}
    else:
        assert refused in reply["refusal"] and "\n" not in reply["refusal"]

"""Property tests (Hypothesis): whatever text or peer message arrives, the parsers of stack.toml, of `nvidia-smi topo
-m` text and of byte sizes, and the guard's reading of a peer's message, either return or refuse with their one-line
error; never another exception, never a second line."""
from __future__ import annotations

import asyncio
import copy
import tempfile
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucx_dask_gpu import cliutil, errors, stack
from ucx_dask_gpu.errors import UserError
from ucx_dask_gpu.gate import guard, identity, peermsg
from ucx_dask_gpu.topology.topotext import parse_topo_text

REPO = Path(__file__).resolve().parents[2]
RAW = tomllib.loads((REPO / "stack.toml").read_text())
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=20)


def one_line(e: Exception) -> None:
    assert "\n" not in str(e) and str(e)


# --- stack.toml ----------------------------------------------------------------------------------------------------

def _paths(tree, prefix=()):
    """Every (path, container) of the repository's stack.toml: where a value can be replaced."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


PATHS = list(_paths(RAW))


@FAST
@given(path=st.sampled_from(PATHS), value=values, extra=st.one_of(st.none(), st.text(min_size=1, max_size=12)))
def test_stack_toml_any_value_anywhere_is_a_stack_or_one_line_exit_3(path, value, extra):
    data = copy.deepcopy(RAW)
    parent = data
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    if extra is not None and isinstance(parent, dict):
        parent[extra] = value  # a key the model may not read
    try:
        stack.parse(data, REPO / "stack.toml")
    except UserError as e:
        assert e.exit_code == errors.BAD_STACK
        one_line(e)


@FAST
@given(text=st.text(alphabet=st.sampled_from(list('[]{}"\'#=\n ,abc1.')), max_size=400))
def test_stack_toml_any_text_is_a_stack_or_one_line_exit_3(text):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "stack.toml"
        f.write_text(text)
        try:
            stack.load(f)
        except UserError as e:
            assert e.exit_code == errors.BAD_STACK
            one_line(e)


@FAST
@given(depth=st.integers(min_value=0, max_value=3000), inline=st.booleans())
def test_stack_toml_nesting_is_bounded_before_the_toml_parser_recurses(depth, inline):
    text = "a = " + ("{b = " * depth + "1" + "}" * depth if inline else "[" * depth + "]" * depth) + "\n"
    assert stack.model.toml_depth(text) == depth
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "stack.toml"
        f.write_text(text)
        with pytest.raises(UserError) as e:  # shallow or deep, it is no stack.toml
            stack.load(f)
    assert e.value.exit_code == errors.BAD_STACK
    if depth > stack.model.MAX_DEPTH:
        assert "nested more than" in str(e.value)


# --- nvidia-smi topo -m ----------------------------------------------------------------------------------------------

TOKENS = ["GPU0", "GPU1", "NIC0", "X", "NV18", "PIX", "SYS", "NODE", "PHB", "0-7", "0", "N/A", "CPU Affinity",
          "NUMA Affinity", "Legend:", "NIC Legend:", "NIC0: mlx5_0", "\t", " ", "\x1b[4m", "mlx5_0", "GPU NUMA ID"]


@FAST
@given(lines=st.lists(st.lists(st.sampled_from(TOKENS), max_size=8).map("\t".join), max_size=12))
def test_topo_text_is_a_topology_or_one_line(lines):
    try:
        parse_topo_text("\n".join(lines))
    except UserError as e:
        assert e.exit_code in (errors.BAD_TOPOLOGY, errors.NO_GPU)
        one_line(e)


@FAST
@given(text=st.text(max_size=300))
def test_any_topo_text_is_a_topology_or_one_line(text):
    try:
        parse_topo_text(text)
    except UserError as e:
        assert e.exit_code in (errors.BAD_TOPOLOGY, errors.NO_GPU)
        one_line(e)


# --- byte sizes ------------------------------------------------------------------------------------------------------

@FAST
@given(text=st.one_of(st.text(max_size=12),
                      st.builds(lambda n, u: f"{n}{u}", st.floats(min_value=0, max_value=1e6, allow_nan=False),
                                st.sampled_from(sorted(cliutil.BYTE_SIZES) + ["KIB", " MB", "xb"]))))
def test_byte_sizes_parse_as_dask_parses_them(text):
    from dask.utils import parse_bytes as dasks

    try:
        expected = dasks(text)
    except Exception:  # dask refuses it: so do we, with ValueError, and the option's one line
        with pytest.raises(ValueError):
            cliutil.parse_bytes(text)
        with pytest.raises(UserError) as err:
            cliutil.parse_size(text, "--size")
        assert err.value.exit_code == errors.USAGE
        one_line(err.value)
        return
    assert cliutil.parse_bytes(text) == expected


NUMBERS = st.from_regex(r"\A-?[0-9]{1,400}(\.[0-9]*)?(e-?[0-9]{1,4})? ?[kMGTP]i?B?\Z")  # '1e999': infinite


@FAST
@given(text=st.one_of(st.text(max_size=100), NUMBERS))
def test_a_size_option_is_a_number_of_bytes_or_one_line_exit_2(text):
    try:
        size = cliutil.parse_size(text, "--size")
    except UserError as e:
        assert e.exit_code == errors.USAGE and len(str(e)) < 400
        one_line(e)
    else:
        assert isinstance(size, int) and size >= 1


# --- the guard and what a peer sends ---------------------------------------------------------------------------------

@FAST
@given(value=values)
def test_peer_fields_are_read_or_refused_with_a_phrase(value):
    for check in (peermsg.versions, peermsg.ident, peermsg.role, peermsg.label,
                  lambda v: peermsg.name("its name", v), lambda v: peermsg.mapping("extra", v)):
        try:
            check(value)
        except peermsg.PeerMessageError as e:
            one_line(e)
    shown = peermsg.shown(value)
    assert shown.isprintable() and len(shown) <= peermsg.SHOWN_CHARS * 10 + 30


class _Scheduler:
    def __init__(self):
        self.handlers = {"register-worker": None, "register-client": None, "identity": lambda: {}}

    def log_event(self, topic, msg):
        pass


SCHEDULER = _Scheduler()
guard._install_on_scheduler(SCHEDULER)
OURS = identity.identity()


@FAST
@given(role=st.one_of(st.sampled_from(["worker", "client"]), values), peer=values, name=values, address=values,
       ident=st.one_of(st.just(OURS), values), versions=values)
def test_the_guard_answers_any_question_with_one_line_or_acceptance(role, peer, name, address, ident, versions):
    reply = asyncio.run(SCHEDULER.handlers[guard.ADMIT](role=role, peer=peer, name=name, address=address,
                                                        ident=ident, versions=versions))
    assert set(reply) == {"refusal"}
    assert reply["refusal"] is None or ("\n" not in reply["refusal"] and reply["refusal"])

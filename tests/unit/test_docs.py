"""The documentation stays true to the code: the generated pages (exit codes, CLI map) are current, every exit code of
errors.py is in the table with its meaning, every command README.md and docs/*.md show parses (its subcommands exist
and `--help` works, every option it uses is known there; scripts exist and run; make targets exist), and the README
stays short. Commands are checked against the parser itself, never run."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import signal
from pathlib import Path

import pytest

from tools import docmap
from ucx_dask_gpu import cli, errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# How the other ways in reach the same parser: `python -m MODULE ...` and the thin wrappers.
MODULE_COMMANDS = {"ucx_dask_gpu": [], "ucx_dask_gpu.ucxbuild": ["ucx"], "ucx_dask_gpu.nvlink": ["verify-nvlink"]}
SCRIPT_COMMANDS = {"ucx-src-build/build.sh": ["ucx"], "scripts/verify_nvlink.sh": ["verify-nvlink"],
                   "scripts/build_image.sh": ["image", "build"]}
PROGRAMS = ("ucx-dask-gpu", ".venv/bin/ucx-dask-gpu")
PYTHONS = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
REPO_FILE = re.compile(r"^(scripts|ci|benchmarks|docker|ucx-src-build)/\S+\.(sh|py)$")
# What follows an image in `docker run ... IMAGE COMMAND`: the command is ours when it comes right after one of these.
IMAGE_WORD = re.compile(r"^(\$IMG|IMAGE|\S*ucx-dask-gpu:\S+)$")
SHELL_BLOCKS = {"", "sh", "bash", "shell", "console"}
# Inline spans that name a line a program prints, not a command.
PRINTED_LINES = ("ucx-dask-gpu transports",)


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of every fenced shell block (continuations joined) and every inline code span
    that starts like a command."""
    out, fence, pending = [], None, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\w*)", line)
        if m:
            fence = None if fence is not None else m.group(1)
            continue
        if fence is not None:
            if fence in SHELL_BLOCKS:
                pending += line.strip()
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                else:
                    out.append((n, pending))
                    pending = ""
            continue
        for span in re.findall(r"`([^`]+)`", line):
            words = span.split()
            first = next((w for w in words if "=" not in w), "")
            if (first in PROGRAMS or first == "make" or PYTHONS.match(first) or REPO_FILE.match(first)) \
                    and not span.startswith(PRINTED_LINES):
                out.append((n, span))
    return out


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # prose in a block (an apostrophe): words are enough to find the commands
        return line.split("#", 1)[0].split()


def segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line: split at `&&`, `||`, `;` and at a `|` that starts another command (a `|`
    followed by an option is a synopsis' alternative)."""
    out, current = [], []
    tokens = _tokens(line)
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in ("&&", "||", ";") or (tok == "|" and not nxt.startswith("-")):
            out.append(current)
            current = []
        elif tok.endswith(";") and tok != ";":
            current.append(tok[:-1])
            out.append(current)
            current = []
        else:
            current.append(tok)
    return [s for s in out + [current] if s]


def _clean(word: str) -> str:
    return word.strip("[](){}`,;'\"").rstrip(".…").replace("…", "")


def commands(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """What a simple command runs that the docs must keep working: ("cli", argv of the ucx-dask-gpu parser),
    ("module", name), ("file", path), ("make", target)."""
    out = []
    words = [_clean(t) for t in tokens]
    start = 0
    while start < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[start]):  # VAR=value before it
        start += 1
    for i, word in enumerate(words):
        if REPO_FILE.match(word):
            out.append(("file", [word]))
        ours = i == start or (i > 0 and IMAGE_WORD.match(words[i - 1]))
        if not ours:
            continue
        rest = [w for w in words[i + 1:] if w]
        if word in PROGRAMS:
            out.append(("cli", rest))
        elif word in SCRIPT_COMMANDS:
            out.append(("cli", [*SCRIPT_COMMANDS[word], *rest]))
        elif PYTHONS.match(word) and rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("ucx_dask_gpu"):
            module, args = rest[1], rest[2:]
            out.append(("module", [module]))
            if module in MODULE_COMMANDS:
                out.append(("cli", [*MODULE_COMMANDS[module], *args]))
            elif module.startswith("ucx_dask_gpu.bench."):
                out.append(("cli", ["bench", module.rsplit(".", 1)[1], *args]))
        elif word == "make" and i == start:
            out += [("make", [w]) for w in rest if not w.startswith("-") and "=" not in w]
    return out


def doc_commands() -> list[tuple[str, str, str, list[str]]]:
    """(where, line, kind, words) for every command the docs show."""
    out = []
    for doc in DOCS:
        for n, line in code_lines(doc.read_text()):
            for seg in segments(line):
                for kind, words in commands(seg):
                    out.append((f"{doc.relative_to(ROOT)}:{n}", line, kind, words))
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(parser: argparse.ArgumentParser, words: list[str], path: tuple[str, ...] = ()) -> list[str]:
    """The problems of one command line against the parser (empty: it parses). Alternatives `a|b` in a subcommand's
    place are each checked; an UPPERCASE word there is a placeholder (`COMMAND`)."""
    for i, word in enumerate(words):
        subs = _subparsers(parser)
        if not subs:
            return check_options(parser, words[i:], path)
        if word.startswith("-"):
            problems = check_options(parser, [word], path)
            if problems:
                return problems
            continue
        if word.isupper():
            return []
        alternatives = word.split("|")
        missing = [a for a in alternatives if a not in subs]
        if missing:
            return [f"`{' '.join(path)}` has no subcommand {missing[0]!r} (it has: {', '.join(subs)})"]
        return [p for a in alternatives for p in resolve(subs[a], words[i + 1:], (*path, a))]
    return check_help(parser, path)


def check_options(parser: argparse.ArgumentParser, words: list[str], path: tuple[str, ...]) -> list[str]:
    known = parser._option_string_actions
    problems = []
    for word in words:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if re.match(r"^--?[A-Za-z][\w-]*$", name) and name not in known:
            problems.append(f"`{' '.join(path)}` has no option {name}")
    return problems + check_help(parser, path)


_HELP_CHECKED: dict[tuple[str, ...], list[str]] = {}


def check_help(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    """`ucx-dask-gpu PATH --help` exits 0 (once per path)."""
    if path not in _HELP_CHECKED:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                cli.build_parser().parse_args([*path, "--help"])
                code = None
            except SystemExit as e:
                code = e.code
        _HELP_CHECKED[path] = [] if code == 0 and "usage:" in out.getvalue() else \
            [f"`ucx-dask-gpu {' '.join(path)} --help` exited {code}: {out.getvalue()[-300:]}"]
    return _HELP_CHECKED[path]


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([^\s#=:][^:=]*?)\s*:(?!=)", line)
        if m and "$" not in m.group(1) and "%" not in m.group(1):
            targets.update(m.group(1).split())
    return targets


COMMANDS = doc_commands()


def test_the_docs_show_commands_of_every_kind():
    """The scan itself finds what it must (else every check below would pass on nothing)."""
    kinds = {kind for _, _, kind, _ in COMMANDS}
    assert kinds == {"cli", "module", "file", "make"}, kinds
    shown = {(kind, words[0]) for _, _, kind, words in COMMANDS if words}
    assert {("cli", "verify-nvlink"), ("cli", "image"), ("make", "test"), ("cli", "ucx"),
            ("file", "ci/start_dockerd.sh")} <= shown


def test_every_ucx_dask_gpu_command_the_docs_show_parses():
    parser = cli.build_parser()
    problems = [f"{where}: {p}\n    {line}" for where, line, kind, words in COMMANDS if kind == "cli"
                for p in resolve(parser, words)]
    assert not problems, "\n".join(problems)


def test_every_module_script_and_make_target_the_docs_show_exists():
    targets = make_targets()
    problems = []
    for where, line, kind, words in COMMANDS:
        if kind == "module" and importlib.util.find_spec(words[0]) is None:
            problems.append(f"{where}: no module {words[0]}")
        elif kind == "file":
            path = ROOT / words[0]
            if not path.is_file() or (path.suffix == ".sh" and not os.access(path, os.X_OK)):
                problems.append(f"{where}: {words[0]} is not {'an executable' if path.is_file() else 'a'} file")
        elif kind == "make" and words[0] not in targets:
            problems.append(f"{where}: no make target {words[0]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line, problem", [
    ("ucx-dask-gpu stak get x", "has no subcommand 'stak'"),
    ("ucx-dask-gpu stack get --jsn x", "has no option --jsn"),
    ("docker run --rm $IMG ucx-dask-gpu workload transpose --scheduler tcp://s:1 --bakend cupy", "no option --bakend"),
    ("ucx-dask-gpu conda render|lnt", "has no subcommand 'lnt'"),
    ("python3 -m ucx_dask_gpu.ucxbuild fetch --al", "no option --al"),
    ("scripts/verify_nvlink.sh --ucx-prefx /opt/ucx", "no option --ucx-prefx"),
])
def test_the_check_finds_a_wrong_command(line, problem):
    parser = cli.build_parser()
    found = [p for seg in segments(line) for kind, words in commands(seg) if kind == "cli"
             for p in resolve(parser, words)]
    assert any(problem in p for p in found), found


def test_a_synopsis_and_other_programs_are_read_as_such():
    line = "ucx-dask-gpu workload transpose [--scheduler ADDR | --protocol tcp|ucx] [--json] | head -3 && make unit"
    assert commands(segments(line)[0]) == [("cli", ["workload", "transpose", "--scheduler", "ADDR", "|",
                                                    "--protocol", "tcp|ucx", "--json"])]
    assert commands(segments(line)[1]) == [] and commands(segments(line)[2]) == [("make", ["unit"])]
    # a package named like the command is not the command
    assert commands(shlex.split("conda install -c ourchannel ucx-dask-gpu cuda-version=13.0")) == []


def test_the_generated_pages_are_current():
    """docs/exit-codes.md and docs/cli.md: `python -m tools.docmap --write` after changing errors.py or a
    command."""
    root = ROOT
    for page, (source, region) in docmap.pages(root).items():
        assert docmap.render(page, source, region) == page.read_text(), \
            f"{page.relative_to(root)} is out of date: run `python -m tools.docmap --write`"


def _table_rows(page: Path) -> dict[int, tuple[str, str]]:
    rows = {}
    for line in page.read_text().splitlines():
        m = re.match(r"^\| (\d+) \| (.+) \| `([A-Z0-9_]+)` \|$", line)
        if m:
            rows[int(m.group(1))] = (m.group(3), m.group(2).replace("\\|", "|"))
    return rows


def test_every_exit_code_is_in_the_table_once_with_its_meaning():
    constants = {name: value for name, value in vars(errors).items()
                 if name.isupper() and isinstance(value, int) and not isinstance(value, bool)}
    assert len(set(constants.values())) == len(constants), "two names share an exit code"
    parsed = {code: (name, text) for name, code, text in docmap.exit_codes(Path(errors.__file__).read_text())
              if code is not None}
    assert {name: code for code, (name, _) in parsed.items()} == constants, "errors.py: a code without its comment?"
    table = _table_rows(ROOT / "docs" / "exit-codes.md")
    assert table == parsed


def test_a_code_without_a_meaning_is_refused():
    with pytest.raises(errors.UserError, match="NEW_CODE = 99 has no comment"):
        docmap.exit_codes("OK = 1  # fine\nNEW_CODE = 99\n")
    rows = docmap.exit_codes("# Things (1-9)\nA = 1  # first line\n                # and more\nB = 2  # b\n")
    assert rows == [("group", None, "Things (1–9)"), ("A", 1, "first line and more"), ("B", 2, "b")]


def test_the_cli_map_names_every_command_and_a_file_that_exists():
    page = (ROOT / "docs" / "cli.md").read_text()
    rows = docmap.command_rows(ROOT)
    leaves = [r for r in rows if r[2] is not None]
    assert {r[0].split()[1] for r in rows} == set(_subparsers(cli.build_parser()))
    for command, _, module, _ in rows:
        assert f"| `{command}` |" in page
    for target in re.findall(r"\]\(\.\./([^)]+)\)", page):
        assert (ROOT / target).is_file(), target
    # the benchmark studies are run by a handler of bench/common.py made for each study: the map names the study
    assert {r[2] for r in leaves if r[0].startswith("ucx-dask-gpu bench ")} >= {
        "ucx_dask_gpu.bench.transpose", "ucx_dask_gpu.bench.svd", "ucx_dask_gpu.bench.transfer"}
    assert "[`ucx/doctor.py`]" in next(r[3] for r in rows if r[0] == "ucx-dask-gpu doctor")


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move details to a page under docs/"



@pytest.mark.parametrize("sig, meaning", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM"),
                                          (signal.SIGPIPE, "the reader of its output went away")],
                         ids=["SIGINT", "SIGTERM", "SIGPIPE"])
def test_the_exit_codes_of_a_signal_are_documented_beside_the_table(sig, meaning):
    """130, 143 and 141 come from the signal, not from errors.py: the page says them in its own words."""
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    assert re.search(rf"^- {128 + sig}: .*{meaning}", text, re.M), f"{128 + sig} ({sig.name}) is not documented"

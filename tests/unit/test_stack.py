"""stack.toml validation: the repository's file loads, and every kind of bad input fails with one line naming the key.

Bad inputs are made by mutating the parsed repository file, so the tests follow stack.toml as it evolves.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.errors import BAD_STACK, UserError

REPO = Path(__file__).resolve().parents[2]
STACK_TOML = REPO / "stack.toml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return tomllib.loads(STACK_TOML.read_text())


def parse(data: dict) -> stack.Stack:
    return stack.parse(data, STACK_TOML)


def bad(raw: dict, mutate) -> str:
    """Apply `mutate` to a copy, expect a StackError; return its message."""
    data = copy.deepcopy(raw)
    mutate(data)
    with pytest.raises(stack.StackError) as e:
        parse(data)
    assert e.value.exit_code == BAD_STACK
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# --- the repository's file ----------------------------------------------------------------------------------------

def test_repository_stack_loads_and_is_consistent():
    st = stack.load(STACK_TOML)
    archives = st.source_archives()
    assert [a.name for a in archives] == ["UCX", "UCXX", "rapids-cmake", "CPM.cmake"]
    for src in archives:
        assert stack.SHA256_RE.match(src.sha256) and len(src.content_tree) == 40 and len(src.commit) == 40
        assert src.urls and all(src.tag in u for u in src.urls), "each URL is the archive of the pinned tag"
    assert len({a.archive for a in archives}) == len(archives)
    assert not {f.split("=")[0] for f in st.configure_flags} & stack.BUILD_DETECTED_FLAGS
    assert st.required_modules and all(m.endswith(".so") for m in st.required_modules)
    names = [a.filename for a in st.cuda_header_wheels + st.cuda_link_debs]
    assert len(names) == len(set(names))
    assert [p.name for p in st.ucxx.packages] == ["libucxx", "ucxx", "distributed-ucxx"], "built in this order"
    assert not any(r.startswith(("libucx", "ucxx", "libucxx", "distributed-ucxx")) for r in st.python.requirements), \
        "UCXX is built from source and no libucx wheel may shadow our UCX"


def test_stack_get_reads_values_for_shell(raw):
    """Shell scripts read values with `python3 -m ucx_dask_gpu stack get KEY` (stdlib only, PYTHONPATH=src)."""
    out = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "stack", "get", "ucx.source.content_tree"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == raw["ucx"]["source"]["content_tree"]


# --- bad inputs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, why", [
    ("abc", "64 lowercase hex"),
    ("A" * 64, "64 lowercase hex"),
    ("0" * 63, "64 lowercase hex"),
    (123, "expected str"),
])
def test_bad_sha256(raw, value, why):
    msg = bad(raw, lambda d: d["ucx"]["source"].__setitem__("sha256", value))
    assert "ucx.source.sha256" in msg and why in msg


@pytest.mark.parametrize("table", ["source", "rapids_cmake", "cpm"])
@pytest.mark.parametrize("key, value", [("content_tree", "abc"), ("commit", "G" * 40), ("content_tree", "0" * 41)])
def test_bad_git_ids(raw, table, key, value):
    msg = bad(raw, lambda d: d["ucxx"][table].__setitem__(key, value))
    assert f"ucxx.{table}.{key}" in msg and "40 lowercase hex" in msg


@pytest.mark.parametrize("url", [
    "github.com/openucx/ucx/ucx.tar.gz",        # no scheme
    "ftp://example.org/ucx.tar.gz",            # unsupported scheme
    "https://example.org/dir/",                # not a file
    "https://exa mple.org/ucx.tar.gz",          # whitespace
    "https:///ucx.tar.gz",                     # no host
])
def test_bad_source_url(raw, url):
    msg = bad(raw, lambda d: d["ucx"]["source"].__setitem__("urls", [url]))
    assert "ucx.source.urls[0]" in msg and "URL" in msg


@pytest.mark.parametrize("archive", ["dir/ucx.tar.gz", "ucx.zip", ""])
def test_bad_archive_name(raw, archive):
    assert "archive" in bad(raw, lambda d: d["ucx"]["source"].__setitem__("archive", archive))


def test_version_must_be_a_string(raw):
    msg = bad(raw, lambda d: d["ucx"]["source"].__setitem__("version", True))
    assert "ucx.source.version" in msg and "bool" in msg


def test_missing_key_named(raw):
    msg = bad(raw, lambda d: d["ucxx"]["cpm"].pop("content_tree"))
    assert "ucxx.cpm.content_tree" in msg and "missing" in msg


def test_duplicate_archive(raw):
    def dup(d):
        d["ucxx"]["cpm"]["archive"] = d["ucx"]["source"]["archive"]
    assert "appears twice" in bad(raw, dup)


def test_ucxx_packages_are_checked(raw):
    assert "-DNAME=VALUE" in bad(raw, lambda d: d["ucxx"]["build"]["packages"][0]["cmake_args"].append("ON"))
    assert "appears twice" in bad(raw, lambda d: d["ucxx"]["build"]["packages"][1].__setitem__("name", "libucxx"))
    assert "inside the repository" in bad(raw, lambda d: d["ucxx"]["build"].__setitem__("lock", "/tmp/x.txt"))
    assert "at least one" in bad(raw, lambda d: d["ucxx"]["build"].__setitem__("packages", []))


def test_configure_flag_must_be_an_option(raw):
    assert "--option" in bad(raw, lambda d: d["ucx"]["configure"]["flags"].append("enable-mt"))


@pytest.mark.parametrize("flag", ["--with-cuda=/usr/local/cuda", "--without-verbs", "--prefix=/opt/ucx"])
def test_build_detected_flags_are_not_written_in_stack(raw, flag):
    msg = bad(raw, lambda d: d["ucx"]["configure"]["flags"].append(flag))
    assert "set by the build" in msg


def test_required_module_names(raw):
    assert "lib/ucx" in bad(raw, lambda d: d["ucx"]["configure"]["required_modules"].append("ucx/libuct_ib.so"))


def test_bad_cuda_major_and_epoch(raw):
    assert "12 or 13" in bad(raw, lambda d: d["stack"].__setitem__("cuda_major", 11))
    assert "positive" in bad(raw, lambda d: d["stack"].__setitem__("source_date_epoch", -1))


@pytest.mark.parametrize("lock", ["/etc/passwd", "../outside.txt"])
def test_lock_path_stays_in_repo(raw, lock):
    assert "inside the repository" in bad(raw, lambda d: d["python"].__setitem__("lock", lock))


@pytest.mark.parametrize("key, value, why", [("parts_dir", "tmp/parts", "absolute"),
                                             ("root", "/tmp/../root", "absolute"),
                                             ("profiler", "py-spy>=0.4", "NAME==VERSION")])
def test_gpu_host_values_are_checked(raw, key, value, why):
    msg = bad(raw, lambda d: d["gpu_host"].__setitem__(key, value))
    assert f"gpu_host.{key}" in msg and why in msg


def test_bad_artifact(raw):
    msg = bad(raw, lambda d: d["cuda"]["link_debs"][0].__setitem__("url", "not a url"))
    assert "cuda.link_debs[0].url" in msg


def test_unsupported_schema(raw):
    assert "schema" in bad(raw, lambda d: d.__setitem__("schema", 2))


def test_malformed_toml_file(tmp_path):
    f = tmp_path / "stack.toml"
    f.write_text(STACK_TOML.read_text().replace("[stack]", "[stack", 1))
    with pytest.raises(UserError) as e:
        stack.load(f)
    assert e.value.exit_code == BAD_STACK and "not valid TOML" in str(e.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(UserError) as e:
        stack.load(tmp_path / "missing.toml")
    assert e.value.exit_code == BAD_STACK


def test_cli_bad_stack_is_one_line_and_exit_code(tmp_path):
    f = tmp_path / "stack.toml"
    f.write_text(STACK_TOML.read_text().replace('tag = "v1.20.1"', 'tag = 1', 1))
    out = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "stack", "--file", str(f), "validate"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == BAD_STACK
    assert len(out.stderr.strip().splitlines()) == 1 and "ucx.source.tag" in out.stderr


def test_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    f = tmp_path / "stack.toml"
    f.write_bytes(STACK_TOML.read_bytes().replace(b"[stack]", b"# caf\xe9\n[stack]", 1))
    line = f.read_bytes().split(b"\n").index(b"# caf\xe9") + 1
    with pytest.raises(UserError) as e:
        stack.load(f)
    assert e.value.exit_code == BAD_STACK and f"byte 0xe9 on line {line}" in str(e.value) and "\n" not in str(e.value)


def test_a_stack_file_that_cannot_be_read_is_exit_3(tmp_path, monkeypatch):
    monkeypatch.setenv(stack.model.STACK_ENV, str(tmp_path))  # a directory: read() fails, as root too
    with pytest.raises(UserError) as e:
        stack.load()
    assert e.value.exit_code == BAD_STACK and "cannot read" in str(e.value)


def test_lock_only_an_unknown_lock_is_one_line(capsys):
    from ucx_dask_gpu.cli import main

    assert main(["stack", "lock", "--only", "locks/nope.txt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ucx-dask-gpu stack: error: --only: not a lock of stack.toml: locks/nope.txt"]


# --- keys no consumer reads, and bounds ---------------------------------------------------------------------------

def test_a_misspelled_key_is_refused_with_the_nearest_known_one(raw):
    msg = bad(raw, lambda d: d["ucxx"].__setitem__("min_uxc", "1.19"))
    assert msg == "stack.toml.ucxx.min_uxc: unknown key (did you mean min_ucx?)"
    assert "packages[1].pth: unknown key (did you mean path?)" in \
        bad(raw, lambda d: d["ucxx"]["build"]["packages"][1].__setitem__("pth", "x"))
    assert bad(raw, lambda d: d.__setitem__("zzz", {})) == "stack.toml.zzz: unknown key"


def test_a_missing_key_beside_a_misspelling_names_both(raw):
    msg = bad(raw, lambda d: d["ucxx"].__setitem__("min_uxc", d["ucxx"].pop("min_ucx")))
    assert msg == "stack.toml.ucxx.min_ucx: missing (is 'min_uxc' a misspelling?)"


def test_free_form_tables_take_any_key(raw):
    data = copy.deepcopy(raw)
    data["conda"]["names"]["some-new-wheel"] = "some-new-package"
    assert parse(data).conda.names["some-new-wheel"] == "some-new-package"


def test_strings_and_nesting_are_bounded(raw):
    long = "1" * (stack.model.MAX_STRING + 1)
    assert "a string of 4097 characters" in bad(raw, lambda d: d["ucxx"].__setitem__("min_ucx", long))
    assert "a key of 4097 characters" in bad(raw, lambda d: d["ucxx"].__setitem__(long, 1))
    deep: list = []
    for _ in range(100):
        deep = [deep]
    assert "nested more than 16 levels" in bad(raw, lambda d: d["stack"].__setitem__("x", deep))


@pytest.mark.parametrize("text, why", [
    ("a = " + "[" * 1000 + "]" * 1000 + "\n", "nested more than 16 levels deep"),
    ("a = " + "{b = " * 1000 + "1" + "}" * 1000 + "\n", "nested more than 16 levels deep"),
    ('a = "' + "x" * (1 << 20) + '"\n', "larger than 1048576 bytes"),
])
def test_a_hostile_file_is_one_line_before_the_toml_parser_runs(tmp_path, text, why):
    f = tmp_path / "stack.toml"
    f.write_text(text)
    with pytest.raises(UserError) as e:
        stack.load(f)
    assert e.value.exit_code == BAD_STACK and why in str(e.value)


@pytest.mark.parametrize("text, depth", [
    ('a = "[[[[["\n', 0), ("a = '{{{'  # [[[\n", 0), ('a = """\n[[[\n"""\n', 0), ('a = "\\"[["\n', 0),
    ("a = [[1], {b = [2]}]\n", 3), ("[[t.u]]\n", 2),
])
def test_toml_depth_skips_strings_and_comments(text, depth):
    assert stack.model.toml_depth(text) == depth
    tomllib.loads(text)

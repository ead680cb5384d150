"""The publish path refuses stand-in packages: a package planted where an upload reads stops the whole upload with one
line and its own exit code, before anything is sent; nothing is skipped or kept silently."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import conda_package_handling.api as cph
import pytest

from ucx_dask_gpu.conda import publish
from tools.conda_standin.channel import build_channel
from ucx_dask_gpu.errors import OUTPUT_REFUSED, PACKAGE_INVALID, STANDIN_REFUSED, UserError
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def _package(channel: Path, name: str, build: str, extra: dict | None = None) -> Path:
    """A minimal .conda in channel/linux-64: index.json, about.json (with `extra`), one file."""
    tree = channel.parent / f"{channel.name}-{name}-{build}-tree"
    (tree / "info").mkdir(parents=True)
    (tree / "lib").mkdir()
    (tree / "lib" / f"lib{name}.so").write_bytes(b"\x7fELF")
    (tree / "info/index.json").write_text(json.dumps({"name": name, "version": "1.0", "build": build,
                                                      "build_number": 0, "subdir": "linux-64", "depends": []}))
    (tree / "info/about.json").write_text(json.dumps({"summary": name, "extra": extra or {}}))
    files = [str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()]
    (channel / "linux-64").mkdir(parents=True, exist_ok=True)
    cph.create(str(tree), files, f"{name}-1.0-{build}.conda", out_folder=str(channel / "linux-64"))
    return channel / "linux-64" / f"{name}-1.0-{build}.conda"


def _upload(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(REPO / "ci/conda_upload.sh"), *args], capture_output=True, text=True, env=env)


def test_a_standin_package_where_the_upload_reads_is_refused_in_one_line(tmp_path):
    channel = tmp_path / "channel"
    _package(channel, "ucxx", "cuda13_py311h1234567_0")
    planted = _package(channel, "ucx", "cuda13_h1234567_0", extra={"standin": {"stood_in_by": ["gcc 12"]}})
    proc = _upload("--upload", str(channel))
    assert proc.returncode == STANDIN_REFUSED, proc.stderr
    assert proc.stderr.strip() == (f"ucx-dask-gpu conda: error: {planted}: built with stand-ins (about.json "
                                   f"extra.standin); stand-in packages are never published, nothing was uploaded")
    assert "anaconda" not in proc.stdout


def test_a_clean_channel_is_a_dry_run_to_the_configured_channel_and_label(tmp_path):
    st = load(REPO / "stack.toml")
    pkg = _package(tmp_path / "channel", "ucx", "cuda13_h1234567_0")
    proc = _upload(str(tmp_path / "channel"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"dry run (ci/conda_upload.sh --upload to publish): anaconda upload --user "
                                   f"{st.conda.channels[0]} --label {st.conda.upload_label} {pkg}")


def test_standin_build_string_two_files_of_one_name_and_nothing_are_refused(tmp_path):
    _package(tmp_path / "a", "ucx", "cuda13_h1234567_0_standin")
    with pytest.raises(UserError) as e:
        publish.check([tmp_path / "a"])
    assert e.value.exit_code == STANDIN_REFUSED and "(build string cuda13_h1234567_0_standin)" in str(e.value)

    _package(tmp_path / "b", "dask-thing", "pyh1_0")
    _package(tmp_path / "c", "dask-thing", "pyh1_0")
    with pytest.raises(UserError) as e:
        publish.check([tmp_path / "b", tmp_path / "c"])
    assert e.value.exit_code == PACKAGE_INVALID and "dask-thing-1.0-pyh1_0.conda twice" in str(e.value)

    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        publish.check([tmp_path / "empty"])
    assert e.value.exit_code == PACKAGE_INVALID and "nothing to publish" in str(e.value)


def test_the_standin_channel_is_never_built_into_the_publish_directory():
    st = load(REPO / "stack.toml")
    with pytest.raises(UserError) as e:
        build_channel(st, out=st.root / publish.PUBLISH_DIR)
    assert e.value.exit_code == OUTPUT_REFUSED and "the directory an upload publishes from" in str(e.value)


def test_the_publish_path_never_skips_existing_files():
    for path in ("ci/conda_build.sh", "ci/conda_upload.sh", ".github/workflows/conda.yml"):
        text = (REPO / path).read_text()
        assert "--skip-existing" not in text.replace("no --skip-existing", ""), path
    workflow = (REPO / ".github/workflows/conda.yml").read_text()
    assert "ci/conda_upload.sh --upload channels" in workflow and "anaconda upload" not in workflow

"""Wheelhouse: platform tags, our own verification of every wheel, and a hash mismatch that leaves nothing behind.

pip runs for real against a local --find-links directory (no index, no network).
"""
import subprocess
import sys

import pytest

from ucx_dask_gpu.image import wheelhouse
from ucx_dask_gpu.errors import HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ucx_dask_gpu.fsutil import sha256_file as sha
from ucx_dask_gpu.stack.lock import parse_lock_text


def test_platform_tags_cover_older_manylinux_and_legacy_aliases():
    tags = wheelhouse.pip_platforms("x86_64-manylinux_2_28")
    assert tags[0] == "manylinux_2_28_x86_64"
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags
    assert not any(t.startswith("manylinux_2_29") for t in tags)
    with pytest.raises(UserError):
        wheelhouse.pip_platforms("linux-64")


def test_verify_accepts_exactly_the_lock(tmp_path, make_wheel):
    a = make_wheel(tmp_path, "alpha", "1.0")
    b = make_wheel(tmp_path, "beta-pkg", "2.0")
    pins = parse_lock_text(f"alpha==1.0 --hash=sha256:{sha(a)}\nbeta-pkg==2.0 --hash=sha256:{'0' * 64} "
                           f"--hash=sha256:{sha(b)}\n")
    assert wheelhouse.verify_wheels(tmp_path, pins) == {a.name: sha(a), b.name: sha(b)}


def test_verify_rejects_a_changed_wheel(tmp_path, make_wheel):
    a = make_wheel(tmp_path, "alpha", "1.0")
    pins = parse_lock_text(f"alpha==1.0 --hash=sha256:{sha(a)}\n")
    make_wheel(tmp_path, "alpha", "1.0", payload="tampered")
    with pytest.raises(UserError) as err:
        wheelhouse.verify_wheels(tmp_path, pins)
    assert err.value.exit_code == HASH_MISMATCH and "hash mismatch" in str(err.value)


def test_verify_rejects_missing_and_unlocked_wheels(tmp_path, make_wheel):
    a = make_wheel(tmp_path, "alpha", "1.0")
    with pytest.raises(UserError) as err:
        wheelhouse.verify_wheels(tmp_path, parse_lock_text(f"alpha==1.0 --hash=sha256:{sha(a)}\n"
                                                            f"gamma==3 --hash=sha256:{'1' * 64}\n"))
    assert err.value.exit_code == SOURCE_UNREACHABLE and "gamma" in str(err.value)
    make_wheel(tmp_path, "intruder", "0.1")
    with pytest.raises(UserError) as err:
        wheelhouse.verify_wheels(tmp_path, parse_lock_text(f"alpha==1.0 --hash=sha256:{sha(a)}\n"))
    assert "intruder" in str(err.value)


def test_wheelhouse_from_find_links_is_verified_and_cached(tmp_path, st, make_wheel):
    links = tmp_path / "links"
    links.mkdir()
    a = make_wheel(links, "alpha", "1.0")
    lock = tmp_path / "lock.txt"
    lock.write_text(f"alpha==1.0 \\\n    --hash=sha256:{sha(a)}\n")
    dest = wheelhouse.ensure_wheelhouse(st, tmp_path / "cache", lock_path=lock, find_links=links)
    assert sorted(p.name for p in dest.iterdir()) == sorted([a.name, wheelhouse.MANIFEST, wheelhouse.LOCK_NAME])
    assert (dest / wheelhouse.LOCK_NAME).read_text() == lock.read_text()
    # Second call: reused (the find-links wheel could even be gone now).
    a.unlink()
    assert wheelhouse.ensure_wheelhouse(st, tmp_path / "cache", lock_path=lock, find_links=links) == dest


def test_cli_hash_mismatch_is_one_line_exit_5_and_nothing_written(tmp_path, make_wheel):
    links = tmp_path / "links"
    links.mkdir()
    good = make_wheel(links, "alpha", "1.0")
    lock = tmp_path / "lock.txt"
    lock.write_text(f"alpha==1.0 --hash=sha256:{sha(good)}\n")
    make_wheel(links, "alpha", "1.0", payload="tampered")  # what the "index" now serves
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "image", "--cache", str(cache), "wheelhouse",
                           "--lock", str(lock), "--find-links", str(links), "--no-own-wheel"],
                          capture_output=True, text=True)
    assert proc.returncode == HASH_MISMATCH
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "hash mismatch for alpha==1.0" in errors[0], proc.stderr
    assert proc.stdout == ""
    # Nothing half-written: no wheelhouse directory, no temporary left-overs.
    wh = cache / "wheelhouse"
    assert not wh.exists() or list(wh.iterdir()) == []


def test_hashed_requirements_name_wheels_inside_the_build(tmp_path, make_wheel):
    a = make_wheel(tmp_path, "alpha", "1.0")
    text = wheelhouse.hashed_requirements([a], "/build/extra/")
    assert text == f"/build/extra/{a.name} --hash=sha256:{sha(a)}\n"

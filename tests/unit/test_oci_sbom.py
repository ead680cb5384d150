"""SBOM: CycloneDX 1.6 (validated against the schema), deterministic, and cross-checked against its sources."""
from __future__ import annotations

import json

import pytest

from ucx_dask_gpu import cli, stack
from ucx_dask_gpu.oci import sbom
from ucx_dask_gpu.errors import SBOM_INVALID, SBOM_MISMATCH
from ucx_dask_gpu.stack.lock import Pin, load_lock

EPOCH = stack.load().source_date_epoch

DPKG_STATUS = """\
Package: base-files
Essential: yes
Status: install ok installed
Priority: required
Architecture: amd64
Version: 12.4+deb12u15
Description: Debian base system miscellaneous files
 This package contains the basic filesystem hierarchy.
 .
 More text.

Package: libc6
Status: install ok installed
Architecture: amd64
Multi-Arch: same
Source: glibc
Version: 2.36-9+deb12u14

Package: libc6
Status: install ok installed
Architecture: i386
Multi-Arch: same
Source: glibc
Version: 2.36-9+deb12u14

Package: removed-but-configured
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0-1

Package: python3.11
Status: install ok installed
Architecture: amd64
Source: python3.11 (3.11.2-6+deb12u8)
Version: 3.11.2-6+deb12u8
"""

OS_RELEASE = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n'

BUILD_INFO = {
    "ucx_version": "1.20.1",
    "source": {"version": "1.20.1", "archive": "ucx-1.20.1.tar.gz", "sha256": "1a" * 32, "tag": "v1.20.1",
               "commit": "d8" * 20, "content_tree": "c1" * 20, "verified_by": "sha256",
               "url": "https://github.com/openucx/ucx/archive/refs/tags/v1.20.1.tar.gz"},
    "configure": {"command": "./contrib/configure-release --prefix=/opt/ucx --enable-mt --with-verbs"},
    "modules": ["libuct_cuda.so", "libuct_ib.so"],
    "patches": [{"name": "1.20.1/0001-uct-tcp-loopback-reachability.patch", "sha256": "ef" * 32}],
    "capabilities": {"cuda": {"inputs": [
        {"name": "nvidia-cuda-runtime", "version": "13.0.96", "sha256": "7f" * 32, "kind": "wheel"},
        {"name": "libcuda1", "version": "535.261.03-1", "sha256": "de" * 32, "kind": "deb"}]}},
    "build_prefix": "/opt/ucx",
}

PINS = {"dask": Pin("dask", "2026.7.1", ("aa" * 32, "ab" * 32)), "numpy": Pin("numpy", "2.3.5", ("bb" * 32,))}
UCXX_INFO = {
    "ucxx_version": "0.51.01", "cmake_args": ["-DFETCHCONTENT_FULLY_DISCONNECTED=ON"],
    "sources": {"UCXX": {"tag": "v0.51.01", "commit": "2c" * 20, "content_tree": "ae" * 20}},
    "ucx": {"version": "1.20.1"},
    "packages": [{"package": "ucxx", "name": "ucxx-cu13", "version": "0.51.1", "sha256": "9a" * 32,
                  "wheel": "ucxx_cu13-0.51.1-cp311-abi3-linux_x86_64.whl", "cmake_args": ["-DFIND_UCXX_CPP=ON"]}],
}
DISTS = {"dask": {"name": "dask", "version": "2026.7.1", "path": "opt/venv/lib/python3.11/site-packages"},
         "ucxx-cu13": {"name": "ucxx-cu13", "version": "0.51.1", "path": "opt/venv/lib/python3.11/site-packages"},
         "numpy": {"name": "numpy", "version": "2.3.5", "path": "opt/venv/lib/python3.11/site-packages"},
         "ucx-dask-gpu": {"name": "ucx-dask-gpu", "version": "0.1.0",
                          "path": "opt/venv/lib/python3.11/site-packages"}}


def make(**over) -> bytes:
    kw = dict(name="ucx-dask-gpu", version="0.1.0", epoch=EPOCH, dpkg_status=DPKG_STATUS, os_release=OS_RELEASE,
              dists=DISTS, pins=PINS, wheels={"dask": ("dask-2026.7.1-py3-none-any.whl", "ab" * 32)},
              build_info=BUILD_INFO, build_info_sha256="cd" * 32, ucxx_info=UCXX_INFO,
              properties={"stack-id": "0123456789abcdef"})
    kw.update(over)
    return sbom.build_sbom(**kw)


def test_dpkg_status_parsing():
    debs = sbom.installed_debs(DPKG_STATUS)
    assert set(debs) == {("base-files", "amd64"), ("libc6", "amd64"), ("libc6", "i386"), ("python3.11", "amd64")}
    assert "More text." in debs[("base-files", "amd64")]["Description"]


def test_sbom_is_valid_cyclonedx_and_deterministic():
    a, b = make(), make()
    assert a == b
    assert sbom.validate(a.decode()) is None
    doc = json.loads(a)
    assert doc["specVersion"] == "1.6" and doc["metadata"]["timestamp"].startswith("2025-11-30T00:00:00")
    assert doc["serialNumber"].startswith("urn:uuid:")
    # different content, different serial; same content, same serial
    other = json.loads(make(properties={"stack-id": "fedcba9876543210"}))
    assert other["serialNumber"] != doc["serialNumber"]


def test_sbom_contents():
    doc = json.loads(make())
    purls = {c.get("purl"): c for c in doc["components"]}
    libc = purls["pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=i386&distro=debian-12"]
    assert {"name": "ucx-dask-gpu:deb:source", "value": "glibc"} in libc["properties"]
    py311 = purls["pkg:deb/debian/python3.11@3.11.2-6%2Bdeb12u8?arch=amd64&distro=debian-12"]
    assert {"name": "ucx-dask-gpu:deb:source", "value": "python3.11"} in py311["properties"]
    assert not any("removed-but-configured" in (p or "") for p in purls)
    dask = purls["pkg:pypi/dask@2026.7.1"]
    assert dask["hashes"] == [{"alg": "SHA-256", "content": "ab" * 32}]     # the exact wheel
    numpy = purls["pkg:pypi/numpy@2.3.5"]
    assert numpy["hashes"] == [{"alg": "SHA-256", "content": "bb" * 32}]    # from the lock
    own = purls["pkg:pypi/ucx-dask-gpu@0.1.0"]
    assert {"name": "ucx-dask-gpu:python:in-lock", "value": "false"} in own["properties"]
    ucx = next(c for c in doc["components"] if c["name"] == "ucx")
    assert ucx["version"] == "1.20.1" and ucx["hashes"] == [{"alg": "SHA-256", "content": "1a" * 32}]
    props = {p["name"]: p["value"] for p in ucx["properties"]}
    assert props["ucx-dask-gpu:ucx:configure"] == BUILD_INFO["configure"]["command"]
    assert (props["ucx-dask-gpu:ucx:source-tag"], props["ucx-dask-gpu:ucx:source-commit"]) == ("v1.20.1", "d8" * 20)
    assert props["ucx-dask-gpu:ucx:patches"] == "1.20.1/0001-uct-tcp-loopback-reachability.patch"
    assert "checksum=sha256:" + "1a" * 32 in ucx["purl"]
    ucxx = purls["pkg:pypi/ucxx-cu13@0.51.1"]
    assert ucxx["hashes"] == [{"alg": "SHA-256", "content": "9a" * 32}]  # the wheel our build made
    uprops = {p["name"]: p["value"] for p in ucxx["properties"]}
    assert uprops["ucx-dask-gpu:python:built-from-source"] == f"v0.51.01 {'2c' * 20}"
    assert uprops["ucx-dask-gpu:python:cmake-args"] == "-DFETCHCONTENT_FULLY_DISCONNECTED=ON -DFIND_UCXX_CPP=ON"
    assert uprops["ucx-dask-gpu:python:built-against-ucx"] == "1.20.1"
    excluded = [c for c in doc["components"] if c.get("scope") == "excluded"]
    assert {c["name"] for c in excluded} == {"nvidia-cuda-runtime", "libcuda1"}
    assert any(c["type"] == "operating-system" and c["version"] == "12" for c in doc["components"])
    root = doc["metadata"]["component"]
    assert root["type"] == "container" and root["version"] == "0.1.0"
    deps = {d["ref"]: d.get("dependsOn", []) for d in doc["dependencies"]}
    assert ucx["bom-ref"] in deps[root["bom-ref"]]
    assert not any(c["bom-ref"] in deps[root["bom-ref"]] for c in excluded)


def test_cross_check_agrees_with_its_sources():
    doc = json.loads(make())
    assert sbom.check_sbom(doc, pins=PINS, dpkg_status=DPKG_STATUS, build_info=BUILD_INFO, ucxx_info=UCXX_INFO,
                           extra_dists={"ucx-dask-gpu"}) == []


@pytest.mark.parametrize("tamper,expect", [
    (dict(pins={**PINS, "pandas": Pin("pandas", "2.3.3", ("cc" * 32,))}), "lock pin pandas==2.3.3 is not in the SBOM"),
    (dict(pins={**PINS, "numpy": Pin("numpy", "2.3.4", ("bb" * 32,))}), "numpy: SBOM has 2.3.5, the lock pins 2.3.4"),
    (dict(pins={**PINS, "dask": Pin("dask", "2026.7.1", ("aa" * 32,))}), "dask: SBOM hash abab"),
    (dict(dpkg_status=DPKG_STATUS.replace("12.4+deb12u15", "12.4+deb12u16")), "deb base-files:amd64: SBOM has"),
    (dict(dpkg_status=DPKG_STATUS + "\nPackage: tini\nStatus: install ok installed\nArchitecture: amd64\n"
                                    "Version: 0.19.0-1\n"), "deb tini:amd64 0.19.0-1 is installed but not in the SBOM"),
    (dict(build_info={**BUILD_INFO, "configure": {"command": "./configure --without-verbs"}}), "configure line"),
    (dict(build_info={**BUILD_INFO, "ucx_version": "1.20.0"}), "ucx: SBOM has 1.20.1"),
    (dict(extra_dists=set()), "ucx-dask-gpu==0.1.0 is in the SBOM but not in the lock"),
    (dict(ucxx_info=None), "ucxx-cu13==0.51.1 is in the SBOM but not in the lock"),
    (dict(ucxx_info={**UCXX_INFO, "packages": [{**UCXX_INFO["packages"][0], "sha256": "00" * 32}]}),
     "the UCXX build made 0.51.1 sha256 0000"),
])
def test_cross_check_finds_each_disagreement(tamper, expect):
    doc = json.loads(make())
    kw = dict(pins=PINS, dpkg_status=DPKG_STATUS, build_info=BUILD_INFO, ucxx_info=UCXX_INFO,
              extra_dists={"ucx-dask-gpu"})
    kw.update(tamper)
    problems = sbom.check_sbom(doc, **kw)
    assert any(expect in p for p in problems), problems


def test_every_pin_of_the_real_lock_round_trips():
    st = stack.load()
    pins = load_lock(st.lock_path())
    dists = {n: {"name": n, "version": p.version, "path": "opt/venv/lib/python3.11/site-packages"}
             for n, p in pins.items()}
    data = make(pins=pins, dists=dists, wheels={})
    assert sbom.validate(data.decode()) is None
    doc = json.loads(data)
    assert sbom.check_sbom(doc, pins=pins) == []
    shipped = [c for c in doc["components"] if c.get("scope") != "excluded"]
    assert sum(1 for c in shipped if c.get("purl", "").startswith("pkg:pypi/")) == len(pins)


def test_cli_check_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_bytes(make(pins=load_lock(stack.load().lock_path()), dists={}, wheels={}))
    status = tmp_path / "status"
    status.write_text(DPKG_STATUS)
    # valid but missing every lock pin: SBOM_MISMATCH, one line on stderr, the problems on stdout
    rc = cli.main(["sbom", "check", str(good), "--dpkg-status", str(status)])
    out, err = capsys.readouterr()
    assert rc == SBOM_MISMATCH and len(err.strip().splitlines()) == 1 and "is not in the SBOM" in out
    broken = tmp_path / "broken.json"
    doc = json.loads(good.read_text())
    doc["components"][0]["type"] = "not-a-type"
    broken.write_text(json.dumps(doc))
    rc = cli.main(["sbom", "check", str(broken)])
    err = capsys.readouterr().err
    assert rc == SBOM_INVALID and len(err.strip().splitlines()) == 1 and "not valid CycloneDX" in err


def test_generator_is_pinned_in_stack_toml_and_checked(tmp_path):
    import dataclasses
    import tomllib
    from importlib.metadata import version

    from ucx_dask_gpu.errors import BAD_STACK, SBOM_GENERATOR, UserError

    st = stack.load()
    name, pinned = sbom.generator(st)
    assert name == "cyclonedx-python-lib" and pinned == version(name)
    other = dataclasses.replace(st, sbom=stack.SbomSpec(generator=name, generator_version="0.0.1"))
    with pytest.raises(UserError) as e:
        sbom.generator(other)
    assert e.value.exit_code == SBOM_GENERATOR and "pins 0.0.1" in str(e.value)
    # Without [sbom] the stack itself is refused, before any SBOM is made.
    raw = tomllib.loads(st.path.read_text())
    with pytest.raises(UserError) as e:
        stack.parse({k: v for k, v in raw.items() if k != "sbom"}, st.path)
    assert e.value.exit_code == BAD_STACK


def test_tools_are_recorded():
    doc = json.loads(make(tools={"cyclonedx-python-lib": "11.12.0", "ucx-dask-gpu": "0.1.0"}))
    tools = {c["name"]: c["version"] for c in doc["metadata"]["tools"]["components"]}
    assert tools == {"cyclonedx-python-lib": "11.12.0", "ucx-dask-gpu": "0.1.0"}

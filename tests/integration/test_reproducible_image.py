"""Reproducible image, for real: a real Docker 20.10 engine, real `docker build`s, real images.

Small images first (built FROM the debootstrapped runtime base in seconds): two `docker build --no-cache` runs give
different image ids, normalised they give one id and one archive; a build that writes its own time somewhere is
caught and the differing file named. Then the image itself: a clone of this checkout at another path builds the UCX
prefix, the UCXX wheels and the image again with nothing cached (bases bootstrapped again, no Docker cache), and all
three are byte-identical to this checkout's (`scripts/check_reproducible.sh --against-checkout`, what CI runs: a
test of tools/repro_check, the workshop's check, on the product's normalisation and comparison); the image's SBOM is
checked against the CycloneDX schema, the lock, the image's own dpkg database and the UCX build info.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.docker_engine import install_host_packages
from tools.repro_check import check as reprocheck
from ucx_dask_gpu.image import bases, normalise
from ucx_dask_gpu.image import labels as image_labels
from ucx_dask_gpu.oci import compare as oci_compare
from ucx_dask_gpu.oci import sbom
from ucx_dask_gpu.image.docker import docker_bin, image_inspect
from ucx_dask_gpu.errors import NOT_REPRODUCIBLE
from ucx_dask_gpu.image.paths import default_cache
from ucx_dask_gpu.stack.lock import load_lock

pytestmark = [pytest.mark.integration, pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]

# Run inside an image: every .pyc next to a source must be valid for it as shipped (timestamp pycs: mtime and
# size; hash pycs: the source hash). Prints JSON counts and the first bad ones.
PYC_CHECK = textwrap.dedent("""
    import importlib.util, json, os, sys
    counts, bad = {"timestamp": 0, "checked-hash": 0, "unchecked-hash": 0}, []
    for top in sys.argv[1:]:
        for d, _, files in os.walk(top):
            if not d.endswith("__pycache__"):
                continue
            for f in files:
                if not f.endswith(".pyc"):
                    continue
                p = os.path.join(d, f)
                src = os.path.join(os.path.dirname(d), f.split(".", 1)[0] + ".py")
                head = open(p, "rb").read(16)
                if head[:4] != importlib.util.MAGIC_NUMBER or not os.path.exists(src):
                    continue
                flags = int.from_bytes(head[4:8], "little")
                if flags == 0:
                    st = os.stat(src)
                    ok = (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                          and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)
                    kind = "timestamp"
                else:
                    ok = head[8:16] == importlib.util.source_hash(open(src, "rb").read())
                    kind = "checked-hash" if flags & 2 else "unchecked-hash"
                counts[kind] += 1
                if not ok:
                    bad.append(p)
    print(json.dumps({"counts": counts, "bad": bad[:10], "n_bad": len(bad)}))
""")


def docker(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([docker_bin(), *args], capture_output=True, text=True, **kw)
    if check:
        assert proc.returncode == 0, f"docker {' '.join(args[:3])}: {proc.stderr[-2000:]}"
    return proc


def pyc_report(image: str, *dirs: str) -> dict:
    proc = docker("run", "--rm", "--network", "none", "--user", "0", "--entrypoint", "python3", image, "-c",
                  PYC_CHECK, *dirs)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache() -> Path:
    return default_cache()


@pytest.fixture(scope="module")
def base(st, cache, engine, docker_exclusive) -> str:
    """The debootstrapped runtime base (the image's own); $UCX_DASK_GPU_TEST_BASE names another existing image."""
    with docker_exclusive():
        return os.environ.get("UCX_DASK_GPU_TEST_BASE") or bases.ensure_base(st, "runtime", cache)


# --- small images ------------------------------------------------------------------------------------------------

SMALL = """\
FROM {base}
# useradd without SOURCE_DATE_EPOCH: /etc/shadow gets the build day; pip-like litter; a module compiled with
# timestamp .pyc files (what `pip install` does by default); a file removed from the base (a whiteout).
RUN useradd --no-log-init -u 10001 -m dask \\
 && mkdir -p /root/.cache/pip /opt/app && echo cache > /root/.cache/pip/selfcheck.json && echo t > /tmp/scratch
COPY app/ /opt/app/
RUN python3 -m compileall -q /opt/app && ln -s mod.py /opt/app/alias.py && rm -f /etc/debian_version
{extra}
USER 10001
CMD ["python3", "-c", "import sys; sys.path.insert(0, '/opt/app'); import mod; print(mod.f('q'))"]
"""


def build_small(tmp: Path, base: str, tag: str, extra: str = "") -> str:
    ctx = tmp / tag.replace(":", "_")
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "mod.py").write_text("X = frozenset({'a', 'b', 'c'})\n\ndef f(x):\n    return x in {'q', 'r'}\n")
    (ctx / "Dockerfile").write_text(SMALL.format(base=base, extra=extra))
    proc = subprocess.run([docker_bin(), "build", "--no-cache", "--network", "none", "-q", "-t", tag, str(ctx)],
                          capture_output=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return image_inspect(tag)["Id"]


@pytest.fixture(scope="module")
def small(st, base, tmp_path_factory):
    """Two clean builds of one Dockerfile, each normalised."""
    tmp = tmp_path_factory.mktemp("small")
    raw = [build_small(tmp, base, f"udg-repro-small:{n}") for n in ("a", "b")]
    outs = [normalise.normalise_image(st, f"udg-repro-small:{n}", tmp / f"out-{n}", keep_archive=True)
            for n in ("a", "b")]
    yield {"raw": raw, "outs": outs, "tmp": tmp}
    for n in ("a", "b"):
        docker("rmi", "-f", f"udg-repro-small:{n}", check=False)


def test_two_clean_builds_differ_raw_and_are_identical_normalised(small):
    a, b = small["outs"]
    assert small["raw"][0] != small["raw"][1], "docker build itself gave the same id twice: nothing was proven"
    assert a.image_id == b.image_id
    assert a.archive_sha256 == b.archive_sha256
    assert Path(a.archive).read_bytes() == Path(b.archive).read_bytes()
    assert image_inspect("udg-repro-small:a")["Id"] == image_inspect("udg-repro-small:b")["Id"] == a.image_id
    # what the normaliser did, it says: litter dropped from the useradd layer, the module's .pyc fixed
    assert any("root/.cache/pip/selfcheck.json" in v and "tmp/scratch" in v for v in a.dropped.values())
    assert a.pyc_fixed >= 1


def test_normalised_image_runs_and_its_files_are_right(small, st):
    tag = "udg-repro-small:a"
    assert docker("run", "--rm", "--network", "none", tag).stdout.strip() == "True"
    report = pyc_report(tag, "/opt/app", "/usr/lib/python3.11", "/usr/lib/python3")
    assert report["n_bad"] == 0, report
    assert report["counts"]["checked-hash"] >= 1
    day = st.source_date_epoch // 86400
    shadow = docker("run", "--rm", "--user", "0", "--entrypoint", "cat", tag, "/etc/shadow").stdout
    days = {line.split(":")[2] for line in shadow.splitlines() if line.split(":")[2]}
    assert days == {str(day)}, days
    listing = docker("run", "--rm", "--user", "0", "--entrypoint", "sh", tag, "-c",
                     "ls /etc/debian_version /root/.cache/pip/selfcheck.json /tmp/scratch 2>&1; "
                     "stat -c '%Y %n' /opt/app/mod.py /home/dask").stdout
    assert "No such file" in listing and listing.count("No such file") == 3
    assert f"{st.source_date_epoch} /opt/app/mod.py" in listing and f"{st.source_date_epoch} /home/dask" in listing
    cfg = image_inspect(tag)
    assert cfg["Created"] == "2025-11-30T00:00:00Z"
    labels = cfg["Config"]["Labels"]
    assert labels["org.opencontainers.image.created"] == "2025-11-30T00:00:00Z"
    assert labels["org.opencontainers.image.version"] == st.version
    assert labels["io.ucx-dask-gpu.sbom"] == "/usr/share/ucx-dask-gpu/sbom.cdx.json"
    assert not cfg["Config"].get("Hostname") and cfg.get("Container", "") == ""


def test_docker_keeps_exactly_the_normalised_bytes(small, tmp_path):
    """`docker save` of the loaded image gives back our layer tars and config, byte for byte."""
    out = tmp_path / "saved.tar"
    docker("save", "-o", str(out), "udg-repro-small:a")
    import hashlib
    import tarfile
    with tarfile.open(out) as t:
        manifest = json.load(t.extractfile("manifest.json"))[0]
        config = t.extractfile(manifest["Config"]).read()
        digests = ["sha256:" + hashlib.sha256(t.extractfile(p).read()).hexdigest() for p in manifest["Layers"]]
    a = small["outs"][0]
    assert "sha256:" + hashlib.sha256(config).hexdigest() == a.image_id
    assert digests == a.diff_ids


def test_the_archive_is_an_oci_layout_and_a_docker_archive_for_skopeo(small, tmp_path, docker_exclusive):
    """An independent reader (skopeo, from Debian) takes the archive as OCI layout and as docker-archive."""
    with docker_exclusive():
        install_host_packages()                  # stack.toml [debian].image_host_packages, skopeo among them
    skopeo = shutil.which("skopeo")
    assert skopeo, "skopeo is not installed (stack.toml [debian].image_host_packages)"
    a = small["outs"][0]
    for transport in ("oci-archive", "docker-archive"):
        proc = subprocess.run([skopeo, "inspect", f"{transport}:{a.archive}"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        info = json.loads(proc.stdout)
        assert info["Layers"] == a.diff_ids and info["Created"] == "2025-11-30T00:00:00Z", transport
        assert info["Labels"]["io.ucx-dask-gpu.sbom"] == "/usr/share/ucx-dask-gpu/sbom.cdx.json"
    oci = json.loads(subprocess.run([skopeo, "inspect", f"oci-archive:{a.archive}"], capture_output=True,
                                    text=True).stdout)
    assert oci["Digest"] == a.manifest_digest
    # a copy verifies every blob against its digest
    proc = subprocess.run([skopeo, "copy", "-q", f"oci-archive:{a.archive}", f"oci:{tmp_path / 'copy'}:x"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    raw = json.loads(subprocess.run([skopeo, "inspect", "--raw", f"oci:{tmp_path / 'copy'}:x"], capture_output=True,
                                    text=True).stdout)
    assert raw["config"]["digest"] == a.image_id
    assert raw["annotations"]["org.opencontainers.image.created"] == "2025-11-30T00:00:00Z"


def test_sbom_of_the_small_image_matches_its_dpkg_database(small):
    tag = "udg-repro-small:a"
    text = docker("run", "--rm", "--entrypoint", "cat", tag, "/usr/share/ucx-dask-gpu/sbom.cdx.json").stdout
    assert text == (Path(small["outs"][0].out_dir) / "sbom.cdx.json").read_text()
    assert sbom.validate(text) is None
    status = docker("run", "--rm", "--entrypoint", "cat", tag, "/var/lib/dpkg/status").stdout
    assert sbom.check_sbom(json.loads(text), dpkg_status=status) == []


def test_a_build_that_records_its_own_time_is_caught_and_the_file_named(st, base, small, tmp_path):
    stamp = "RUN date +%s%N > /opt/app/BUILT_AT"
    outs = []
    for n in ("c", "d"):
        build_small(tmp_path, base, f"udg-repro-small:{n}", extra=stamp)
        outs.append(normalise.normalise_image(st, f"udg-repro-small:{n}", tmp_path / f"out-{n}", load=False))
    try:
        assert outs[0].image_id != outs[1].image_id
        report = oci_compare.compare(tmp_path / "out-c", tmp_path / "out-d")
        assert not report["identical"]
        differing = [(layer["layer"], d["path"], d["fields"]) for layer in report["layers"]
                     for d in layer.get("differ", [])]
        assert differing == [(len(outs[0].diff_ids) - 2, "opt/app/BUILT_AT", ["content"])], report
        proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "repro", "compare", str(tmp_path / "out-c"),
                               str(tmp_path / "out-d")], capture_output=True, text=True)
        assert proc.returncode == NOT_REPRODUCIBLE
        assert "differs opt/app/BUILT_AT" in proc.stdout and len(proc.stderr.strip().splitlines()) == 1
    finally:
        for n in ("c", "d"):
            docker("rmi", "-f", f"udg-repro-small:{n}", check=False)


# --- the image -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def image(st, cache, image) -> dict:
    """The suite's image (conftest's: built by the cluster tests already, warm, cheap; under
    $UCX_DASK_GPU_TEST_IMAGE_TAG where that is set), normalised: the FIRST build."""
    res = normalise.finish_build(st, image["tag"], cache)
    return {"tag": image["tag"], "result": res, "stack_id": image["stack_id"]}


@pytest.fixture(scope="module")
def second_build_from_a_clone(image, st, tmp_path_factory, docker_lock) -> dict:
    """What CI runs (docs/reproducibility.md): a fresh clone of this checkout's commit at another, deeper path, under
    umask 077, another locale and time zone, builds the UCX prefix, the UCXX wheels and the image with nothing cached
    (its own build caches, docker build --no-cache, the Debian bases bootstrapped again); compared with this
    checkout's `make ucx ucxx` and the suite's image."""
    tmp = tmp_path_factory.mktemp("repro")
    clone = tmp / "some" / "deeper" / "path" / "than" / "the" / "checkout" / "ucx-dask-gpu"
    out = tmp / "check.json"
    proc = subprocess.run([str(ROOT / "scripts" / "check_reproducible.sh"), "--against-checkout",
                           "--first", image["tag"], "--fresh-bases", "--clone-dir", str(clone), "--json", str(out),
                           "--docker-lock", str(docker_lock)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True, timeout=5400)
    print(proc.stdout)
    report = json.loads(out.read_text()) if out.is_file() else {}
    yield {"rc": proc.returncode, "stdout": proc.stdout, "report": report, "clone": clone}
    # its images went with a successful check; after a failure they are kept for inspection until here
    for b in report.get("builds", [])[1:]:
        if b.get("image", {}).get("cache"):
            gone = reprocheck.Build.in_clone("b", clone, reprocheck.VARIATIONS[1])
            gone.image = b["image"]
            reprocheck.remove_images(st, gone, None)
    shutil.rmtree(clone, ignore_errors=True)


def test_a_clone_at_another_path_builds_the_same_prefix_wheels_and_image(image, second_build_from_a_clone, st):
    r = second_build_from_a_clone["report"]
    assert second_build_from_a_clone["rc"] == 0, second_build_from_a_clone["stdout"][-4000:]
    a, b = r["builds"]
    assert a["checkout"] == str(ROOT) and b["checkout"] == str(second_build_from_a_clone["clone"])
    assert len(b["checkout"]) > len(a["checkout"]) and b["variation"]["umask"] == "0077"
    assert b["seconds"]["ucx"] > 0 and b["seconds"]["ucxx"] > 0 and b["seconds"]["image"] > 0, "built, not reused"
    assert r["prefix"]["identical"] and a["prefix_tar_sha256"] == b["prefix_tar_sha256"]
    assert r["wheels"]["identical"] and len(a["wheels"]) == len(st.ucxx.packages) and a["wheels"] == b["wheels"]
    assert r["image"]["identical"] and a["image"]["image_id"] == b["image"]["image_id"] == image["result"].image_id
    assert r["image"]["a"]["archive_sha256"] == r["image"]["b"]["archive_sha256"]
    assert r["identical"]
    # the clone's image is gone with the check; the suite's is untouched
    assert image_inspect(b["image"]["tag"]) is None and image_inspect(image["tag"]) is not None


def test_image_sbom_validates_and_agrees_with_lock_dpkg_and_ucx(image, st):
    tag = image["tag"]
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "sbom", "check", "--image", tag],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = docker("run", "--rm", "--entrypoint", "cat", tag, "/usr/share/ucx-dask-gpu/sbom.cdx.json").stdout
    assert text == (Path(image["result"].out_dir) / "sbom.cdx.json").read_text()
    assert sbom.validate(text) is None
    doc = json.loads(text)
    comps = [c for c in doc["components"] if c.get("scope") != "excluded"]
    # every lock pin, with its version and exactly the sha256 of the wheel the wheelhouse verified
    pins = load_lock(st.lock_path())
    pypi = {c["purl"].split("/", 1)[1].split("@")[0]: c for c in comps if c.get("purl", "").startswith("pkg:pypi/")}
    for name, pin in pins.items():
        assert pypi[name]["version"] == pin.version, name
        hashes = [h["content"] for h in pypi[name]["hashes"]]
        assert len(hashes) == 1 and hashes[0] in pin.hashes, name
    # every Debian package dpkg itself (not our parser) lists in the image, no more, no less
    dpkg = docker("run", "--rm", "--entrypoint", "dpkg-query", tag, "-W",
                  "-f", "${db:Status-Status} ${Package} ${Architecture} ${Version}\\n").stdout
    installed = {tuple(line.split()[1:]) for line in dpkg.splitlines() if line.startswith("installed ")}
    from packageurl import PackageURL
    in_sbom = set()
    for c in comps:
        if c.get("purl", "").startswith("pkg:deb/"):
            p = PackageURL.from_string(c["purl"])
            in_sbom.add((p.name, p.qualifiers["arch"], p.version))
    assert in_sbom == installed and len(installed) > 50
    # UCX: source hash and configure line from the prefix's build info
    info = json.loads(docker("run", "--rm", "--entrypoint", "cat", tag,
                             f"{st.image.ucx_prefix}/share/ucx-dask-gpu/build-info.json").stdout)
    ucx = next(c for c in comps if c["name"] == "ucx")
    assert ucx["version"] == info["ucx_version"]
    assert ucx["hashes"] == [{"alg": "SHA-256", "content": info["source"]["sha256"]}]
    props = {p["name"]: p["value"] for p in ucx["properties"]}
    assert props["ucx-dask-gpu:ucx:configure"] == info["configure"]["command"]


def test_image_labels_pycs_and_config(image, st):
    tag = image["tag"]
    meta = image_inspect(tag)
    labels = meta["Config"]["Labels"]
    assert meta["Created"] == labels["org.opencontainers.image.created"] == "2025-11-30T00:00:00Z"
    assert labels["org.opencontainers.image.version"] == st.version
    assert labels["io.ucx-dask-gpu.stack-id"] == image["stack_id"]
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == rev
    src = image_labels.source_url(st)
    assert labels.get("org.opencontainers.image.source") == src
    created = docker("history", "--no-trunc", "--format", "{{.CreatedAt}}", tag).stdout.split()
    assert len(created) > 5 and {c[:10] for c in created} == {"2025-11-30"}, created
    config = json.loads((Path(image["result"].out_dir) / "layers.json").read_text())["config"]
    assert {h["created"] for h in config["history"]} == {"2025-11-30T00:00:00Z"}
    assert not {"container", "container_config", "docker_version"} & set(config)
    report = pyc_report(tag, st.image.venv, "/usr/lib/python3.11", "/usr/lib/python3")
    assert report["n_bad"] == 0, report

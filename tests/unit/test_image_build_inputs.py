"""Image build inputs without Docker: build args match the Dockerfile, the UCX stage gets only what the UCX build
imports, the staged context has the layout the Dockerfile copies, the UCXX wheels are checked against their build
info and against the image's UCX, labels follow the build info, and base root filesystems are tarred
deterministically."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import BUILD_FAILED, HASH_MISMATCH, UCX_NOT_FOUND, USAGE, UserError
from ucx_dask_gpu.fsutil import sha256_file
from ucx_dask_gpu.image import bases, wheelhouse
from ucx_dask_gpu.image import build as imagebuild
from ucx_dask_gpu.image import labels as image_labels
from ucx_dask_gpu.image.paths import image_ref, stage_ref
from ucx_dask_gpu.ucxbuild.ucxx import UCXX_BUILD_INFO, ucx_identity

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def dockerfile_args() -> set[str]:
    return set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))


def test_every_dockerfile_arg_comes_from_stack_toml(st):
    provided = set(imagebuild.build_args(st, "base:x", "builder:x"))
    assert provided == dockerfile_args()
    # The values are stack.toml's, not literals in the Dockerfile.
    args = imagebuild.build_args(st, "b", "bb")
    assert args["UCX_PREFIX"] == st.image.ucx_prefix and args["VENV"] == st.image.venv
    assert args["IMAGE_UID"] == str(st.image.uid) and args["SOURCE_DATE_EPOCH"] == str(st.source_date_epoch)


def test_ucxx_finds_our_ucx_through_the_loader_cache_not_an_environment_variable():
    text = DOCKERFILE.read_text()
    assert 'echo "${UCX_PREFIX}/lib" > /etc/ld.so.conf.d/' in text
    assert "LD_LIBRARY_PATH" not in text and "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" not in text


def ucxx_dir(tmp_path: Path, st, make_wheel) -> Path:
    """An output directory of `build.sh ucxx`: three wheels and their build info, built against `UCX_INFO`."""
    d = tmp_path / "ucxx-wheels"
    d.mkdir()
    packages = []
    for pkg in st.ucxx.packages:
        w = make_wheel(d, f"{pkg.name}-cu13", "0.51.1")
        packages.append({"package": pkg.name, "name": f"{pkg.name}-cu13", "version": "0.51.1", "wheel": w.name,
                         "sha256": sha256_file(w), "requires": [], "cmake_args": list(pkg.cmake_args),
                         "shared_libraries": {}})
    info = {"ucxx_version": st.ucxx.source.version, "packages": packages, "ucx": ucx_identity(UCX_INFO),
            "sources": {"UCXX": {"tag": st.ucxx.source.tag, "commit": st.ucxx.source.commit}}}
    (d / UCXX_BUILD_INFO).write_text(json.dumps(info))
    return d


UCX_INFO = {"ucx_version": "1.20.1", "source": {"content_tree": "c1" * 20, "tag": "v1.20.1", "commit": "d8" * 20},
            "patches": [{"name": "1.20.1/0001-x.patch", "sha256": "ab" * 32}],
            "configure": {"stack_flags": ["--enable-mt"], "command": "contrib/configure-release --prefix=/opt/ucx"},
            "modules": ["libuct_ib.so", "libuct_cuda.so"], "_sha256": "ab" * 32}


def test_ucxx_wheels_are_read_with_their_hashes(tmp_path, st, make_wheel):
    d = ucxx_dir(tmp_path, st, make_wheel)
    wheels, info = imagebuild.read_ucxx_wheels(st, d)
    assert [w.name for w in wheels] == [p["wheel"] for p in info["packages"]]
    wheels[1].write_bytes(wheels[1].read_bytes() + b"x")
    with pytest.raises(UserError) as e:
        imagebuild.read_ucxx_wheels(st, d)
    assert e.value.exit_code == HASH_MISMATCH and wheels[1].name in str(e.value)


def test_no_ucxx_wheels_says_how_to_build_them(tmp_path, st):
    with pytest.raises(UserError) as e:
        imagebuild.read_ucxx_wheels(st, tmp_path / "nothing")
    assert e.value.exit_code == UCX_NOT_FOUND and "make ucxx" in str(e.value) and "\n" not in str(e.value)


def test_ucxx_wheels_must_match_the_images_ucx(tmp_path, st, make_wheel):
    _, info = imagebuild.read_ucxx_wheels(st, ucxx_dir(tmp_path, st, make_wheel))
    other_prefix = {**UCX_INFO, "configure": {**UCX_INFO["configure"], "command": "configure --prefix=/elsewhere"}}
    imagebuild.check_ucxx_matches_ucx(info, other_prefix)  # the prefix does not matter, the identity does
    for change in ({"patches": []}, {"ucx_version": "1.21.0"},
                   {"configure": {"stack_flags": ["--enable-mt", "--enable-debug"]}}):
        with pytest.raises(UserError) as e:
            imagebuild.check_ucxx_matches_ucx(info, {**UCX_INFO, **change})
        assert e.value.exit_code == BUILD_FAILED and "make ucxx" in str(e.value)


def test_ucx_stage_gets_the_import_closure_of_the_ucx_build_only():
    files = {str(p) for p in imagebuild.ucx_build_files(ROOT)}
    for needed in ("src/ucx_dask_gpu/__init__.py", "src/ucx_dask_gpu/stack/model.py", "src/ucx_dask_gpu/errors.py",
                   "src/ucx_dask_gpu/ucxbuild/build.py", "src/ucx_dask_gpu/ucxbuild/__main__.py"):
        assert needed in files
    # Editing the cluster or image code must not rebuild UCX in the image.
    for unrelated in ("src/ucx_dask_gpu/image/build.py", "src/ucx_dask_gpu/image/cluster.py",
                      "src/ucx_dask_gpu/proof/transpose.py", "src/ucx_dask_gpu/gate/guard.py"):
        assert unrelated not in files


def test_ucx_build_runs_from_the_staged_tree_alone(tmp_path, st):
    """The closure is complete: `build.sh --help` imports everything the UCX build needs, from the copy only."""
    ctx = tmp_path / "ctx"
    sources = tmp_path / "sources"
    sources.mkdir()
    imagebuild.stage_ucx_context(st, ctx, sources)
    tree = ctx / "ucx" / "tree"
    code = ("import importlib, pkgutil, ucx_dask_gpu.ucxbuild as u; "
            "[importlib.import_module('ucx_dask_gpu.ucxbuild.' + m.name) for m in pkgutil.iter_modules(u.__path__) if not m.name.startswith('_')]; "
            "from ucx_dask_gpu.ucxbuild.cli import main")
    proc = subprocess.run(["python3", "-I", "-c", f"import sys; sys.path.insert(0, {str(tree / 'src')!r}); {code}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tree / "ucx-src-build" / "build.sh").is_file() and (tree / "stack.toml").is_file()
    assert (ctx / "Dockerfile").read_text() == DOCKERFILE.read_text()


def test_context_modes_and_times_do_not_depend_on_the_checkouts_umask(tmp_path, st):
    """A checkout made under umask 077 has 0600/0700 files; COPY keeps modes, so the context gets git's: 0644, and
    0755 for executables and directories; every mtime SOURCE_DATE_EPOCH. A symlink is left as it is."""
    ctx = tmp_path / "ctx"
    (ctx / "tree" / "sub").mkdir(parents=True)
    (ctx / "tree" / "sub").chmod(0o700)
    (ctx / "tree" / "data").write_text("x")
    (ctx / "tree" / "data").chmod(0o600)
    (ctx / "tree" / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "tree" / "run.sh").chmod(0o700)
    (ctx / "tree" / "link").symlink_to("data")
    imagebuild._normalise_context(ctx, st.source_date_epoch)
    modes = {str(p.relative_to(ctx)): p.lstat().st_mode & 0o7777 for p in [ctx, *sorted(ctx.rglob("*"))]}
    assert modes == {".": 0o755, "tree": 0o755, "tree/sub": 0o755, "tree/data": 0o644, "tree/run.sh": 0o755,
                     "tree/link": 0o777}
    assert {p.lstat().st_mtime for p in [ctx, *ctx.rglob("*")]} == {st.source_date_epoch}


def test_each_image_tag_has_its_own_ucx_stage_tag(st):
    """A build of another tag (a variant, a reproducibility check) never moves the default image's stage tag."""
    assert stage_ref(st, image_ref(st)) == f"{st.image.name}-ucx-stage:{st.version}"
    assert stage_ref(st, f"{st.image.name}:repro-b-x1") == f"{st.image.name}-ucx-stage:repro-b-x1"
    assert stage_ref(st, "registry:5000/team/img") == f"{st.image.name}-ucx-stage:{st.version}"
    assert stage_ref(st, "registry:5000/team/img:v2") == f"{st.image.name}-ucx-stage:v2"


def test_full_context_layout(tmp_path, st, make_wheel):
    ucxx = ucxx_dir(tmp_path, st, make_wheel)
    ucxx_wheels, _ = imagebuild.read_ucxx_wheels(st, ucxx)

    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "ucx.tar.xz").write_bytes(b"x")
    wheels = tmp_path / "wh"
    wheels.mkdir()
    make_wheel(wheels, "alpha", "1.0")
    (wheels / wheelhouse.LOCK_NAME).write_text("alpha==1.0\n")
    own = make_wheel(tmp_path, "ucx-dask-gpu", "0.0")
    extra_dir = tmp_path / "extra"
    extra_dir.mkdir()
    extra = make_wheel(extra_dir, "marker", "1")
    ctx = tmp_path / "ctx"
    imagebuild.stage_full_context(st, ctx, sources, wheels, own, [extra], ucxx, ucxx_wheels)
    assert (ctx / "ucx" / "sources" / "ucx.tar.xz").is_file()
    assert sorted(p.name for p in (ctx / "ucxx").glob("*.whl")) == sorted(w.name for w in ucxx_wheels)
    reqs = (ctx / "ucxx" / "requirements.txt").read_text().splitlines()
    assert reqs == [f"/build/ucxx/{w.name} --hash=sha256:{sha256_file(w)}" for w in sorted(ucxx_wheels)]
    assert (ctx / "etc" / imagebuild.UCXX_LOCK_NAME).read_text() == (ctx / "ucxx" / "requirements.txt").read_text()
    assert (ctx / "ucxx" / UCXX_BUILD_INFO).read_bytes() == (ucxx / UCXX_BUILD_INFO).read_bytes()
    assert (ctx / "wheelhouse" / "requirements.txt").read_text() == "alpha==1.0\n"
    assert (ctx / "pkg" / "requirements.txt").read_text().startswith(f"/build/pkg/{own.name} --hash=sha256:")
    assert (ctx / "etc" / "stack.toml").read_bytes() == st.path.read_bytes()
    assert (ctx / "etc" / st.python.lock).read_bytes() == st.lock_path().read_bytes()
    assert (ctx / "etc" / imagebuild.EXTRA_LOCK_NAME).read_text() == (ctx / "extra" / "requirements.txt").read_text()
    # Without extra wheels: an empty extra requirements file and no extra lock in /etc (the stack id is unchanged).
    ctx2 = tmp_path / "ctx2"
    imagebuild.stage_full_context(st, ctx2, sources, wheels, own, [], ucxx, ucxx_wheels)
    assert (ctx2 / "extra" / "requirements.txt").read_text() == ""
    assert not (ctx2 / "etc" / imagebuild.EXTRA_LOCK_NAME).exists()


def test_stack_id_is_predicted_from_the_contract_versions_of_what_is_installed(tmp_path, st, make_wheel):
    """The image's stack id (label, checked against what the image computes): the lock, our UCXX wheels, our own
    wheel; another version of our package or of a contract distribution changes it, anything else does not."""
    _, ucxx_info = imagebuild.read_ucxx_wheels(st, ucxx_dir(tmp_path, st, make_wheel))
    own = make_wheel(tmp_path, st.name, st.version)
    base = imagebuild.expected_stack_id(st, ucxx_info, [own])
    (tmp_path / "p").mkdir()
    patched = make_wheel(tmp_path / "p", st.name, st.version + "+patched")
    assert imagebuild.expected_stack_id(st, ucxx_info, [patched]) != base
    other = make_wheel(tmp_path, "some-site-library", "1.0")
    assert imagebuild.expected_stack_id(st, ucxx_info, [own, other]) == base
    pickle = make_wheel(tmp_path, "cloudpickle", "0.0.1")
    assert imagebuild.expected_stack_id(st, ucxx_info, [own, pickle]) != base


def test_own_wheel_must_be_ours(tmp_path, st, make_wheel):
    with pytest.raises(UserError) as err:
        imagebuild.own_wheel_of(st, make_wheel(tmp_path, "not-ours", "1.0"))
    assert err.value.exit_code == BUILD_FAILED and "not a wheel of" in str(err.value)
    ours = make_wheel(tmp_path, st.name, "9.9")
    assert imagebuild.own_wheel_of(st, ours) == ours.resolve()


def test_labels_carry_stack_id_ucx_ucxx_and_versions(tmp_path, st, make_wheel):
    _, ucxx_info = imagebuild.read_ucxx_wheels(st, ucxx_dir(tmp_path, st, make_wheel))
    labels = image_labels.build_labels(st, "0123456789abcdef", UCX_INFO, ucxx_info, "base:1", [])
    assert labels["io.ucx-dask-gpu.stack-id"] == "0123456789abcdef"
    assert labels["io.ucx-dask-gpu.ucx.version"] == "1.20.1"
    assert labels["io.ucx-dask-gpu.ucx.source"] == f"v1.20.1 {'d8' * 20}"
    assert labels["io.ucx-dask-gpu.ucx.patches"] == "1.20.1/0001-x.patch"
    assert labels["io.ucx-dask-gpu.ucxx.version"] == st.ucxx.source.version
    assert labels["io.ucx-dask-gpu.ucxx.source"] == f"{st.ucxx.source.tag} {st.ucxx.source.commit}"
    assert labels["io.ucx-dask-gpu.ucxx.wheels"].count("@sha256:") == 3
    assert labels["org.opencontainers.image.version"] == st.version
    assert labels["org.opencontainers.image.created"] == "2025-11-30T00:00:00Z" or labels[
        "org.opencontainers.image.created"].endswith("Z")
    assert labels["io.ucx-dask-gpu.version.distributed"]


def test_base_packages(st):
    runtime = bases.packages_for(st, "runtime")
    builder = bases.packages_for(st, "builder")
    assert "tini" in runtime and "python3" in runtime
    assert set(runtime) < set(builder) and "build-essential" in builder and "build-essential" not in runtime
    assert bases.base_key(st, "runtime") != bases.base_key(st, "builder")
    with pytest.raises(UserError) as err:
        bases.packages_for(st, "fat")
    assert err.value.exit_code == USAGE


def test_scrub_removes_host_and_time_dependent_files(tmp_path):
    root = tmp_path / "root"
    for rel in ("etc/resolv.conf", "etc/hosts", "var/lib/apt/lists/deb.debian.org_Packages", "var/log/dpkg.log",
                "var/cache/ldconfig/aux-cache", "usr/share/locale/de/LC_MESSAGES/x.mo", "usr/share/locale/locale.alias",
                "usr/share/doc/tini/copyright", "dev/null", "etc/passwd"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    bases.scrub(root)
    left = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert left == {"usr/share/locale/locale.alias", "usr/share/doc/tini/copyright", "etc/passwd"}
    assert (root / "var/lib/apt/lists").is_dir() and (root / "tmp").stat().st_mode & 0o1777 == 0o1777


def test_rootfs_tar_is_deterministic(tmp_path):
    def tree(where: Path, mtime: int) -> Path:
        root = where / "root"
        (root / "b" / "c").mkdir(parents=True)
        (root / "a.txt").write_text("a")
        (root / "b" / "c" / "z").write_text("z")
        (root / "b" / "link").symlink_to("../a.txt")
        import os

        for p in [root / "a.txt", root / "b" / "c" / "z", root / "b" / "c", root / "b", root]:
            os.utime(p, (mtime, mtime))
        return root

    t1, t2 = tmp_path / "1.tar", tmp_path / "2.tar"
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    bases.deterministic_tar(tree(tmp_path / "x", 2_000_000_000), t1, 1_764_460_800)
    bases.deterministic_tar(tree(tmp_path / "y", 2_100_000_000), t2, 1_764_460_800)
    assert t1.read_bytes() == t2.read_bytes()
    import tarfile

    with tarfile.open(t1) as tf:
        names = tf.getnames()
        assert names == sorted(names)
        assert {m.mtime for m in tf.getmembers()} == {1_764_460_800}

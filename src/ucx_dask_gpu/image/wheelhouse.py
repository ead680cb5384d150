"""The image's Python inputs, fetched and verified before `docker build --network none`: every wheel of the hashed
lock (`ensure_wheelhouse`, cached per lock hash and replaced only when complete and verified) and this package's own
wheel (`build_own_wheel`, with stack.toml's SOURCE_DATE_EPOCH).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cliutil import Progress
from ..errors import BAD_STACK, BUILD_FAILED, HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ..fsutil import atomic_path, atomic_write_text, read_json, sha256_file
from ..stack.lock import Pin, canonical, load_lock
from ..stack import Stack

MANIFEST = "wheelhouse.json"
LOCK_NAME = "requirements.txt"  # the lock, copied next to its wheels (what the Dockerfile installs)
_WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


say = Progress("wheelhouse: ")


def pip_platforms(platform: str) -> list[str]:
    """`x86_64-manylinux_2_28` (uv's spelling in stack.toml) -> every pip platform tag a glibc-2.28 host accepts. pip
    expands only the legacy manylinux2014/2010 aliases itself, so the PEP 600 tags are listed explicitly, newest first:
    manylinux_2_28 .. manylinux_2_5, plus manylinux2014 / manylinux2010 / manylinux1."""
    m = re.match(r"^(?P<arch>x86_64|aarch64)-manylinux_2_(?P<minor>\d+)$", platform)
    if not m:
        raise UserError(f"stack.toml python.platform: expected ARCH-manylinux_2_N, got {platform!r}", BAD_STACK)
    arch, minor = m["arch"], int(m["minor"])
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{alias}_{arch}" for glibc, alias in legacy.items() if glibc <= minor]
    return tags


def parse_wheel_name(filename: str) -> tuple[str, str]:
    m = _WHEEL_RE.match(filename)
    if not m:
        raise UserError(f"wheelhouse: {filename!r} is not a wheel file name", HASH_MISMATCH)
    return canonical(m["name"]), m["version"]


def verify_wheels(directory: Path, pins: dict[str, Pin]) -> dict[str, str]:
    """{filename: sha256} when `directory` holds exactly one wheel per pin, each matching one of its hashes."""
    found: dict[str, str] = {}
    by_pin: dict[str, str] = {}
    for path in sorted(directory.glob("*.whl")):
        name, version = parse_wheel_name(path.name)
        pin = pins.get(name)
        if pin is None:
            raise UserError(f"wheelhouse: {path.name} is not in the lock", HASH_MISMATCH)
        if version != pin.version:
            raise UserError(f"wheelhouse: {path.name} has version {version}, the lock pins {pin.version}",
                            HASH_MISMATCH)
        digest = sha256_file(path)
        if digest not in pin.hashes:
            raise UserError(f"wheelhouse: hash mismatch for {path.name}: sha256 {digest} is not one of the "
                            f"{len(pin.hashes)} hash(es) the lock gives for {name}=={pin.version}", HASH_MISMATCH)
        if name in by_pin:
            raise UserError(f"wheelhouse: two wheels for {name}: {by_pin[name]} and {path.name}", HASH_MISMATCH)
        by_pin[name] = path.name
        found[path.name] = digest
    missing = sorted(set(pins) - set(by_pin))
    if missing:
        raise UserError(f"wheelhouse: no wheel for {', '.join(missing[:5])}"
                        f"{' (+%d more)' % (len(missing) - 5) if len(missing) > 5 else ''}", SOURCE_UNREACHABLE)
    return found


def _pip_failure(output: str) -> UserError:
    """One line from pip's multi-line failure: the hash mismatch named, else pip's last ERROR line."""
    if "DO NOT MATCH THE HASHES" in output:
        m = re.search(r"^\s+(\S+==\S+) from (\S+)", output, re.M)
        got = re.search(r"Got\s+([0-9a-f]{64})", output)
        what = m.group(1) if m else "a wheel"
        where = f" ({Path(m.group(2).split('#')[0]).name})" if m else ""
        return UserError(f"wheelhouse: hash mismatch for {what}{where}: downloaded sha256 "
                         f"{got.group(1) if got else '?'} is not in the lock; nothing was written", HASH_MISMATCH)
    errors = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("ERROR:")]
    return UserError(f"wheelhouse: pip download failed: {errors[-1] if errors else output.strip()[-300:]}",
                     SOURCE_UNREACHABLE)


def wheelhouse_dir(cache: Path, lock_path: Path) -> Path:
    return cache / "wheelhouse" / sha256_file(lock_path)[:16]


def ensure_wheelhouse(st: Stack, cache: Path, lock_path: Path | None = None, find_links: Path | None = None) -> Path:
    """A verified wheelhouse for `lock_path` (default: the stack's lock) under `cache`; downloads what is missing
    (`find_links`: from this directory instead of PyPI, e.g. an offline mirror)."""
    lock_path = Path(lock_path or st.lock_path())
    pins = load_lock(lock_path)
    dest = wheelhouse_dir(cache, lock_path)
    manifest = read_json(dest / MANIFEST)
    if manifest is not None and manifest.get("lock_sha256") == sha256_file(lock_path):
        try:
            files = verify_wheels(dest, pins)
        except UserError as e:
            say(f"cached wheelhouse {dest} failed verification ({e}); downloading again")
        else:
            if files == manifest.get("files"):
                say(f"{dest}: {len(files)} wheels, verified against {lock_path.name} (cached)")
                return dest
    platforms = pip_platforms(st.python.platform)
    with atomic_path(dest, replace_dir=True) as tmp:  # the cache's own wheelhouse (stale or failed verification)
        tmp.mkdir()
        cmd = [sys.executable, "-m", "pip", "download", "--require-hashes", "--no-deps",
               "--only-binary=:all:", "--python-version", st.python.version, "--implementation", "cp",
               *[arg for p in platforms for arg in ("--platform", p)],
               "--disable-pip-version-check", "--progress-bar", "off", "--no-input", "-r", str(lock_path),
               "-d", str(tmp)]
        if find_links is not None:
            cmd += ["--no-index", "--find-links", str(find_links)]
        say(f"downloading {len(pins)} wheels of {lock_path.name} (python {st.python.version}, {platforms[0]})")
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        if proc.returncode != 0:
            raise _pip_failure(proc.stdout + "\n" + proc.stderr)
        files = verify_wheels(tmp, pins)
        shutil.copyfile(lock_path, tmp / LOCK_NAME)
        manifest = {"lock": lock_path.name, "lock_sha256": sha256_file(lock_path),
                    "python": st.python.version, "platforms": platforms, "files": files}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    total = sum((dest / f).stat().st_size for f in files)
    say(f"{dest}: {len(files)} wheels ({total / 1e9:.2f} GB), every sha256 verified against {lock_path.name}")
    return dest


def hashed_requirements(wheels: list[Path], install_dir: str) -> str:
    """A --require-hashes requirements file naming each wheel by its path inside the image build."""
    lines = []
    for w in sorted(wheels, key=lambda p: p.name):
        lines.append(f"{install_dir.rstrip('/')}/{w.name} --hash=sha256:{sha256_file(w)}")
    return "\n".join(lines) + "\n"


def build_own_wheel(st: Stack, dest_dir: Path) -> Path:
    """`pip wheel . --no-deps` of this checkout into `dest_dir` (replaced atomically); returns the wheel path."""
    with tempfile.TemporaryDirectory(prefix="own-wheel.") as tmp:
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(st.source_date_epoch), "PIP_NO_INPUT": "1"}
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(st.root), "--no-deps",
                               "--disable-pip-version-check", "-q", "-w", tmp], capture_output=True, text=True,
                              env=env)
        built = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(built) != 1:
            tail = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()][-1:] or ["no wheel"]
            raise UserError(f"building the ucx-dask-gpu wheel failed: {tail[0].strip()}", BUILD_FAILED)
        with atomic_path(dest_dir, replace_dir=True) as out:  # the cache's own folder for this wheel
            out.mkdir()
            shutil.copy2(built[0], out / built[0].name)
    return dest_dir / built[0].name

"""Builds whose bytes do not depend on where they ran: the one place that says how (UCX prefix, UCXX wheels, and the
conda recipes' build scripts through `build.sh prefix-map`).

- Directories: every directory of a build that could reach its output (its work directory, the UCX prefix it
  compiles against, this checkout) is mapped to a stand-in under stack.toml [stack].build_root, the same for C, C++
  and CUDA (`-ffile-prefix-map`, which is `-fdebug-prefix-map` + `-fmacro-prefix-map`: debug info and `__FILE__`;
  nvcc passes it to its host compiler) and for the text a build records (UCX's configure line, CMake options, build
  info). Compiler and recorded text then say the same thing about the build.
- Environment: umask 022, C locale, UTC, SOURCE_DATE_EPOCH from stack.toml, whatever the caller's are (what Debian's
  reprotest varies: a build must not see it).
- Proof: `paths_in` finds any build directory still in the output (recorded per build; the tests require none), and
  a cached build is reused only where a new one would give the same bytes (`tool_versions`, `key_of`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import sha256_file
from ..stack import Stack

UMASK = 0o022
# CMake: link with the installed RPATH from the start. The build-tree RPATH (absolute paths into the work
# directory) would otherwise be rewritten in place at install, leaving a string table as long as the work path.
CMAKE_ARGS = ("-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",)
# The caller's variables that change what the compilers write (kept, with ours appended, and part of the cache key).
FLAG_VARS = ("CC", "CXX", "CPPFLAGS", "CFLAGS", "CXXFLAGS", "LDFLAGS", "NVCCFLAGS", "CUDAFLAGS", "CMAKE_ARGS")
# A directory ends where no file-name character follows: /tmp/a is in "/tmp/a/x", "-I/tmp/a" and "/tmp/a\0", never
# in "/tmp/ab" or "/tmp/a.old".
_BOUNDARY = r"(?![\w.+~-])"


def stand_in(st: Stack, what: str) -> str:
    """<build_root>/<what>: the name a build directory carries in the output (`ucx`, `ucxx`, `checkout`)."""
    return f"{st.build_root}/{what}"


@dataclass(frozen=True)
class PathMap:
    """Real directories of one build and their stand-ins, the most specific (longest) first."""

    pairs: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, mapping: Mapping[str | os.PathLike | None, str]) -> PathMap:
        """Each directory resolved, as the builds pass it to compilers and CMake (one spelling per directory: the
        flags, recorded in the configure line, must not depend on symlinks above the checkout)."""
        pairs: dict[str, str] = {}
        for real, new in mapping.items():
            if real is not None and os.path.realpath(real) not in ("/", new):
                pairs[os.path.realpath(real)] = new
        return cls(tuple(sorted(pairs.items(), key=lambda p: (-len(p[0]), p[0]))))

    @property
    def dirs(self) -> list[str]:
        return [real for real, _ in self.pairs]

    def _flag_order(self) -> list[tuple[str, str]]:
        """gcc and clang try the LAST matching -ffile-prefix-map first, so a directory comes after every mapped
        directory that holds it; otherwise by stand-in. Not by length: the flags are part of what UCX records (its
        configure line), and a work directory shorter or longer than the checkout must not reorder them."""
        def holders(real: str) -> int:
            return sum(1 for other, _ in self.pairs if other != real and real.startswith(other.rstrip("/") + "/"))
        return sorted(self.pairs, key=lambda p: (holders(p[0]), p[1]))

    def compiler_flags(self) -> list[str]:
        """`-ffile-prefix-map=DIR=STAND_IN` for gcc and clang (debug info and __FILE__)."""
        return [f"-ffile-prefix-map={real}={new}" for real, new in self._flag_order()]

    def nvcc_flags(self) -> list[str]:
        """The same maps through nvcc to its host compiler (nvcc has no prefix map of its own)."""
        return [f"-Xcompiler=-ffile-prefix-map={real}={new}" for real, new in self._flag_order()]

    def text(self, s: str) -> str:
        """Every directory replaced by its stand-in, in one pass (a stand-in is never mapped again)."""
        if not self.pairs:
            return s
        new = dict(self.pairs)
        pattern = "|".join(re.escape(real) for real, _ in self.pairs)
        return re.sub(f"(?:{pattern}){_BOUNDARY}", lambda m: new[m.group(0)], s)

    def data(self, obj):
        """`text` applied to every string of a JSON-like value (build info)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {self.text(k): self.data(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.data(v) for v in obj]
        return obj

    def flag_env(self, env: dict[str, str]) -> dict[str, str]:
        """C/C++ (CFLAGS, CXXFLAGS) and CUDA (NVCCFLAGS for autotools, CUDAFLAGS for CMake) compile flags: the
        caller's, then the maps."""
        out = dict(env)
        for var, flags in (("CFLAGS", self.compiler_flags()), ("CXXFLAGS", self.compiler_flags()),
                           ("NVCCFLAGS", self.nvcc_flags()), ("CUDAFLAGS", self.nvcc_flags())):
            out[var] = " ".join(filter(None, [env.get(var, "").strip(), *flags]))
        return out

    def shell_exports(self) -> str:
        """`export VAR=...` lines (`eval "$(build.sh prefix-map ...)"` in a recipe's build script)."""
        env = self.flag_env({k: os.environ.get(k, "") for k in ("CFLAGS", "CXXFLAGS", "NVCCFLAGS", "CUDAFLAGS")})
        return "".join(f"export {k}={shlex.quote(env[k])}\n" for k in ("CFLAGS", "CXXFLAGS", "NVCCFLAGS",
                                                                       "CUDAFLAGS"))


def build_env(st: Stack, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every build step runs in: fixed time stamp, C locale, UTC; an outer `make -jN` must not
    multiply our -j."""
    env = dict(os.environ if base is None else base)
    env.update(SOURCE_DATE_EPOCH=str(st.source_date_epoch), LC_ALL="C", LANG="C", TZ="UTC")
    for var in ("MAKEFLAGS", "LANGUAGE"):
        env.pop(var, None)
    return env


@contextlib.contextmanager
def fixed_umask() -> Iterator[None]:
    """Files a build creates get the same permission bits whatever the caller's umask (tar and zip keep them)."""
    old = os.umask(UMASK)
    try:
        yield
    finally:
        os.umask(old)


# --- leaks ----------------------------------------------------------------------------------------------------------

def _found(data: bytes, dirs: list[str]) -> list[str]:
    return [d for d in dirs if re.search(re.escape(d.encode()) + _BOUNDARY.encode(), data)]


def paths_in(target: Path, dirs: list[str]) -> dict[str, list[str]]:
    """{file (relative; `wheel!member` inside a wheel): the build directories its bytes contain} for a tree or a
    wheel; empty when none of `dirs` is anywhere."""
    dirs = sorted({d for d in dirs if d and d != "/"}, key=len, reverse=True)
    out: dict[str, list[str]] = {}
    if target.is_file() and target.suffix == ".whl":
        with zipfile.ZipFile(target) as z:
            for name in sorted(z.namelist()):
                hit = _found(z.read(name), dirs)
                if hit:
                    out[f"{target.name}!{name}"] = hit
        return out
    for p in sorted(target.rglob("*")):
        if p.is_file() and not p.is_symlink():
            hit = _found(p.read_bytes(), dirs)
            if hit:
                out[str(p.relative_to(target))] = hit
    return out


# --- what a cache key must see ---------------------------------------------------------------------------------------

def _first_line(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "absent"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unusable"
    return ((proc.stdout or proc.stderr).strip().splitlines() or ["?"])[0]


def tool_versions(*tools: str) -> dict[str, str]:
    """First line of `TOOL --version` for each tool (`cc` and `c++` honour $CC/$CXX): the compilers, linker and
    rewriting tools whose version changes the bytes they write."""
    out = {}
    for tool in tools:
        cmd = shlex.split(os.environ.get({"cc": "CC", "c++": "CXX"}.get(tool, ""), "") or tool)
        out[tool] = _first_line([*cmd, "--version"])
    return out


def caller_flags() -> dict[str, str]:
    return {k: os.environ[k] for k in FLAG_VARS if os.environ.get(k)}


def builder_code() -> str:
    """sha256 over this package's build code (ucxbuild/*.py): a change to how we build is a change of input."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def key_of(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def write_stamp(path: Path | None, key: str) -> None:
    """Write `key` to `path` only when it differs: make sees a new mtime exactly when the artefact changed."""
    if path is None:
        return
    try:
        if path.read_text().strip() == key:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")

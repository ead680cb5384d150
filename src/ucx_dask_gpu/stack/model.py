"""The typed model of `stack.toml`, the single place where versions, URLs and hashes are written.

Every consumer (UCX build, recipes, image, environment.yml, SBOM, doctor) goes through `load()`, which validates the
whole file at once: a typo fails here, with one line naming the key, and nothing else reads the TOML tables.
"""
from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping
from urllib.parse import urlparse

from ..errors import BAD_STACK, USAGE, UserError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*([-+~.][0-9A-Za-z.+~-]+)?$")
# configure options the UCX build adds from detection / its own arguments (ucxbuild/build.py configure_command).
BUILD_DETECTED_FLAGS = frozenset({"--prefix", "--with-cuda", "--without-cuda", "--with-verbs", "--without-verbs",
                                  "--with-rdmacm", "--without-rdmacm", "--with-gdrcopy", "--without-gdrcopy"})
STACK_ENV = "UCX_DASK_GPU_STACK"
# Bounds checked before anything recurses or allocates per value: a stack.toml is ~20 kB, 5 levels deep, its longest
# string under 200 characters; a file far past these is a mistake or hostile, refused with one line (exit 3).
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_STRING = 4096
# Where the image records its stack id (computed from what it installed: gate/identity.py), next to its other records.
STACK_ID_FILE = Path("/etc/ucx-dask-gpu/stack-id")


class StackError(UserError):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}", BAD_STACK)


@dataclass(frozen=True)
class Artifact:
    """A file fetched by URL and verified by sha256 (a wheel, a .deb)."""

    name: str
    version: str
    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return Path(urlparse(self.url).path).name


@dataclass(frozen=True)
class SourceArchive:
    """A release tag of an upstream repository, fetched as an archive and verified by its content (gittree.py)."""

    name: str  # what it is, for messages: "UCX", "UCXX", "rapids-cmake", "CPM.cmake"
    version: str
    tag: str
    commit: str
    archive: str  # file name, in source mirrors and the cache
    urls: tuple[str, ...]
    content_tree: str  # git tree id of the archive's content
    sha256: str  # a known archive file with that content, accepted without unpacking
    git: str  # the upstream repository (clone URL) whose commit `commit` the tag names: conda recipes pin it


@dataclass(frozen=True)
class UcxxPackage:
    """One wheel of the UCXX build: its directory in the UCXX source and the CMake options it is built with."""

    name: str
    path: str
    cmake_args: tuple[str, ...]


@dataclass(frozen=True)
class UcxxBuild:
    """[ucxx]: the binding built from source against our UCX."""

    min_ucx: str  # UCXX refuses an older UCX at import (MAJOR.MINOR)
    source: SourceArchive
    rapids_cmake: SourceArchive
    cpm: SourceArchive
    lock: Path  # hash-pinned build environment, relative to the repository
    requirements: tuple[str, ...]
    matrix_entry: str
    packages: tuple[UcxxPackage, ...]


@dataclass(frozen=True)
class DebianSpec:
    """[debian]: the mirror the bases and the build machines use, and the package lists."""

    suite: str
    mirror: str
    ucx_build_packages: tuple[str, ...]
    base_packages: tuple[str, ...]
    builder_packages: tuple[str, ...]
    image_host_packages: tuple[str, ...]


@dataclass(frozen=True)
class ImageSpec:
    """[image]: names, the fixed user, and the paths the Dockerfile installs UCX and the venv at."""

    name: str
    base_name: str
    builder_name: str
    user: str
    uid: int
    ucx_prefix: str
    venv: str


@dataclass(frozen=True)
class GpuHostSpec:
    """[gpu_host]: where tools/rootfs_runner keeps the image's parts and unpacks them on a host without Docker; the
    sampling profiler the per-task benchmark runs there."""

    parts_dir: str
    root: str
    profiler: str


@dataclass(frozen=True)
class SbomSpec:
    """[sbom]: the SBOM generator, pinned (its output is part of the image's bytes)."""

    generator: str
    generator_version: str


@dataclass(frozen=True)
class PythonSpec:
    """[python]: the interpreter the image runs, and the hash-pinned lock resolved for it."""

    version: str
    platform: str
    lock: Path
    requirements: tuple[str, ...]


@dataclass(frozen=True)
class TestToolsSpec:
    """[test_tools]: launchers the tests generate commands with (not in the image), and their hash-pinned lock."""

    lock: Path
    requirements: tuple[str, ...]


@dataclass(frozen=True)
class CondaAbout:
    """[conda.about]: the recipes' homepage and repository URLs."""

    ucx_home: str
    ucx_dev_url: str
    home: str
    ucxx_home: str


@dataclass(frozen=True)
class CondaSpec:
    """[conda]: the development environment and the recipes' settings."""

    channels: tuple[str, ...]         # install priority order: this project's channel first
    upload_label: str                 # the label of channels[0] an upload publishes to (ci/conda_upload.sh)
    pinning: str                      # conda-forge-pinning's recipe/ folder, relative to the repository root
    pinning_commit: str               # the conda-forge-pinning-feedstock commit the recipes are rendered and built under
    rattler_build: str                # rattler-build's version (CLI in CI, py-rattler-build here): it decides what
                                      # the recipes mean
    migrations: tuple[str, ...]       # migrators (pinning/migrations/<name>.yaml) the feedstocks opt into
    cuda_versions: tuple[str, ...]
    c_stdlib_versions: tuple[str, ...]  # the glibc floor zipped with each of cuda_versions
    python_min: str
    dev_tools: tuple[str, ...]
    cuda_managed: tuple[str, ...]
    names: Mapping[str, str]          # PyPI name -> conda-forge name ("" = not a conda package)
    metapackage: tuple[str, ...]
    about: CondaAbout

    @property
    def c_stdlib_version(self) -> str:
        """The newest glibc floor of the linux packages (what a build image must have at least)."""
        return max(self.c_stdlib_versions, key=lambda v: tuple(map(int, v.split("."))))


@dataclass(frozen=True)
class Stack:
    path: Path
    name: str
    version: str
    cuda_major: int
    source_date_epoch: int
    build_root: str                   # [stack].build_root: what a build's own directories are called in its output
    source: str | None                # [stack].source: where the image's sources live (else git's origin)
    mirror_dirs: tuple[str, ...]      # [sources]
    ucx: SourceArchive
    ucxx: UcxxBuild
    configure_flags: tuple[str, ...]
    required_modules: tuple[str, ...]
    cuda_header_wheels: tuple[Artifact, ...]
    cuda_link_debs: tuple[Artifact, ...]
    debian: DebianSpec
    image: ImageSpec
    gpu_host: GpuHostSpec
    sbom: SbomSpec
    python: PythonSpec
    conda: CondaSpec
    test_tools: TestToolsSpec

    @property
    def root(self) -> Path:
        return self.path.parent

    def lock_path(self) -> Path:
        return self.root / self.python.lock

    def source_archives(self) -> tuple[SourceArchive, ...]:
        return (self.ucx, self.ucxx.source, self.ucxx.rapids_cmake, self.ucxx.cpm)

    def mirror_paths(self) -> list[Path]:
        """[sources].mirror_dirs resolved against the repository root."""
        return [(self.root / d).resolve() for d in self.mirror_dirs]


# --- validation helpers ------------------------------------------------------------------------------------------

def _get(table: dict, key: str, where: str, typ: type | tuple[type, ...], required: bool = True, default=None):
    if key not in table:
        if required:
            near = difflib.get_close_matches(key, [k for k in table if isinstance(k, str)], n=1)
            raise StackError(f"{where}.{key}", "missing" + (f" (is {near[0]!r} a misspelling?)" if near else ""))
        return default
    value = table[key]
    # bool is an int subclass; a version written as `true` is still wrong.
    if isinstance(value, bool) and typ is not bool or not isinstance(value, typ):
        tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise StackError(f"{where}.{key}", f"expected {tname}, got {type(value).__name__} {value!r}")
    return value


def _str_list(table: dict, key: str, where: str, required: bool = True) -> tuple[str, ...]:
    value = _get(table, key, where, list, required, default=[])
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise StackError(f"{where}.{key}[{i}]", f"expected a non-empty string, got {item!r}")
    return tuple(value)


def _matching(table: dict, key: str, where: str, pattern: str | re.Pattern, expected: str) -> str:
    """A string that `pattern` matches whole."""
    value = _get(table, key, where, str)
    if not re.fullmatch(pattern, value):
        raise StackError(f"{where}.{key}", f"expected {expected}, got {value!r}")
    return value


def _all_matching(table: dict, key: str, where: str, pattern: str | re.Pattern, expected: str,
                  required: bool = True) -> tuple[str, ...]:
    """A list of strings, each matched whole by `pattern`."""
    values = _str_list(table, key, where, required)
    for i, value in enumerate(values):
        if not re.fullmatch(pattern, value):
            raise StackError(f"{where}.{key}[{i}]", f"expected {expected}, got {value!r}")
    return values


def _sha256(table: dict, where: str) -> str:
    return _matching(table, "sha256", where, SHA256_RE, "64 lowercase hex characters")


def _url(value: str, where: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https", "file") or (parsed.scheme != "file" and not parsed.netloc) \
            or not parsed.path or parsed.path.endswith("/") or any(c.isspace() for c in value):
        raise StackError(where, f"not a well-formed http(s)/file URL to a file: {value!r}")
    return value


def _version(table: dict, where: str, key: str = "version") -> str:
    return _matching(table, key, where, VERSION_RE, "a version string")


def _table_list(table: dict, key: str, where: str) -> list[dict]:
    value = _get(table, key, where, list)
    if not value:
        raise StackError(f"{where}.{key}", "must list at least one entry")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise StackError(f"{where}.{key}[{i}]", "expected a table")
    return value


def _unique(values: list[str], where: str, what: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise StackError(where, f"{what} {v!r} appears twice")
        seen.add(v)


def _artifact(t: dict, where: str) -> Artifact:
    return Artifact(
        name=_get(t, "name", where, str),
        version=_version(t, where),
        url=_url(_get(t, "url", where, str), f"{where}.url"),
        sha256=_sha256(t, where),
    )


def _hexdigits(t: dict, key: str, where: str, n: int) -> str:
    return _matching(t, key, where, f"[0-9a-f]{{{n}}}", f"{n} lowercase hex characters")


def _source_archive(t: dict, where: str, name: str) -> SourceArchive:
    archive = _get(t, "archive", where, str)
    if "/" in archive or not re.search(r"\.tar\.(gz|xz|bz2)$", archive):
        raise StackError(f"{where}.archive", f"expected a tarball file name, got {archive!r}")
    urls = _str_list(t, "urls", where)
    for i, u in enumerate(urls):
        _url(u, f"{where}.urls[{i}]")
    return SourceArchive(
        name=name,
        version=_version(t, where),
        tag=_get(t, "tag", where, str),
        commit=_hexdigits(t, "commit", where, 40),
        archive=archive,
        urls=urls,
        content_tree=_hexdigits(t, "content_tree", where, 40),
        sha256=_sha256(t, where),
        git=_url(_get(t, "git", where, str), f"{where}.git"),
    )


def _relative_file(value: str, where: str) -> Path:
    if os.path.isabs(value) or ".." in Path(value).parts:
        raise StackError(where, f"must be a path inside the repository, got {value!r}")
    return Path(value)


def _ucxx(t: dict, where: str) -> UcxxBuild:
    build = _get(t, "build", where, dict)
    bw = f"{where}.build"
    packages = []
    for i, p in enumerate(_table_list(build, "packages", bw)):
        pw = f"{bw}.packages[{i}]"
        path = _get(p, "path", pw, str)
        _relative_file(path, f"{pw}.path")
        args = _all_matching(p, "cmake_args", pw, "-D.*", "a -DNAME=VALUE option")
        packages.append(UcxxPackage(name=_get(p, "name", pw, str), path=path, cmake_args=args))
    _unique([p.name for p in packages], f"{bw}.packages", "name")
    return UcxxBuild(
        min_ucx=_matching(t, "min_ucx", where, r"\d+\.\d+", "MAJOR.MINOR"),
        source=_source_archive(_get(t, "source", where, dict), f"{where}.source", "UCXX"),
        rapids_cmake=_source_archive(_get(t, "rapids_cmake", where, dict), f"{where}.rapids_cmake", "rapids-cmake"),
        cpm=_source_archive(_get(t, "cpm", where, dict), f"{where}.cpm", "CPM.cmake"),
        lock=_relative_file(_get(build, "lock", bw, str), f"{bw}.lock"),
        requirements=_str_list(build, "requirements", bw),
        matrix_entry=_get(build, "matrix_entry", bw, str),
        packages=tuple(packages),
    )


def _image(t: dict, where: str) -> ImageSpec:
    paths = {key: _absolute_dir(t, key, where) for key in ("ucx_prefix", "venv")}
    names = {key: _matching(t, key, where, r"[a-z][a-z0-9._-]*", "a lowercase image/user name")
             for key in ("name", "base_name", "builder_name", "user")}
    uid = _get(t, "uid", where, int)
    if not 1000 <= uid < 65534:
        raise StackError(f"{where}.uid", f"expected a non-system uid in 1000..65533, got {uid}")
    return ImageSpec(uid=uid, **names, **paths)


def _absolute_dir(t: dict, key: str, where: str) -> str:
    value = _get(t, key, where, str)
    if not value.startswith("/") or value.endswith("/") or ".." in value.split("/") or " " in value:
        raise StackError(f"{where}.{key}", f"expected an absolute directory path, got {value!r}")
    return value


def _http_url(t: dict, key: str, where: str) -> str:
    value = _get(t, key, where, str)
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise StackError(f"{where}.{key}", f"expected an http(s) URL, got {value!r}")
    return value


def _debian(t: dict, where: str) -> DebianSpec:
    return DebianSpec(
        suite=_get(t, "suite", where, str),
        mirror=_url(_get(t, "mirror", where, str) + "/x", f"{where}.mirror")[:-2],
        ucx_build_packages=_str_list(t, "ucx_build_packages", where),
        base_packages=_str_list(t, "base_packages", where),
        builder_packages=_str_list(t, "builder_packages", where),
        image_host_packages=_str_list(t, "image_host_packages", where),
    )


def _sbom(t: dict, where: str) -> SbomSpec:
    generator = _get(t, "generator", where, str)
    pinned = _get(t, "generator_version", where, str)
    if not generator or not pinned:
        raise StackError(where, "needs generator and generator_version (non-empty strings)")
    return SbomSpec(generator=generator, generator_version=pinned)


def _python(t: dict, where: str) -> PythonSpec:
    return PythonSpec(version=_matching(t, "version", where, r"3\.\d+", "3.N"),
                      platform=_get(t, "platform", where, str),
                      lock=_relative_file(_get(t, "lock", where, str), f"{where}.lock"),
                      requirements=_str_list(t, "requirements", where))


PINNED, PINNED_TEXT = r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.+-]*", "NAME==VERSION (pinned)"


def _test_tools(t: dict, where: str) -> TestToolsSpec:
    reqs = _all_matching(t, "requirements", where, PINNED, PINNED_TEXT)
    return TestToolsSpec(lock=_relative_file(_get(t, "lock", where, str), f"{where}.lock"), requirements=reqs)


def _conda(t: dict, where: str) -> CondaSpec:
    names = _get(t, "names", where, dict)
    for k, v in names.items():
        if not isinstance(v, str):
            raise StackError(f"{where}.names.{k}", f"expected a string, got {v!r}")
    cuda_versions = _all_matching(t, "cuda_versions", where, r"\d+\.\d+", "MAJOR.MINOR")
    glibcs = _all_matching(t, "c_stdlib_versions", where, r"2\.\d+", "a glibc version 2.MINOR")
    if len(glibcs) != len(cuda_versions):
        raise StackError(f"{where}.c_stdlib_versions", f"one per cuda_versions entry ({len(cuda_versions)}), got "
                                                       f"{len(glibcs)}")
    meta = _all_matching(t, "metapackage", where, r"[a-z0-9][a-z0-9._-]*", "a conda package name")
    if not meta:
        raise StackError(f"{where}.metapackage", "must list at least one conda package")
    about = t.get("about")
    if not isinstance(about, dict):
        raise StackError(f"{where}.about", "missing (a table with home, ucx_home, ucx_dev_url, ucxx_home)")
    return CondaSpec(
        channels=_str_list(t, "channels", where),
        upload_label=_matching(t, "upload_label", where, r"[A-Za-z0-9][A-Za-z0-9._-]*",
                               "an anaconda.org label (letters, digits, . _ -)"),
        pinning=_get(t, "pinning", where, str),
        pinning_commit=_hexdigits(t, "pinning_commit", where, 40),
        rattler_build=_version(t, where, "rattler_build"),
        migrations=_all_matching(t, "migrations", where, r"[A-Za-z0-9_.-]+", "a migrator name (migrations/<name>.yaml)",
                                 required=False),
        cuda_versions=cuda_versions,
        c_stdlib_versions=glibcs,
        python_min=_matching(t, "python_min", where, r"3\.\d+", "3.N"),
        dev_tools=_str_list(t, "dev_tools", where),
        cuda_managed=_str_list(t, "cuda_managed", where),
        names=MappingProxyType(dict(names)),
        metapackage=meta,
        about=CondaAbout(**{k: _http_url(about, k, f"{where}.about")
                            for k in ("ucx_home", "ucx_dev_url", "home", "ucxx_home")}),
    )


class _Table(dict):
    """A TOML table that remembers which keys the model asked for: whatever it never asked for is a key no consumer
    reads (a misspelling that would otherwise pass as "ok")."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: set[str] = set()

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def items(self):  # a free-form mapping (conda.names): every key is read
        self.asked.update(self.keys())
        return super().items()


def _tracked(value: Any, where: str, depth: int = 0) -> Any:
    """A copy of the parsed data with every table a _Table; strings and nesting bounded (the depth is checked before
    going one level deeper, so this recursion stays short)."""
    if depth > MAX_DEPTH:
        raise StackError(where, f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str) and len(value) > MAX_STRING:
        raise StackError(where, f"a string of {len(value)} characters (at most {MAX_STRING})")
    if isinstance(value, dict):
        for k in value:
            if len(str(k)) > MAX_STRING:
                raise StackError(where, f"a key of {len(str(k))} characters (at most {MAX_STRING})")
        return _Table({k: _tracked(v, f"{where}.{k}", depth + 1) for k, v in value.items()})
    if isinstance(value, list):
        return [_tracked(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return value


def _unknown_key(value: Any, where: str) -> None:
    """The first key (in file order) the model never asked for, with the nearest one it knows."""
    if isinstance(value, _Table):
        for k in dict.keys(value):
            if k not in value.asked:
                near = difflib.get_close_matches(k, [a for a in value.asked if isinstance(a, str)], n=1)
                raise StackError(f"{where}.{k}", "unknown key" + (f" (did you mean {near[0]}?)" if near else ""))
            _unknown_key(dict.__getitem__(value, k), f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _unknown_key(v, f"{where}[{i}]")


def parse(data: dict[str, Any], path: Path) -> Stack:
    w = path.name
    data = _tracked(data, w)
    st = _parse(data, path)
    _unknown_key(data, w)
    return st


def _parse(data: dict[str, Any], path: Path) -> Stack:
    w = path.name
    if _get(data, "schema", w, int) != 1:
        raise StackError(f"{w}.schema", f"unsupported schema {data['schema']!r} (this tool reads 1)")
    st = _get(data, "stack", w, dict)
    ucx = _get(data, "ucx", w, dict)
    conf = _get(ucx, "configure", f"{w}.ucx", dict)
    cuda = _get(data, "cuda", w, dict)
    gpu_host = _get(data, "gpu_host", w, dict)

    cuda_major = _get(st, "cuda_major", f"{w}.stack", int)
    if cuda_major not in (12, 13):
        raise StackError(f"{w}.stack.cuda_major", f"expected 12 or 13, got {cuda_major}")
    epoch = _get(st, "source_date_epoch", f"{w}.stack", int)
    if epoch <= 0:
        raise StackError(f"{w}.stack.source_date_epoch", f"must be a positive Unix time, got {epoch}")
    source = _get(st, "source", f"{w}.stack", str, required=False) or None
    sources = _get(data, "sources", w, dict)
    mirror_dirs = _str_list(sources, "mirror_dirs", f"{w}.sources", required=False)
    ucx_source = _source_archive(_get(ucx, "source", f"{w}.ucx", dict), f"{w}.ucx.source", "UCX")
    ucxx = _ucxx(_get(data, "ucxx", w, dict), f"{w}.ucxx")
    _unique([a.archive for a in (ucx_source, ucxx.source, ucxx.rapids_cmake, ucxx.cpm)], w, "source archive")

    flags = _all_matching(conf, "flags", f"{w}.ucx.configure", "--.*", "a --option")
    for i, flag in enumerate(flags):
        if flag.split("=", 1)[0] in BUILD_DETECTED_FLAGS:
            raise StackError(f"{w}.ucx.configure.flags[{i}]",
                             f"{flag.split('=', 1)[0]} is set by the build from what it detects; remove it here")
    required_modules = _all_matching(conf, "required_modules", f"{w}.ucx.configure", r"[^/]*\.so",
                                     "a lib/ucx/*.so name")
    return Stack(
        path=path,
        name=_get(st, "name", f"{w}.stack", str),
        version=_version(st, f"{w}.stack"),
        cuda_major=cuda_major,
        source_date_epoch=epoch,
        build_root=_absolute_dir(st, "build_root", f"{w}.stack"),
        source=source,
        mirror_dirs=mirror_dirs,
        ucx=ucx_source,
        ucxx=ucxx,
        configure_flags=flags,
        required_modules=required_modules,
        cuda_header_wheels=tuple(_artifact(t, f"{w}.cuda.header_wheels[{i}]")
                                 for i, t in enumerate(_table_list(cuda, "header_wheels", f"{w}.cuda"))),
        cuda_link_debs=tuple(_artifact(t, f"{w}.cuda.link_debs[{i}]")
                             for i, t in enumerate(_table_list(cuda, "link_debs", f"{w}.cuda"))),
        debian=_debian(_get(data, "debian", w, dict), f"{w}.debian"),
        image=_image(_get(data, "image", w, dict), f"{w}.image"),
        gpu_host=GpuHostSpec(**{k: _absolute_dir(gpu_host, k, f"{w}.gpu_host") for k in ("parts_dir", "root")},
                             profiler=_matching(gpu_host, "profiler", f"{w}.gpu_host", PINNED, PINNED_TEXT)),
        sbom=_sbom(_get(data, "sbom", w, dict), f"{w}.sbom"),
        python=_python(_get(data, "python", w, dict), f"{w}.python"),
        conda=_conda(_get(data, "conda", w, dict), f"{w}.conda"),
        test_tools=_test_tools(_get(data, "test_tools", w, dict), f"{w}.test_tools"),
    )


def find_stack_file() -> Path:
    """$UCX_DASK_GPU_STACK, else the repository's stack.toml (source checkout), else the copy shipped in the package."""
    env = os.environ.get(STACK_ENV)
    if env:
        return Path(env)
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent.parent / "stack.toml", package / "_data" / "stack.toml"):
        if candidate.is_file():
            return candidate
    raise UserError(f"no stack.toml found (set {STACK_ENV}=/path/to/stack.toml)", BAD_STACK)


def toml_depth(text: str) -> int:
    """How deeply arrays and inline tables nest in TOML text, strings and comments skipped: tomllib recurses once per
    level (1,000 levels end in a RecursionError), so this is read first, in one pass without recursion."""
    depth = deepest = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
        elif c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c in "\"'":
            quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                j += 2 if c == '"' and text[j] == "\\" else 1  # a basic string's escape: \" does not end it
            i = j + len(quote) - 1
        i += 1
    return deepest


def _read(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}", BAD_STACK) from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{path}: larger than {MAX_FILE_BYTES} bytes (a stack.toml is a few kB)", BAD_STACK)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 (byte 0x{e.object[e.start]:02x} on line {line})", BAD_STACK) from None
    if toml_depth(text) > MAX_DEPTH:
        raise UserError(f"{path}: arrays or tables nested more than {MAX_DEPTH} levels deep", BAD_STACK)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}", BAD_STACK) from None


def load(path: str | os.PathLike | None = None) -> Stack:
    path = Path(path) if path is not None else find_stack_file()
    return parse(_read(path), path.resolve())


def value(dotted: str, path: str | os.PathLike | None = None):
    """One value as written in stack.toml (`ucx.source.version`), for shell scripts; the whole file is validated
    first, so a script never reads a value from a file the model refuses."""
    path = Path(path) if path is not None else find_stack_file()
    cur: Any = _read(path)
    parse(cur, path.resolve())
    for part in dotted.split("."):
        if isinstance(cur, list):
            if not part.isdigit() or int(part) >= len(cur):
                raise UserError(f"{dotted!r}: {part!r} is not an index of a {len(cur)}-item list", USAGE)
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise UserError(f"no key {dotted!r} in stack.toml", USAGE)
    return cur

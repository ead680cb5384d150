"""Load and validate `stack.toml`, the single place where versions, URLs and hashes are written.

Every consumer (UCX build, recipes, Dockerfile inputs, environment.yml, doctor) goes through `load()`, so a typo in
stack.toml fails once, here, with one line naming the key.
"""
from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .errors import BAD_STACK, UserError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*([-+~.][0-9A-Za-z.+~-]+)?$")
# configure options the UCX build adds from detection / its own arguments (ucxbuild/build.py configure_command).
BUILD_DETECTED_FLAGS = frozenset({"--prefix", "--with-cuda", "--without-cuda", "--with-verbs", "--without-verbs",
                                  "--with-rdmacm", "--without-rdmacm", "--with-gdrcopy", "--without-gdrcopy"})
STACK_ENV = "UCX_DASK_GPU_STACK"


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


@dataclass(frozen=True)
class UcxxPackage:
    """One wheel of the UCXX build: its directory in the UCXX source and the CMake options it is built with."""

    name: str
    path: str
    cmake_args: tuple[str, ...]


@dataclass(frozen=True)
class UcxxBuild:
    """[ucxx]: the binding built from source against our UCX."""

    source: SourceArchive
    rapids_cmake: SourceArchive
    cpm: SourceArchive
    lock: Path  # hash-pinned build environment, relative to the repository
    requirements: tuple[str, ...]
    matrix_entry: str
    packages: tuple[UcxxPackage, ...]


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
class Stack:
    path: Path
    raw: dict[str, Any] = field(repr=False)
    name: str
    version: str
    cuda_major: int
    source_date_epoch: int
    mirror_dirs: tuple[str, ...]
    ucx: SourceArchive
    ucxx: UcxxBuild
    configure_flags: tuple[str, ...]
    required_modules: tuple[str, ...]
    cuda_header_wheels: tuple[Artifact, ...]
    cuda_link_debs: tuple[Artifact, ...]
    debian_suite: str
    debian_mirror: str
    ucx_build_packages: tuple[str, ...]
    debian_base_packages: tuple[str, ...]
    debian_builder_packages: tuple[str, ...]
    debian_image_host_packages: tuple[str, ...]
    image: ImageSpec
    python_lock: Path
    python_version: str
    python_platform: str
    python_requirements: tuple[str, ...]
    conda_channels: tuple[str, ...]
    conda_cuda_versions: tuple[str, ...]
    conda_dev_tools: tuple[str, ...]
    conda_names: dict[str, str]
    conda_cuda_managed: tuple[str, ...]

    @property
    def root(self) -> Path:
        return self.path.parent

    def lock_path(self) -> Path:
        return self.root / self.python_lock

    def source_archives(self) -> tuple[SourceArchive, ...]:
        return (self.ucx, self.ucxx.source, self.ucxx.rapids_cmake, self.ucxx.cpm)

    def mirror_paths(self) -> list[Path]:
        """[sources].mirror_dirs resolved against the repository root."""
        return [(self.root / d).resolve() for d in self.mirror_dirs]

    def stack_id(self, build_info: Path | None = None, extra_locks: tuple[Path, ...] = ()) -> str:
        """Hash of stack.toml + the Python lock (+ any extra hashed requirements installed on top, + the UCX
        build-info.json): two environments with the same id were built from the same inputs.

        The image's id (/etc/ucx-dask-gpu/stack-id, its label) is this with the build info of the UCX inside it;
        files are hashed with their base names, so the checkout and the image's copies give the same id.
        """
        return stack_id_of([self.path, self.lock_path(), *extra_locks, *([build_info] if build_info else [])])


def stack_id_of(paths: list[Path], extra: bytes = b"") -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes() if p.exists() else b"<missing>")
        h.update(b"\0")
    h.update(extra)
    return h.hexdigest()[:16]


# --- validation helpers ------------------------------------------------------------------------------------------

def _get(table: dict, key: str, where: str, typ: type | tuple[type, ...], required: bool = True, default=None):
    if key not in table:
        if required:
            raise StackError(f"{where}.{key}", "missing")
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


def _sha256(table: dict, where: str) -> str:
    value = _get(table, "sha256", where, str)
    if not SHA256_RE.match(value):
        raise StackError(f"{where}.sha256", f"expected 64 lowercase hex characters, got {value!r}")
    return value


def _url(value: str, where: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https", "file") or (parsed.scheme != "file" and not parsed.netloc) \
            or not parsed.path or parsed.path.endswith("/") or any(c.isspace() for c in value):
        raise StackError(where, f"not a well-formed http(s)/file URL to a file: {value!r}")
    return value


def _version(table: dict, where: str) -> str:
    value = _get(table, "version", where, str)
    if not VERSION_RE.match(value):
        raise StackError(f"{where}.version", f"not a version string: {value!r}")
    return value


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
    value = _get(t, key, where, str)
    if not re.fullmatch(f"[0-9a-f]{{{n}}}", value):
        raise StackError(f"{where}.{key}", f"expected {n} lowercase hex characters, got {value!r}")
    return value


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
        args = _str_list(p, "cmake_args", pw)
        for k, arg in enumerate(args):
            if not arg.startswith("-D"):
                raise StackError(f"{pw}.cmake_args[{k}]", f"expected a -DNAME=VALUE option, got {arg!r}")
        packages.append(UcxxPackage(name=_get(p, "name", pw, str), path=path, cmake_args=args))
    _unique([p.name for p in packages], f"{bw}.packages", "name")
    return UcxxBuild(
        source=_source_archive(_get(t, "source", where, dict), f"{where}.source", "UCXX"),
        rapids_cmake=_source_archive(_get(t, "rapids_cmake", where, dict), f"{where}.rapids_cmake", "rapids-cmake"),
        cpm=_source_archive(_get(t, "cpm", where, dict), f"{where}.cpm", "CPM.cmake"),
        lock=_relative_file(_get(build, "lock", bw, str), f"{bw}.lock"),
        requirements=_str_list(build, "requirements", bw),
        matrix_entry=_get(build, "matrix_entry", bw, str),
        packages=tuple(packages),
    )


def _image(t: dict, where: str) -> ImageSpec:
    paths = {}
    for key in ("ucx_prefix", "venv"):
        value = _get(t, key, where, str)
        if not value.startswith("/") or value.endswith("/") or ".." in value.split("/") or " " in value:
            raise StackError(f"{where}.{key}", f"expected an absolute directory path, got {value!r}")
        paths[key] = value
    names = {}
    for key in ("name", "base_name", "builder_name", "user"):
        value = _get(t, key, where, str)
        if not re.match(r"^[a-z][a-z0-9._-]*$", value):
            raise StackError(f"{where}.{key}", f"expected a lowercase image/user name, got {value!r}")
        names[key] = value
    uid = _get(t, "uid", where, int)
    if not 1000 <= uid < 65534:
        raise StackError(f"{where}.uid", f"expected a non-system uid in 1000..65533, got {uid}")
    return ImageSpec(uid=uid, **names, **paths)


def parse(data: dict[str, Any], path: Path) -> Stack:
    w = path.name
    if _get(data, "schema", w, int) != 1:
        raise StackError(f"{w}.schema", f"unsupported schema {data['schema']!r} (this tool reads 1)")
    st = _get(data, "stack", w, dict)
    ucx = _get(data, "ucx", w, dict)
    conf = _get(ucx, "configure", f"{w}.ucx", dict)
    cuda = _get(data, "cuda", w, dict)
    deb = _get(data, "debian", w, dict)
    py = _get(data, "python", w, dict)
    conda = _get(data, "conda", w, dict)
    names = _get(conda, "names", f"{w}.conda", dict)
    for k, v in names.items():
        if not isinstance(v, str):
            raise StackError(f"{w}.conda.names.{k}", f"expected a string, got {v!r}")
    cuda_versions = _str_list(conda, "cuda_versions", f"{w}.conda")
    for i, v in enumerate(cuda_versions):
        if not re.match(r"^\d+\.\d+$", v):
            raise StackError(f"{w}.conda.cuda_versions[{i}]", f"expected MAJOR.MINOR, got {v!r}")
    py_version = _get(py, "version", f"{w}.python", str)
    if not re.match(r"^3\.\d+$", py_version):
        raise StackError(f"{w}.python.version", f"expected 3.N, got {py_version!r}")

    cuda_major = _get(st, "cuda_major", f"{w}.stack", int)
    if cuda_major not in (12, 13):
        raise StackError(f"{w}.stack.cuda_major", f"expected 12 or 13, got {cuda_major}")
    epoch = _get(st, "source_date_epoch", f"{w}.stack", int)
    if epoch <= 0:
        raise StackError(f"{w}.stack.source_date_epoch", f"must be a positive Unix time, got {epoch}")
    lock = _relative_file(_get(py, "lock", f"{w}.python", str), f"{w}.python.lock")
    sources = _get(data, "sources", w, dict)
    mirror_dirs = _str_list(sources, "mirror_dirs", f"{w}.sources", required=False)
    mirror = _url(_get(deb, "mirror", f"{w}.debian", str) + "/x", f"{w}.debian.mirror")[:-2]
    ucx_source = _source_archive(_get(ucx, "source", f"{w}.ucx", dict), f"{w}.ucx.source", "UCX")
    ucxx = _ucxx(_get(data, "ucxx", w, dict), f"{w}.ucxx")
    _unique([a.archive for a in (ucx_source, ucxx.source, ucxx.rapids_cmake, ucxx.cpm)], w, "source archive")

    flags = _str_list(conf, "flags", f"{w}.ucx.configure")
    for i, flag in enumerate(flags):
        if not flag.startswith("--"):
            raise StackError(f"{w}.ucx.configure.flags[{i}]", f"expected a --option, got {flag!r}")
        if flag.split("=", 1)[0] in BUILD_DETECTED_FLAGS:
            raise StackError(f"{w}.ucx.configure.flags[{i}]",
                             f"{flag.split('=', 1)[0]} is set by the build from what it detects; remove it here")
    required_modules = _str_list(conf, "required_modules", f"{w}.ucx.configure")
    for i, m in enumerate(required_modules):
        if "/" in m or not m.endswith(".so"):
            raise StackError(f"{w}.ucx.configure.required_modules[{i}]", f"expected a lib/ucx/*.so name, got {m!r}")
    return Stack(
        path=path,
        raw=data,
        name=_get(st, "name", f"{w}.stack", str),
        version=_version(st, f"{w}.stack"),
        cuda_major=cuda_major,
        source_date_epoch=epoch,
        mirror_dirs=mirror_dirs,
        ucx=ucx_source,
        ucxx=ucxx,
        configure_flags=flags,
        required_modules=required_modules,
        cuda_header_wheels=tuple(_artifact(t, f"{w}.cuda.header_wheels[{i}]")
                                 for i, t in enumerate(_table_list(cuda, "header_wheels", f"{w}.cuda"))),
        cuda_link_debs=tuple(_artifact(t, f"{w}.cuda.link_debs[{i}]")
                             for i, t in enumerate(_table_list(cuda, "link_debs", f"{w}.cuda"))),
        debian_suite=_get(deb, "suite", f"{w}.debian", str),
        debian_mirror=mirror,
        ucx_build_packages=_str_list(deb, "ucx_build_packages", f"{w}.debian"),
        debian_base_packages=_str_list(deb, "base_packages", f"{w}.debian"),
        debian_builder_packages=_str_list(deb, "builder_packages", f"{w}.debian"),
        debian_image_host_packages=_str_list(deb, "image_host_packages", f"{w}.debian"),
        image=_image(_get(data, "image", w, dict), f"{w}.image"),
        python_lock=lock,
        python_version=py_version,
        python_platform=_get(py, "platform", f"{w}.python", str),
        python_requirements=_str_list(py, "requirements", f"{w}.python"),
        conda_channels=_str_list(conda, "channels", f"{w}.conda"),
        conda_cuda_versions=cuda_versions,
        conda_dev_tools=_str_list(conda, "dev_tools", f"{w}.conda"),
        conda_names=dict(names),
        conda_cuda_managed=_str_list(conda, "cuda_managed", f"{w}.conda"),
    )


def find_stack_file() -> Path:
    """$UCX_DASK_GPU_STACK, else the repository's stack.toml (source checkout), else the copy shipped in the package."""
    env = os.environ.get(STACK_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent.parent / "stack.toml", here / "_data" / "stack.toml"):
        if candidate.is_file():
            return candidate
    raise UserError(f"no stack.toml found (set {STACK_ENV}=/path/to/stack.toml)", BAD_STACK)


def load(path: str | os.PathLike | None = None) -> Stack:
    path = Path(path) if path is not None else find_stack_file()
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}", BAD_STACK) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path.name}: not valid TOML: {e}", BAD_STACK) from None
    return parse(data, path.resolve())

"""Find CUDA headers and link libraries for the UCX build (`--cuda auto|DIR|none`; ucx-src-build/README.md, "CUDA",
says which it takes): a complete toolkit, else the pinned PyPI header wheels and the Debian driver .debs, whose
libcuda.so / libnvidia-ml.so only satisfy the linker (at run time the host driver's copies are loaded). Wheels are
unzipped and .debs unpacked (ar + tar, no dpkg needed) into the work directory, never installed.
"""
from __future__ import annotations

import io
import os
import platform
import re
import shutil
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MISSING_CAPABILITY, USAGE, UserError
from ..stack import Stack
from .fetch import fetch_artifact, say

LINK_LIBS = ("libcuda.so", "libnvidia-ml.so")
HEADERS = ("cuda.h", "cuda_runtime.h", "nvml.h")
_CUDA_VERSION_RE = re.compile(r"^#define\s+CUDA_VERSION\s+(\d+)", re.M)


@dataclass
class CudaSetup:
    kind: str  # "toolkit" | "wheels" | "none"
    home: Path | None = None  # passed as --with-cuda=
    include_dir: Path | None = None
    link_dirs: list[Path] = field(default_factory=list)
    version: str | None = None  # from cuda.h, e.g. "13.0"
    link_source: str | None = None  # where libcuda.so / libnvidia-ml.so for linking came from
    inputs: list[dict] = field(default_factory=list)  # pinned wheels/debs used: name, version, sha256
    note: str = ""

    def cppflags(self) -> list[str]:
        return [f"-I{self.include_dir}"] if self.include_dir else []

    def ldflags(self) -> list[str]:
        return [f"-L{d}" for d in self.link_dirs]

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "version": self.version,
            "home": str(self.home) if self.home else None,
            "link_source": self.link_source,
            "inputs": sorted(self.inputs, key=lambda d: d["name"]),
            "note": self.note,
        }


def _arch_dirs() -> list[str]:
    m = platform.machine()
    return ["x86_64-linux"] if m == "x86_64" else ["sbsa-linux", "aarch64-linux"] if m == "aarch64" else []


def include_dir_of(home: Path) -> Path | None:
    """The directory holding cuda.h: include/ or targets/<arch>/include/ (conda-forge's layout)."""
    for d in [home / "include"] + [home / "targets" / a / "include" for a in _arch_dirs()]:
        if (d / "cuda.h").is_file():
            return d
    return None


def link_dir_of(home: Path, lib: str) -> Path | None:
    """The first directory under a toolkit with `lib` (stubs first: they never shadow the real driver at run time)."""
    subdirs = ["lib64/stubs", "lib/stubs"] + [f"targets/{a}/lib/stubs" for a in _arch_dirs()] + ["lib64", "lib"]
    for sub in subdirs:
        if (home / sub / lib).exists():
            return home / sub
    return None


def cuda_version(include_dir: Path) -> str | None:
    m = _CUDA_VERSION_RE.search((include_dir / "cuda.h").read_text(errors="replace"))
    if not m:
        return None
    v = int(m.group(1))
    return f"{v // 1000}.{v % 1000 // 10}"


def toolkit_problems(home: Path) -> list[str]:
    """What a directory lacks to serve as --with-cuda (empty: complete)."""
    inc = include_dir_of(home)
    if inc is None:
        return ["include/cuda.h"]
    missing = [f"include/{h}" for h in HEADERS if not (inc / h).is_file()]
    missing += [f"lib64/stubs/{lib}" for lib in LINK_LIBS if link_dir_of(home, lib) is None]
    return missing


def _auto_candidates() -> list[Path]:
    named = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
    return list(dict.fromkeys(Path(c) for c in named if c))


def _auto_choice() -> tuple[Path | None, list[str]]:
    """`--cuda auto`: the first candidate whose headers are complete (link libraries: its stubs, else
    --cuda-link-dir, else the pinned .debs), and why the others were passed over."""
    rejected = []
    for home in _auto_candidates():
        if not home.exists():
            continue
        header_problems = [p for p in toolkit_problems(home) if p.startswith("include/")]
        if not header_problems:
            return home, rejected
        rejected.append(f"{home} lacks {', '.join(header_problems)}")
    return None, rejected


def auto_toolkit() -> Path | None:
    """The toolkit `--cuda auto` takes (None: the pinned wheels and .debs)."""
    home = _auto_choice()[0]
    return home.resolve() if home is not None else None


def extract_deb(deb: Path, dest: Path) -> None:
    """`dpkg -x` in Python: a .deb is an ar archive whose data.tar.{xz,gz,zst} holds the files."""
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise UserError(f"{deb.name}: not a Debian package (no ar header)", USAGE)
        while header := f.read(60):
            if len(header) < 60:
                break
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            if name.startswith("data.tar"):
                if name.endswith(".zst"):
                    raise UserError(f"{deb.name}: zstd-compressed data is not supported; use a Debian .deb", USAGE)
                with tarfile.open(fileobj=io.BytesIO(f.read(size))) as tar:
                    safe_extract(tar, dest)
                return
            f.seek(size + (size & 1), 1)  # members are 2-byte aligned
    raise UserError(f"{deb.name}: no data.tar member", USAGE)


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
    else:  # Python < 3.11.4: refuse absolute paths and `..` ourselves
        for m in tar.getmembers():
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise UserError(f"refusing archive member {m.name!r}", USAGE)
        tar.extractall(dest)


def _link_dir_from_debs(stack: Stack, work: Path, fetch_kw: dict, setup: CudaSetup) -> Path:
    """Unpack the pinned driver .debs; return a private dir with libcuda.so / libnvidia-ml.so link names (recorded as
    `setup`'s link source)."""
    root = work / "cuda-debs"
    shutil.rmtree(root, ignore_errors=True)
    found: dict[str, Path] = {}
    for art in stack.cuda_link_debs:
        deb = fetch_artifact(art, **fetch_kw)
        extract_deb(deb, root / art.name)
        setup.inputs.append({"name": art.name, "version": art.version, "sha256": art.sha256, "kind": "deb"})
        for lib in LINK_LIBS:
            for p in (root / art.name).rglob(lib + "*"):
                if p.name.startswith(lib) and p.is_file() and lib not in found:
                    found[lib] = p.resolve()
    missing = [lib for lib in LINK_LIBS if lib not in found]
    if missing:
        raise UserError(f"the pinned [[cuda.link_debs]] do not contain {', '.join(missing)}", MISSING_CAPABILITY)
    link = work / "cuda-link"
    shutil.rmtree(link, ignore_errors=True)
    link.mkdir(parents=True)
    for lib, target in found.items():
        (link / lib).symlink_to(target)
    setup.link_source = "pinned Debian .debs (" + ", ".join(a.name for a in stack.cuda_link_debs) + ")"
    return link


def _from_wheels(stack: Stack, work: Path, fetch_kw: dict, note: str) -> CudaSetup:
    setup = CudaSetup(kind="wheels", note=note)
    root = work / "cuda-wheels"
    shutil.rmtree(root, ignore_errors=True)
    for art in stack.cuda_header_wheels:
        whl = fetch_artifact(art, **fetch_kw)
        with zipfile.ZipFile(whl) as z:
            z.extractall(root)
        setup.inputs.append({"name": art.name, "version": art.version, "sha256": art.sha256, "kind": "wheel"})
    homes = sorted({p.parent.parent for p in root.glob("nvidia/*/include/cuda.h")})
    if len(homes) != 1:
        raise UserError(f"the pinned [[cuda.header_wheels]] must provide exactly one nvidia/*/include/cuda.h "
                        f"(found {len(homes)})", MISSING_CAPABILITY)
    home = homes[0]
    setup.home, setup.include_dir = home, home / "include"
    missing = [h for h in HEADERS if not (setup.include_dir / h).is_file()]
    if missing:
        raise UserError(f"the pinned [[cuda.header_wheels]] lack {', '.join(missing)}", MISSING_CAPABILITY)
    setup.version = cuda_version(setup.include_dir)
    link = _link_dir_from_debs(stack, work, fetch_kw, setup)
    # Wheels ship only libcudart.so.<major>; the linker (-lcudart) needs the unversioned name.
    cudart = sorted((home / "lib").glob("libcudart.so.*"))
    if not cudart:
        raise UserError("the pinned [[cuda.header_wheels]] lack lib/libcudart.so.*", MISSING_CAPABILITY)
    (link / "libcudart.so").symlink_to(cudart[0].resolve())
    setup.link_dirs = [link]
    return setup


def _from_toolkit(home: Path, stack: Stack, work: Path, fetch_kw: dict, link_dir: Path | None, note: str) -> CudaSetup:
    inc = include_dir_of(home)
    if inc is None:
        raise UserError(f"--cuda {home}: no include/cuda.h there", MISSING_CAPABILITY)
    missing = [h for h in HEADERS if not (inc / h).is_file()]
    if missing:
        raise UserError(f"--cuda {home}: {inc} lacks {', '.join(missing)}", MISSING_CAPABILITY)
    setup = CudaSetup(kind="toolkit", home=home, include_dir=inc, version=cuda_version(inc), note=note)
    if link_dir is not None:
        absent = [lib for lib in LINK_LIBS if not (link_dir / lib).exists()]
        if absent:
            raise UserError(f"--cuda-link-dir {link_dir} lacks {', '.join(absent)}", USAGE)
        setup.link_dirs, setup.link_source = [link_dir], str(link_dir)
    else:
        dirs = [link_dir_of(home, lib) for lib in LINK_LIBS]
        if all(dirs):
            setup.link_dirs = sorted(set(dirs))  # type: ignore[arg-type]
            setup.link_source = ", ".join(str(d) for d in setup.link_dirs)
        else:
            say(f"CUDA: {home} has no libcuda.so/libnvidia-ml.so to link against; using the pinned driver .debs")
            setup.link_dirs = [_link_dir_from_debs(stack, work, fetch_kw, setup)]
    return setup


def resolve(spec: str, stack: Stack, work: Path, *, link_dir: Path | None, fetch_kw: dict) -> CudaSetup:
    """spec: "auto", "none" or a directory."""
    if spec == "none":
        return CudaSetup(kind="none", note="--cuda none")
    if spec != "auto":
        home = Path(spec).resolve()
        if not home.is_dir():
            raise UserError(f"--cuda {spec}: not a directory", USAGE)
        return _from_toolkit(home, stack, work, fetch_kw, link_dir, note=f"--cuda {spec}")
    home, rejected = _auto_choice()
    if home is not None:
        return _from_toolkit(home.resolve(), stack, work, fetch_kw, link_dir, note=f"auto: toolkit at {home}")
    note = "auto: no complete CUDA toolkit" + (f" ({'; '.join(rejected)})" if rejected else "") + \
        "; using the pinned PyPI wheels + Debian driver .debs"
    say(f"CUDA: {note}")
    return _from_wheels(stack, work, fetch_kw, note)

"""The image's SBOM: CycloneDX 1.6 JSON, made with cyclonedx-python-lib, deterministic (docs/reproducibility.md says
what it lists): metadata.timestamp is SOURCE_DATE_EPOCH, and serialNumber is a UUID derived from the document's own
content. A Python distribution gets the sha256 of the exact wheel it came from when known, else every hash the lock
allows for the pin. `check_sbom` cross-checks a document against the hashed lock, a dpkg status file and a UCX build
info.
"""
from __future__ import annotations

import email.parser
import hashlib
import json
import uuid
from datetime import datetime, timezone
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace

from ..errors import SBOM_GENERATOR, SBOM_MISMATCH, UserError
from ..stack import Stack
from ..stack.lock import Pin, canonical, load_lock
from ..ucx.install import BUILD_INFO, INSTALLED_UCXX_BUILD_INFO
from .archive import LABEL_PREFIX

# Where the image carries its SBOM (its own last layer).
SBOM_IN_IMAGE = "usr/share/ucx-dask-gpu/sbom.cdx.json"
PROP = "ucx-dask-gpu:"
# A fixed namespace for serial numbers derived from content (uuid5 of the content's sha256).
SERIAL_NAMESPACE = uuid.UUID("3c5d1f0e-7a0b-5b7e-9a51-7563782d6461")
# Distributions under these directories come from Debian packages (listed as debs, not again as PyPI packages).
DEBIAN_PYTHON_DIRS = ("usr/lib/python3/", "usr/lib/python3.", "usr/share/python3/")


def generator(st: Stack) -> tuple[str, str]:
    """(distribution, version) of the SBOM generator pinned in stack.toml [sbom]; the installed one must be it,
    because the SBOM's bytes (part of the image) depend on it."""
    name, pinned = st.sbom.generator, st.sbom.generator_version
    try:
        installed = version(name)
    except PackageNotFoundError:
        installed = None
    if installed != pinned:
        raise UserError(f"SBOM generator {name} is {installed or 'not installed'}, stack.toml [sbom] pins {pinned}: "
                        f"the image would not be reproducible (pip install {name}=={pinned}, or `make venv`)",
                        SBOM_GENERATOR)
    return name, pinned


# --- inputs ---------------------------------------------------------------------------------------------------------

def parse_dpkg_status(text: str) -> list[dict[str, str]]:
    """Paragraphs of a dpkg status file (deb822), continuation lines folded."""
    out, cur, key = [], {}, None
    for line in text.splitlines():
        if not line.strip():
            if cur:
                out.append(cur)
            cur, key = {}, None
        elif line[0] in " \t" and key:
            cur[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            cur[key] = value.strip()
    if cur:
        out.append(cur)
    return out


def installed_debs(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """(package, architecture) -> paragraph, for packages whose status is `install ok installed`."""
    debs = {}
    for p in parse_dpkg_status(text):
        if p.get("Status", "").split()[-1:] == ["installed"] and "Package" in p:
            debs[(p["Package"], p.get("Architecture", "all"))] = p
    return debs


def parse_os_release(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip().strip('"')
    return out


def dists_from_files(files: dict[str, bytes]) -> dict[str, dict]:
    """canonical name -> {name, version, path} from `.../*.dist-info/METADATA` contents (Debian's dirs skipped)."""
    dists = {}
    for path in sorted(files):
        if not path.endswith(".dist-info/METADATA") or path.startswith(DEBIAN_PYTHON_DIRS):
            continue
        msg = email.parser.BytesHeaderParser().parsebytes(files[path])
        name, version = msg.get("Name"), msg.get("Version")
        if name and version:
            dists.setdefault(canonical(name), {"name": name, "version": version,
                                               "path": path.rsplit("/", 2)[0]})
    return dists


# --- building --------------------------------------------------------------------------------------------------------

@cache
def _cdx() -> SimpleNamespace:
    """cyclonedx-python-lib's classes (and packageurl's, which comes with it)."""
    # cyclonedx-python-lib is heavy and only needed where an SBOM is made or checked.
    from cyclonedx.model import HashAlgorithm, HashType, Property
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentScope, ComponentType
    from cyclonedx.model.tool import ToolRepository
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    return SimpleNamespace(HashAlgorithm=HashAlgorithm, HashType=HashType, Property=Property, Bom=Bom,
                           BomMetaData=BomMetaData, Component=Component, ComponentScope=ComponentScope,
                           ComponentType=ComponentType, ToolRepository=ToolRepository, JsonV1Dot6=JsonV1Dot6,
                           PackageURL=PackageURL)


def _props(d: dict) -> list:
    return [_cdx().Property(name=PROP + k, value=str(v)) for k, v in sorted(d.items()) if v not in (None, "")]


def _sha(hexes) -> list:
    cdx = _cdx()
    return [cdx.HashType(alg=cdx.HashAlgorithm.SHA_256, content=h) for h in sorted(set(hexes))]


def build_sbom(*, name: str, version: str, epoch: int, dpkg_status: str | None = None, os_release: str | None = None,
               dists: dict[str, dict] | None = None, pins: dict[str, Pin] | None = None,
               wheels: dict[str, tuple[str, str]] | None = None, build_info: dict | None = None,
               build_info_sha256: str | None = None, ucxx_info: dict | None = None, ucx_repository: str | None = None,
               properties: dict[str, str] | None = None, tools: dict[str, str] | None = None) -> bytes:
    """The SBOM as bytes (JSON + newline). See the module docstring for what goes in. `ucx_repository`: UCX's git
    repository (stack.toml [conda.about].ucx_dev_url), for the purl's vcs_url."""
    cdx = _cdx()
    components = _debian_components(os_release, dpkg_status)
    components += _python_components(dists or {}, pins or {}, wheels or {}, ucxx_info or {})
    if build_info:
        components += _ucx_components(build_info, build_info_sha256, ucx_repository)

    root = cdx.Component(type=cdx.ComponentType.CONTAINER, name=name, version=version, bom_ref=f"image:{name}",
                         properties=_props(properties or {}))

    created = datetime.fromtimestamp(epoch, timezone.utc)

    def render(serial: uuid.UUID) -> str:
        bom = cdx.Bom(components=components, serial_number=serial,
                      metadata=cdx.BomMetaData(component=root, timestamp=created, tools=cdx.ToolRepository(
                          components=[cdx.Component(type=cdx.ComponentType.APPLICATION, name=n, version=v,
                                                    bom_ref=f"tool:{n}") for n, v in sorted((tools or {}).items())]),
                          properties=_props({"source-date-epoch": epoch})))
        bom.register_dependency(root, [c for c in components if c.scope != cdx.ComponentScope.EXCLUDED])
        return cdx.JsonV1Dot6(bom).output_as_string(indent=2)

    draft = render(uuid.UUID(int=0))
    serial = uuid.uuid5(SERIAL_NAMESPACE, hashlib.sha256(draft.encode()).hexdigest())
    return (render(serial) + "\n").encode()


def _debian_components(os_release: str | None, dpkg_status: str | None) -> list:
    """The operating system and every installed Debian package."""
    cdx = _cdx()
    components = []
    osr = parse_os_release(os_release or "")
    distro = f"{osr.get('ID', 'debian')}-{osr['VERSION_ID']}" if osr.get("VERSION_ID") else None
    if osr:
        components.append(cdx.Component(type=cdx.ComponentType.OPERATING_SYSTEM, name=osr.get("ID", "debian"),
                                        version=osr.get("VERSION_ID"), description=osr.get("PRETTY_NAME"),
                                        bom_ref=f"os:{osr.get('ID', 'debian')}"))
    for (pkg, arch), p in sorted(installed_debs(dpkg_status or "").items()):
        quals = {"arch": arch, **({"distro": distro} if distro else {})}
        purl = cdx.PackageURL(type="deb", namespace="debian", name=pkg, version=p.get("Version"), qualifiers=quals)
        src = p.get("Source", "").split(" ")[0] or None
        components.append(cdx.Component(type=cdx.ComponentType.LIBRARY, name=pkg, version=p.get("Version"),
                                        purl=purl, bom_ref=purl.to_string(),
                                        properties=_props({"deb:source": src, "deb:arch": arch})))
    return components


def _python_components(dists: dict[str, dict], pins: dict[str, Pin], wheels: dict[str, tuple[str, str]],
                       ucxx_info: dict) -> list:
    """Every Python distribution, with the hash of the wheel it came from (else the lock's hashes of its pin)."""
    cdx = _cdx()
    components = []
    built = {canonical(p["name"]): p for p in ucxx_info.get("packages", [])}
    ucxx_src = (ucxx_info.get("sources") or {}).get("UCXX") or {}
    for cname, d in sorted(dists.items()):
        purl = cdx.PackageURL(type="pypi", name=cname, version=d["version"])
        pin = pins.get(cname)
        if cname in built and built[cname]["version"] == d["version"]:
            hashes, wheel = [built[cname]["sha256"]], built[cname]["wheel"]
        elif cname in wheels:
            hashes, wheel = [wheels[cname][1]], wheels[cname][0]
        else:
            hashes, wheel = (pin.hashes if pin and pin.version == d["version"] else []), None
        extra = {}
        if cname in built:
            extra = {"python:built-from-source": f"{ucxx_src.get('tag')} {ucxx_src.get('commit')}",
                     "python:source-content-tree": ucxx_src.get("content_tree"),
                     "python:cmake-args": " ".join([*ucxx_info.get("cmake_args", []),
                                                    *built[cname].get("cmake_args", [])]),
                     "python:built-against-ucx": (ucxx_info.get("ucx") or {}).get("version")}
        components.append(cdx.Component(type=cdx.ComponentType.LIBRARY, name=d["name"], version=d["version"],
                                        purl=purl, bom_ref=purl.to_string(), hashes=_sha(hashes),
                                        properties=_props({"python:wheel": wheel, "python:location": "/" + d["path"],
                                                           "python:in-lock": "true" if pin else "false", **extra})))
    return components


def _ucx_components(info: dict, info_sha: str | None, repository: str | None) -> list:
    """UCX as built, and the CUDA wheels/debs it was compiled against (scope excluded)."""
    cdx = _cdx()
    src = info.get("source") or {}
    conf = info.get("configure") or {}
    quals = {}
    if src.get("url"):
        quals["download_url"] = src["url"]
    if src.get("sha256"):
        quals["checksum"] = f"sha256:{src['sha256']}"
    if src.get("tag") and repository:
        quals["vcs_url"] = f"git+{repository}@{src['tag']}"
    purl = cdx.PackageURL(type="generic", name="ucx", version=info.get("ucx_version"), qualifiers=quals)
    caps = info.get("capabilities") or {}
    ucx = cdx.Component(type=cdx.ComponentType.LIBRARY, name="ucx", version=info.get("ucx_version"), purl=purl,
                        bom_ref="ucx", hashes=_sha([src["sha256"]] if src.get("sha256") else []),
                        description="UCX built from source by ucx-src-build (ucx-dask-gpu)",
                        properties=_props({
                            "ucx:source-archive": src.get("archive"),
                            "ucx:source-url": src.get("url"),
                            "ucx:source-tag": src.get("tag"),
                            "ucx:source-commit": src.get("commit"),
                            "ucx:source-content-tree": src.get("content_tree"),
                            "ucx:configure": conf.get("command"),
                            "ucx:modules": " ".join(info.get("modules") or []),
                            "ucx:patches": " ".join(p if isinstance(p, str) else p.get("name", str(p))
                                                    for p in info.get("patches") or []),
                            "ucx:prefix": info.get("build_prefix"),
                            "ucx:compiler": info.get("compiler"),
                            "ucx:build-info.sha256": info_sha,
                        }))
    out = [ucx]
    cuda = caps.get("cuda") or {}
    for inp in cuda.get("inputs") or []:
        kind = inp.get("kind")
        purl = (cdx.PackageURL(type="pypi", name=canonical(inp["name"]), version=inp.get("version"))
                if kind == "wheel" else
                cdx.PackageURL(type="deb", namespace="debian", name=inp["name"], version=inp.get("version"),
                               qualifiers={"arch": "amd64"}))
        out.append(cdx.Component(type=cdx.ComponentType.LIBRARY, name=inp["name"], version=inp.get("version"),
                                 purl=purl, bom_ref=f"build:{purl.to_string()}", scope=cdx.ComponentScope.EXCLUDED,
                                 hashes=_sha([inp["sha256"]] if inp.get("sha256") else []),
                                 properties=_props({"build-input-of": "ucx", "build-input-kind": kind})))
    return out


def sbom_from_overlay(st: Stack, files: dict[str, bytes], labels: dict[str, str],
                      wheels: dict[str, tuple[str, str]] | None = None) -> bytes:
    """The SBOM of an image from the files the normaliser collected out of its layers (`layer.Overlay`)."""
    gen, gen_version = generator(st)
    info, raw = _record_in_image(files, BUILD_INFO)
    ucxx_info, _ = _record_in_image(files, INSTALLED_UCXX_BUILD_INFO)
    keep = {"revision": "org.opencontainers.image.revision", "source": "org.opencontainers.image.source",
            "stack-id": LABEL_PREFIX + "stack-id"}
    return build_sbom(
        name=st.image.name, version=st.version, epoch=st.source_date_epoch,
        dpkg_status=files.get("var/lib/dpkg/status", b"").decode("utf-8", "replace"),
        os_release=files.get("usr/lib/os-release", b"").decode("utf-8", "replace"),
        dists=dists_from_files(files), pins=load_lock(st.lock_path()), wheels=wheels, build_info=info,
        build_info_sha256=hashlib.sha256(raw).hexdigest() if raw else None, ucxx_info=ucxx_info,
        ucx_repository=st.conda.about.ucx_dev_url,
        tools={gen: gen_version, st.name: st.version},
        properties={short: labels[long] for short, long in keep.items() if labels.get(long)})


def _record_in_image(files: dict[str, bytes], record: Path) -> tuple[dict | None, bytes | None]:
    """One of our build infos (`.../<record>`) as the image holds it: (parsed, its bytes), (None, None) if absent."""
    paths = sorted(p for p in files if p.endswith(f"/{record}"))
    if not paths:
        return None, None
    try:
        return json.loads(files[paths[0]]), files[paths[0]]
    except ValueError:
        raise UserError(f"/{paths[0]} in the image is not JSON", SBOM_MISMATCH) from None


# --- checking --------------------------------------------------------------------------------------------------------

def validate(text: str) -> str | None:
    """None when `text` is valid CycloneDX 1.6 JSON (strict schema), else the validator's first error."""
    # cyclonedx-python-lib is heavy and only needed where an SBOM is made or checked.
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    err = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    return None if err is None else str(getattr(err, "data", err)).splitlines()[0][:300]


def check_sbom(doc: dict, *, pins: dict[str, Pin] | None = None, dpkg_status: str | None = None,
               build_info: dict | None = None, ucxx_info: dict | None = None,
               extra_dists: set[str] = frozenset()) -> list[str]:
    """Problems where the SBOM disagrees with the lock, the dpkg status, the UCX build info or the UCXX build info
    (empty: agrees). Our UCXX wheels are the PyPI components the lock may lack, each with its built wheel's sha256."""
    pypi: dict[str, tuple[str, set[str]]] = {}
    debs: dict[tuple[str, str], str] = {}
    by_name: dict[str, dict] = {}
    for c in doc.get("components", []):
        by_name.setdefault(c.get("name"), c)
        if c.get("scope") == "excluded" or not c.get("purl"):
            continue
        p = _cdx().PackageURL.from_string(c["purl"])
        hashes = {h["content"] for h in c.get("hashes", []) if h.get("alg") == "SHA-256"}
        if p.type == "pypi":
            pypi[canonical(p.name)] = (p.version, hashes)
        elif p.type == "deb":
            debs[(p.name, (p.qualifiers or {}).get("arch", ""))] = p.version
    problems: list[str] = []
    if pins is not None:
        problems += _pypi_problems(pypi, pins, ucxx_info or {}, extra_dists)
    if dpkg_status is not None:
        problems += _deb_problems(debs, {k: v["Version"] for k, v in installed_debs(dpkg_status).items()})
    if build_info is not None:
        problems += _ucx_problems(by_name.get("ucx"), build_info)
    return problems


def _pypi_problems(pypi: dict[str, tuple[str, set[str]]], pins: dict[str, Pin], ucxx_info: dict,
                   extra_dists: set[str]) -> list[str]:
    problems = []
    for name, pin in sorted(pins.items()):
        if name not in pypi:
            problems.append(f"lock pin {name}=={pin.version} is not in the SBOM")
            continue
        ver, hashes = pypi[name]
        if ver != pin.version:
            problems.append(f"{name}: SBOM has {ver}, the lock pins {pin.version}")
        if not hashes:
            problems.append(f"{name}: no sha256 in the SBOM")
        elif not hashes <= set(pin.hashes):
            problems.append(f"{name}: SBOM hash {sorted(hashes - set(pin.hashes))[0]} is not one the lock allows")
    built = {canonical(p["name"]): p for p in ucxx_info.get("packages", [])}
    for name, p in sorted(built.items()):
        if name not in pypi:
            problems.append(f"{name}=={p['version']} (built from source) is not in the SBOM")
        elif pypi[name] != (p["version"], {p["sha256"]}):
            problems.append(f"{name}: SBOM has {pypi[name][0]} {sorted(pypi[name][1])}, the UCXX build made "
                            f"{p['version']} sha256 {p['sha256']}")
    for name in sorted(set(pypi) - set(pins) - set(extra_dists) - set(built)):
        problems.append(f"{name}=={pypi[name][0]} is in the SBOM but not in the lock")
    return problems


def _deb_problems(debs: dict[tuple[str, str], str], want: dict[tuple[str, str], str]) -> list[str]:
    problems = [f"deb {k[0]}:{k[1]} {want[k]} is installed but not in the SBOM" for k in sorted(set(want) - set(debs))]
    problems += [f"deb {k[0]}:{k[1]} {debs[k]} is in the SBOM but not installed" for k in sorted(set(debs) - set(want))]
    problems += [f"deb {k[0]}:{k[1]}: SBOM has {debs[k]}, dpkg has {want[k]}"
                 for k in sorted(set(want) & set(debs)) if want[k] != debs[k]]
    return problems


def _ucx_problems(c: dict | None, build_info: dict) -> list[str]:
    if c is None:
        return ["UCX is not in the SBOM"]
    problems = []
    props = {p["name"]: p["value"] for p in c.get("properties", [])}
    src = build_info.get("source") or {}
    if c.get("version") != build_info.get("ucx_version"):
        problems.append(f"ucx: SBOM has {c.get('version')}, the build info {build_info.get('ucx_version')}")
    if {h["content"] for h in c.get("hashes", [])} != {src.get("sha256")}:
        problems.append(f"ucx: SBOM source hash differs from the build info's {src.get('sha256')}")
    if props.get(PROP + "ucx:configure") != (build_info.get("configure") or {}).get("command"):
        problems.append("ucx: SBOM configure line differs from the build info's")
    return problems

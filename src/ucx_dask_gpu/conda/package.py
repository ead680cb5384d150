"""Write a built package's info/ metadata and pack it as a real `.conda` archive (conda-package-handling).

info/ as conda-build writes it: index.json, paths.json (paths_version 1: sha256, size, prefix placeholder and file
mode per path), files, has_prefix, about.json, run_exports.json, link.json (noarch python entry points), hash_input.json,
licenses/, recipe/ (the rendered meta.yaml, the original as meta.yaml.template, the build script, the variant used) and
test/ (run_test.sh with the recipe's test commands, test_time_dependencies.json).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from ..errors import PACKAGE_INVALID, UserError
from ..fsutil import sha256_file
from .build import BuiltPackage
from .render import PLATFORM

INFO_PAYLOAD_CONFLICT = "info/"


def _dump(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def index_json(pkg: BuiltPackage, timestamp_ms: int) -> dict:
    r = pkg.rendered
    about = r.meta.get("about") or {}
    data = {
        "name": r.name,
        "version": r.version,
        "build": r.build_string,
        "build_number": r.build_number,
        "depends": list(pkg.depends),
        "constrains": list(pkg.constrains),
        "license": str(about.get("license", "")),
        "license_family": str(about.get("license_family", "")),
        "subdir": r.subdir,
        "timestamp": timestamp_ms,
    }
    if r.noarch:
        data["noarch"] = str(r.noarch)
    else:
        data.update(platform=PLATFORM.split("-")[0], arch="x86_64")
    return data


def paths_json(pkg: BuiltPackage) -> dict:
    entries = []
    for rel in pkg.files:
        p = pkg.root / rel
        if p.is_symlink():
            target = p.resolve()
            inside = target.is_file() and str(target).startswith(str(pkg.root.resolve()) + os.sep)
            entry = {"_path": rel, "path_type": "softlink",
                     "sha256": sha256_file(target) if inside else "",
                     "size_in_bytes": target.stat().st_size if inside else 0}
        else:
            entry = {"_path": rel, "path_type": "hardlink", "sha256": sha256_file(p), "size_in_bytes": p.stat().st_size}
        mode = pkg.prefix_files.get(rel)
        if mode:
            entry.update(file_mode=mode, prefix_placeholder=str(pkg.prefix))
        entries.append(entry)
    return {"paths": entries, "paths_version": 1}


def run_test_sh(pkg: BuiltPackage) -> str | None:
    test = pkg.rendered.meta.get("test") or {}
    cmds = [str(c) for c in test.get("commands") or []]
    imports = [str(i) for i in test.get("imports") or []]
    if not cmds and not imports:
        return None
    lines = ["#!/bin/bash", "# The recipe's test: imports and commands, as conda-build runs them (set -ex).", "set -ex"]
    lines += [f'"${{PYTHON:-python}}" -c "import {mod}"' for mod in imports]
    lines += cmds
    return "\n".join(lines) + "\n"


def write_info(pkg: BuiltPackage, info: Path, timestamp_ms: int, variant_config_text: str) -> list[str]:
    """Write info/ next to the payload; returns the info paths relative to the package root."""
    r = pkg.rendered
    if any(f.startswith(INFO_PAYLOAD_CONFLICT) for f in pkg.files):
        raise UserError(f"{r.name}: the build installed files under info/, which conda reserves", PACKAGE_INVALID)
    if info.exists():
        shutil.rmtree(info)
    info.mkdir(parents=True)
    about = dict(r.meta.get("about") or {})
    about.update(channels=[], conda_build_version="n/a (conda-build contract emulated by ucx-dask-gpu)",
                 extra={**(r.meta.get("extra") or {}), "built_by": pkg.extra})
    _dump(info / "index.json", index_json(pkg, timestamp_ms))
    _dump(info / "paths.json", paths_json(pkg))
    _dump(info / "about.json", about)
    _dump(info / "hash_input.json", r.variant)
    (info / "files").write_text("".join(f + "\n" for f in pkg.files))
    if pkg.prefix_files:
        (info / "has_prefix").write_text("".join(f"{pkg.prefix} {mode} {rel}\n"
                                                 for rel, mode in sorted(pkg.prefix_files.items())))
    exports = [str(x) for x in r.build.get("run_exports") or []]
    if exports:
        _dump(info / "run_exports.json", {"weak": exports})
    if r.noarch == "python":
        _dump(info / "link.json", {"noarch": {"type": "python",
                                              "entry_points": [str(e) for e in r.build.get("entry_points") or []]},
                                   "package_metadata_version": 1})
    for lf in pkg.license_files:
        dest = info / "licenses" / lf.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lf, dest)
    recipe = info / "recipe"
    recipe.mkdir()
    for f in sorted(r.recipe_dir.iterdir()):
        if f.is_file():
            shutil.copy2(f, recipe / ("meta.yaml.template" if f.name == "meta.yaml" else f.name))
    (recipe / "meta.yaml").write_text(r.text)
    (recipe / "conda_build_config.yaml").write_text(
        yaml.safe_dump({k: [v] for k, v in r.variant.items()}, sort_keys=True) if r.variant else "{}\n")
    (recipe / "conda_build_config.full.yaml").write_text(variant_config_text)
    test_sh = run_test_sh(pkg)
    if test_sh:
        (info / "test").mkdir()
        (info / "test" / "run_test.sh").write_text(test_sh)
        _dump(info / "test" / "test_time_dependencies.json",
              [str(x) for x in (r.meta.get("test") or {}).get("requires") or []])
    return sorted(str(p.relative_to(info.parent)) for p in info.rglob("*") if p.is_file())


def pack(pkg: BuiltPackage, out_dir: Path, timestamp_ms: int, variant_config_text: str) -> Path:
    """Write info/ into the payload root and create <out_dir>/<subdir>/<dist>.conda."""
    import conda_package_handling.api as cph

    info_files = write_info(pkg, pkg.root / "info", timestamp_ms, variant_config_text)
    subdir = out_dir / pkg.rendered.subdir
    subdir.mkdir(parents=True, exist_ok=True)
    fn = f"{pkg.rendered.dist}.conda"
    cph.create(str(pkg.root), info_files + pkg.files, fn, out_folder=str(subdir))
    out = subdir / fn
    if not out.is_file():
        raise UserError(f"conda-package-handling did not write {out}", PACKAGE_INVALID)
    return out

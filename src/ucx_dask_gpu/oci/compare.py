"""Two normalised build outputs side by side: the same image id and archive bytes, or the first differing files
per layer and the differing config keys. Reads the image.json and layers.json a normalisation writes; no Docker."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BAD_ARCHIVE, USAGE, UserError
from . import tarnorm

# What a normalisation writes next to the image (image/normalise.py) and `compare` reads.
IMAGE_JSON = "image.json"
LAYERS_JSON = "layers.json"

FIELDS = ("type", "mode", "owner", "mtime", "size", "content", "xattrs")


def _load_dir(d: Path) -> tuple[dict, dict]:
    try:
        image = json.loads((d / IMAGE_JSON).read_text())
        layers = json.loads((d / LAYERS_JSON).read_text())
    except OSError as e:
        raise UserError(f"{d}: not a normalised build output ({e.filename}: {e.strerror})", USAGE) from None
    except ValueError as e:
        raise UserError(f"{d}: unreadable {IMAGE_JSON}/{LAYERS_JSON} ({e})", BAD_ARCHIVE) from None
    return image, layers


def _flatten(obj, prefix="") -> dict[str, str]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    if isinstance(obj, list) and prefix.endswith(("history", "diff_ids")):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: json.dumps(obj, sort_keys=True)}


def diff_layers(a: list, b: list, limit: int = 10) -> dict:
    """First differing paths between two layer listings (lists of Entry.as_list())."""
    ma = {e[0]: e for e in a}
    mb = {e[0]: e for e in b}
    out = {"only_a": [], "only_b": [], "differ": []}
    for p in sorted(set(ma) | set(mb), key=tarnorm.sort_key):
        if p not in mb:
            out["only_a"].append(p)
        elif p not in ma:
            out["only_b"].append(p)
        elif ma[p] != mb[p]:
            fields = [f for f, x, y in zip(FIELDS, ma[p][1:], mb[p][1:]) if x != y]
            out["differ"].append({"path": p, "fields": fields, "a": ma[p][1:], "b": mb[p][1:]})
    return {k: v[:limit] for k, v in out.items()} | {f"n_{k}": len(v) for k, v in out.items()}


def compare(a_dir: Path, b_dir: Path, limit: int = 10) -> dict:
    ia, la = _load_dir(a_dir)
    ib, lb = _load_dir(b_dir)
    report = {"a": {"dir": str(a_dir), "image_id": ia["image_id"], "archive_sha256": ia["archive_sha256"]},
              "b": {"dir": str(b_dir), "image_id": ib["image_id"], "archive_sha256": ib["archive_sha256"]},
              "identical": ia["image_id"] == ib["image_id"] and ia["archive_sha256"] == ib["archive_sha256"],
              "config": [], "layers": []}
    fa, fb = _flatten(la["config"]), _flatten(lb["config"])
    report["config"] = [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb))
                        if fa.get(k) != fb.get(k) and not k.startswith("rootfs.diff_ids")]
    for i in range(max(len(la["layers"]), len(lb["layers"]))):
        x = la["layers"][i] if i < len(la["layers"]) else None
        y = lb["layers"][i] if i < len(lb["layers"]) else None
        if x and y and x["diff_id"] == y["diff_id"]:
            continue
        entry = {"layer": i, "a": x and x["diff_id"], "b": y and y["diff_id"]}
        if x and y:
            entry.update(diff_layers(x["entries"], y["entries"], limit))
        report["layers"].append(entry)
    return report


def render_compare(r: dict) -> str:
    lines = [f"A {r['a']['image_id']}  archive sha256 {r['a']['archive_sha256']}  ({r['a']['dir']})",
             f"B {r['b']['image_id']}  archive sha256 {r['b']['archive_sha256']}  ({r['b']['dir']})"]
    if r["identical"]:
        lines.append("identical: same image id, same archive bytes")
        return "\n".join(lines)
    for c in r["config"]:
        lines.append(f"config {c['key']}: {c['a']} != {c['b']}")
    for layer in r["layers"]:
        lines.append(f"layer {layer['layer']}: {layer['a']} != {layer['b']}")
        if "differ" not in layer:
            continue
        lines.append(f"  {layer['n_differ']} differing, {layer['n_only_a']} only in A, {layer['n_only_b']} only in B")
        for d in layer["differ"]:
            detail = "; ".join(f"{f}: {x} != {y}" for f, x, y in zip(FIELDS, d["a"], d["b"]) if x != y)
            lines.append(f"  differs {d['path']}  ({detail})")
        lines += [f"  only A  {p}" for p in layer["only_a"]] + [f"  only B  {p}" for p in layer["only_b"]]
    return "\n".join(lines)

"""Reports shared by every tool: a text table for stdout, and JSON + markdown + PNG + command.txt written together.

A report set is rendered fully in memory first and then renamed into place, so a failure never leaves half a report;
when the directory cannot take it, the report is kept elsewhere and the one line says where (exit 18).
"""
from __future__ import annotations

import io
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .fsutil import write_output_dir

Cell = object


def _fmt(cell: Cell) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, float):
        return f"{cell:.3g}" if abs(cell) < 100 else f"{cell:.1f}"
    return str(cell)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """Aligned plain-text table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and rows for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def heatmap_png(matrix: Sequence[Sequence[float | None]], row_labels: Sequence[str], col_labels: Sequence[str],
                title: str, unit: str, xlabel: str = "destination", ylabel: str = "source") -> bytes:
    """Annotated heatmap as PNG bytes (matplotlib, Agg backend). None cells are drawn blank."""
    import matplotlib  # heavy: only where a PNG is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)
    size = max(3.5, 0.9 * max(len(col_labels), 2) + 2)
    fig, ax = plt.subplots(figsize=(size, size * 0.85), dpi=120)
    im = ax.imshow(np.ma.masked_invalid(data), cmap="viridis")
    ax.set_xticks(range(len(col_labels)), labels=list(col_labels))
    ax.set_yticks(range(len(row_labels)), labels=list(row_labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    finite = data[np.isfinite(data)]
    mid = (finite.max() + finite.min()) / 2 if finite.size else 0
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            if np.isfinite(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.0f}", ha="center", va="center",
                        color="black" if data[i, j] > mid else "white", fontsize=8)
    fig.colorbar(im, ax=ax, label=unit, shrink=0.8)
    fig.tight_layout()
    buf = io.BytesIO()
    # Fixed metadata keeps the bytes identical for identical data.
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def command_line(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(("__main__.py", "/ucx-dask-gpu")):
        argv[0] = "ucx-dask-gpu"
    return shlex.join(argv)


def write_report(outdir: str | Path, stem: str, payload: dict, markdown: str, png: bytes | None = None,
                 command: str | None = None) -> list[Path]:
    """Write <stem>.json, <stem>.md, <stem>.png (if given) and command.txt into outdir, all or nothing; nothing else
    in outdir is touched."""
    files: dict[str, bytes | str] = {
        f"{stem}.json": json.dumps(payload, indent=2, sort_keys=False) + "\n",
        f"{stem}.md": markdown.rstrip() + "\n",
    }
    if png is not None:
        files[f"{stem}.png"] = png
    if command is not None:
        files["command.txt"] = command.rstrip() + "\n"
    return write_output_dir(outdir, files, what="the report")

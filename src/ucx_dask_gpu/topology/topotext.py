"""`nvidia-smi topo -m` text -> Topology: for hosts without NVML access, plans for another host, and tests."""
from __future__ import annotations

import itertools
import re
import sys

from ..errors import BAD_TOPOLOGY, NO_GPU, UserError
from .model import (ANSI_RE, IPOIB_NAME_RE, LEVEL_ALIASES, NV_RE, PCI_LEVELS, RDMA_NAME_RE, TRAILING_COLUMNS, GpuInfo,
                    NicInfo, Topology, parse_cpulist)


# --- nvidia-smi topo -m text -------------------------------------------------------------------------------------

def _norm_level(cell: str) -> str | None:
    cell = LEVEL_ALIASES.get(cell, cell)
    if cell == "X" or cell in PCI_LEVELS or NV_RE.match(cell):
        return cell
    return None


def _classify_nic(name: str) -> NicInfo:
    if RDMA_NAME_RE.match(name):
        return NicInfo(name=name, kind="ib", rdma_device=name)
    if IPOIB_NAME_RE.match(name):
        return NicInfo(name=name, kind="ib", netdev=name)
    return NicInfo(name=name, kind="eth", netdev=name)


def _split_header(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")][1:]
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def _split_row(line: str, ndev: int) -> tuple[str, list[str], list[str]]:
    """(label, device cells, trailing cells)."""
    if "\t" in line:
        cells = [c.strip() for c in line.split("\t")]
        return cells[0], cells[1:1 + ndev], cells[1 + ndev:]
    toks = line.split()
    return toks[0], toks[1:1 + ndev], toks[1 + ndev:]


def parse_topo_text(text: str, source: str = "nvidia-smi topo -m") -> Topology:
    """Parse `nvidia-smi topo -m` output (tab-separated as printed, or space-aligned as pasted). Handles the GPU x GPU
    matrix (X, NV#, PIX, PXB, PHB, NODE, SYS; SOC from old drivers), NIC columns and rows (mlx5_N / ibN / NICn with the
    "NIC Legend" block), the CPU Affinity / NUMA Affinity / GPU NUMA ID columns, a separate "CPU Affinity" block (as
    some listings print it), and ANSI escapes in the header. Raises UserError(BAD_TOPOLOGY) naming the line for anything
    it cannot read, UserError(NO_GPU) when no GPU row."""
    def bad(msg: str):
        return UserError(f"{source}: {msg}", BAD_TOPOLOGY)

    legend, body = _split_legend([ANSI_RE.sub("", ln).rstrip("\r\n") for ln in text.splitlines()])
    blocks = _blocks(body)
    if not blocks:
        raise UserError(f"{source}: no topology matrix found", BAD_TOPOLOGY)
    devices, matrix, trailing = _read_blocks(blocks, bad)
    if devices is None:
        raise bad("no device columns (GPU0, GPU1, ...) in the header")
    gpu_labels = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    if not gpu_labels:
        raise UserError(f"{source}: no GPU in the topology (columns: {', '.join(devices)})", NO_GPU)
    _check_matrix(devices, gpu_labels, matrix, trailing, bad)
    return _topology(source, devices, gpu_labels, matrix, trailing, legend, bad)


def _split_legend(lines: list[str]) -> tuple[dict[str, str], list[str]]:
    """(NIC legend: NICn -> device name, the lines before the legend)."""
    # The matrix (and, in some listings, a separate CPU Affinity block) comes first; "Legend:" and
    # "NIC Legend:" (NIC0: mlx5_0, ...) close the listing.
    legend: dict[str, str] = {}
    body: list[str] = []
    in_legend = False
    for ln in lines:
        s = ln.strip()
        if s in ("Legend:", "NIC Legend:"):
            in_legend = True
        elif in_legend:
            m = re.match(r"^(NIC\d+):\s*(\S+)$", s)
            if m:
                legend[m.group(1)] = m.group(2)
        elif not (s.startswith("$") or "nvidia-smi" in s):   # the command line / prompt in pasted listings
            body.append(ln)
    return legend, body


def _blocks(body: list[str]) -> list[list[str]]:
    """Blocks separated by blank lines; each starts with a header line (first cell empty, i.e. indented)."""
    return [list(block) for text, block in itertools.groupby(body, key=lambda ln: bool(ln.strip())) if text]


def _read_blocks(blocks: list[list[str]], bad):
    """(device columns or None, label -> column -> level, label -> trailing column -> value)."""
    devices: list[str] | None = None
    matrix: dict[str, dict[str, str]] = {}
    trailing: dict[str, dict[str, str]] = {}
    for block in blocks:
        header_line = block[0]
        if not header_line[:1].isspace():
            raise bad(f"expected a header line (starting with a tab or spaces), got {header_line.strip()!r}")
        header = _split_header(header_line)
        if not header:
            raise bad("empty header line")
        devcols = [h for h in header if h not in TRAILING_COLUMNS]
        trailcols = [h for h in header if h in TRAILING_COLUMNS]
        if header[:len(devcols)] != devcols:
            raise bad(f"device columns must come before {', '.join(trailcols)}: {header}")
        if devcols:
            if devices is not None:
                raise bad("two device matrices in one listing")
            devices = devcols
        for row in block[1:]:
            label, cells, trail = _split_row(row, len(devcols))
            if len(cells) != len(devcols):
                raise bad(f"row {label!r} has {len(cells)} matrix cells, the header names {len(devcols)}")
            if devcols:
                matrix[label] = _row_levels(label, devcols, cells, bad)
            # nvidia-smi prints an extra tab after the NUMA Affinity value: drop surplus empty cells.
            while len(trail) > len(trailcols) and "" in trail[1:]:
                trail.pop(trail.index("", 1))
            if len(trail) > len(trailcols):
                raise bad(f"row {label!r} has {len(trail)} cells after the matrix, the header names {trailcols}")
            trailing.setdefault(label, {}).update(
                {col: val for col, val in zip(trailcols, trail) if val and val != "N/A"})
    return devices, matrix, trailing


def _row_levels(label: str, devcols: list[str], cells: list[str], bad) -> dict[str, str]:
    """One matrix row: column -> connection level, X on the diagonal only."""
    if label not in devcols:
        raise bad(f"row {label!r} is not one of the columns {devcols}")
    levels = {}
    for col, cell in zip(devcols, cells):
        lvl = _norm_level(cell)
        if lvl is None:
            raise bad(f"row {label!r}, column {col!r}: unknown connection {cell!r}")
        if (lvl == "X") != (col == label):
            raise bad(f"row {label!r}, column {col!r}: {cell!r} (X belongs on the diagonal only)")
        levels[col] = lvl
    return levels


def _check_matrix(devices, gpu_labels, matrix, trailing, bad) -> None:
    """Every device has a row, GPU links are symmetric, affinity rows name known devices."""
    missing = [d for d in devices if d not in matrix]
    if missing:
        raise bad(f"no row for {', '.join(missing)}")
    for a in gpu_labels:
        for b in gpu_labels:
            if matrix[a][b] != matrix[b][a]:
                raise bad(f"{a}->{b} is {matrix[a][b]} but {b}->{a} is {matrix[b][a]}")
    unknown_trailing = [lbl for lbl in trailing if lbl not in devices]
    if unknown_trailing:
        raise bad(f"affinity rows for unknown devices {unknown_trailing}")


def _topology(source, devices, gpu_labels, matrix, trailing, legend, bad) -> Topology:
    topo = Topology(source=source, gpus=[])
    for lbl in gpu_labels:
        t = trailing.get(lbl, {})
        g = GpuInfo(index=int(lbl[3:]))
        try:
            if "CPU Affinity" in t:
                g.cpus, g.cpus_source = parse_cpulist(t["CPU Affinity"]), "topo-text"
            if "NUMA Affinity" in t:
                g.numa_nodes, g.numa_source = parse_cpulist(t["NUMA Affinity"]), "topo-text"
        except ValueError as e:
            raise bad(f"row {lbl!r}: {e}") from None
        topo.gpus.append(g)
    for a in gpu_labels:
        for b in gpu_labels:
            if a != b:
                topo.gpu_links[(int(a[3:]), int(b[3:]))] = matrix[a][b]
    for col in devices:
        if col in gpu_labels:
            continue
        name = legend.get(col, col)
        nic = _classify_nic(name)
        if nic.kind == "ib" and nic.rdma_device:
            nic.port = 1
        topo.nics.append(nic)
        for lbl in gpu_labels:
            topo.gpu_nic[(int(lbl[3:]), name)] = matrix[lbl][col]
    if any(n.rdma_device for n in topo.nics):
        topo.notes.append("RDMA port 1 assumed (topo -m text does not name ports)")
    return topo


# `nvidia-smi topo -m` of 8 GPUs and 8 NICs is ~3 kB; more than this is not such a listing, and is not read whole.
MAX_TOPO_BYTES = 1 << 20


def read_topo_file(path: str) -> Topology:
    """`path` ('-': stdin) read, at most MAX_TOPO_BYTES, and parsed; one line (BAD_TOPOLOGY) when it cannot be."""
    where = "stdin" if path == "-" else path
    try:
        if path == "-":
            if sys.stdin is None:  # started with fd 0 closed (`<&-`, a service without stdin)
                raise UserError("--from-topo -: stdin is closed (pipe `nvidia-smi topo -m` into it, or name a file)",
                                BAD_TOPOLOGY)
            data = sys.stdin.buffer.read(MAX_TOPO_BYTES + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_TOPO_BYTES + 1)
    except (OSError, ValueError) as e:  # ValueError: a stdin Python has closed
        raise UserError(f"cannot read {where}: {getattr(e, 'strerror', None) or e}", BAD_TOPOLOGY) from None
    if len(data) > MAX_TOPO_BYTES:
        raise UserError(f"{where}: more than {MAX_TOPO_BYTES} bytes, not `nvidia-smi topo -m` output", BAD_TOPOLOGY)
    source = "nvidia-smi topo -m (stdin)" if path == "-" else f"nvidia-smi topo -m text {path}"
    return parse_topo_text(data.decode(errors="replace"), source=source)

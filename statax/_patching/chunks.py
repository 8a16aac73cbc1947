"""How a sweep's patches go into chunks (one compiled shape: `size` patches each, the last of
a run of them padded). Without `reuse`, in order; with it, one site's a chunk, and where a
`scan` over layers stacks the site (`planting.loop_rows`), its patches in the order of its
rows, one row a chunk where a row's patches fill at least half of one: the rows before a
chunk's first patch are skipped, and a patch in a later row of the same chunk would run the
rows between for nothing."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["chunked", "size_of"]


def size_of(plan, batch_size: int, reuse: bool, sharded: bool, rows: dict | None) -> int:
    """The patches a chunk holds: `batch_size` (with a sharding, as asked: a multiple of its
    devices), at most the patches there are (of the largest site, with `reuse`), or the
    patches of one row where every site a scan stacks has that many and they fill at least
    half of a chunk."""
    counts = [math.prod(n) for _, n in plan.sizes]
    if sharded:
        return batch_size
    size = max(1, min(int(batch_size), max(counts) if reuse else sum(counts)))
    widths = {width for _, width in _row_axes(plan, rows or {}).values()}
    width = widths.pop() if len(widths) == 1 else 0
    return width if size / 2 <= width < size else size


def chunked(plan, size: int, reuse: bool, rows: dict | None) -> list[list[tuple[int, int]]]:
    """The chunks: each a list of `(site, flat index)`, `site` an index into `plan.keys`."""
    sizes = dict(plan.sizes)
    by_row = _row_axes(plan, rows or {})
    runs = []
    for s, key in enumerate(plan.keys):
        flat = range(math.prod(sizes[key]))
        if key in by_row:  # (a stable sort: the rows in turn, each in the order of the rest)
            at = by_row[key][0]
            flat = sorted(flat, key=lambda i, key=key: np.unravel_index(i, sizes[key])[at])
        runs.append([(s, int(i)) for i in flat])
    if not reuse:
        runs = [[p for run in runs for p in run]]
    return [run[start : start + size] for run in runs for start in range(0, len(run), size)]


def _row_axes(plan, rows: dict) -> dict:
    """`{key: (position among its patched axes, patches per row)}` of each site a scan stacks
    whose loop axis is patched (`rows`: `{key: (loop axis, value's axes)}`)."""
    out = {}
    for key, named in plan.axes:
        if key not in rows:
            continue
        axis, ndim = rows[key]
        positions = [n for n, (_, a) in enumerate(named) if a % ndim == axis]
        if positions:
            n = dict(plan.sizes)[key]
            out[key] = (positions[0], math.prod(n) // n[positions[0]])
    return out

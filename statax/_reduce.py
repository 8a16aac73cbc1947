"""Reductions: how the occurrences of a name saved with `save_inter(..., reduce=mode)` combine.

Every occurrence of a reduced name, wherever it is (straight-line call sites, loop iterations,
branches), folds into one *accumulator*, in program order:

* the elementwise modes (`"mean"`, `"sum"`, `"min"`, `"max"`, `"first"`, `"last"`) keep each
  array leaf beside a count of the same shape (how many occurrences reached each element), so
  that a branch not taken or a loop that never ran contributes nothing. Inside a `scan` or a
  `while_loop` they are a running value in the loop's carry: no per-iteration storage;
* `"stack"` keeps the occurrences stacked along an occurrence axis (after any batch axes);
* `"collect"` ravels each occurrence and concatenates them (learned_optimization's `collect`).
  Under `jit` their length is fixed when the program is traced, so an occurrence that did not
  run (a `cond` branch not taken) is a row (or run of elements) of zeros; each leaf keeps a
  boolean mask beside it, true where an occurrence ran (`pull(fn, ran=True)` returns it).

`finalize` turns an accumulator into the value `pull` returns. A name none of whose
occurrences ran gives zeros.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from . import _compat
from ._errors import ReduceMismatchError
from ._meta import StateMeta
from ._primitive import MODES

__all__ = [
    "ELEMENTWISE",
    "MODES",
    "across_shards",
    "combine",
    "finalize",
    "fold_axis",
    "identity",
    "merge",
    "ran",
    "running",
    "to_accumulator",
]

ELEMENTWISE = ("mean", "sum", "min", "max", "first", "last")


def to_accumulator(meta: StateMeta, leaves: Sequence) -> tuple[StateMeta, list]:
    """One occurrence's values as an accumulator."""
    if meta.accumulator:
        return meta, list(leaves)
    b = meta.batch_ndim
    if meta.reduce == "stack":
        acc = [jnp.expand_dims(x, b) for x in leaves]
        acc += [jnp.ones((*jnp.shape(x)[:b], 1), bool) for x in leaves]  # one per row
    elif meta.reduce == "collect":
        acc = [jnp.reshape(x, (*jnp.shape(x)[:b], -1)) for x in leaves]
        acc += [jnp.ones(jnp.shape(x), bool) for x in acc]  # one per element
    else:
        acc = [*leaves, *(jnp.ones(jnp.shape(x), jnp.int32) for x in leaves)]
    return dataclasses.replace(meta, accumulator=True), acc


def identity(meta: StateMeta, avals: Sequence) -> list:
    """The accumulator of no occurrence, with the leaves' avals (zeros, counts of zero, masks
    that are all false)."""
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


def _split(meta, leaves):
    n = meta.num_values
    return leaves[:n], leaves[n:]


def combine(meta_a: StateMeta, a: Sequence, meta_b: StateMeta, b: Sequence) -> list:
    """The accumulator of `a`'s occurrences followed by `b`'s (both accumulators)."""
    mode = meta_a.reduce
    if mode in ("stack", "collect"):
        ba, bb = meta_a.batch_ndim, meta_b.batch_ndim
        return [
            jnp.concatenate(_lead(x, ba, y, bb), axis=max(ba, bb))
            for x, y in zip(a, b, strict=True)
        ]
    (va, na), (vb, nb) = _split(meta_a, a), _split(meta_b, b)
    values, counts = [], []
    for x, m, y, n in zip(va, na, vb, nb, strict=True):
        if mode in ("sum", "mean"):
            v = x + y
        elif mode in ("min", "max"):
            both = jnp.minimum(x, y) if mode == "min" else jnp.maximum(x, y)
            v = jnp.where(n == 0, x, jnp.where(m == 0, y, both))
        elif mode == "first":
            v = jnp.where(m > 0, x, y)
        else:  # last
            v = jnp.where(n > 0, y, x)
        values.append(v)
        counts.append(m + n)
    return [*values, *counts]


def _lead(x, bx, y, by):
    """Broadcast the batch axes (the first `bx` of `x`, `by` of `y`) to each other."""
    batch = jnp.broadcast_shapes(jnp.shape(x)[:bx], jnp.shape(y)[:by])
    return (
        jnp.broadcast_to(x, (*batch, *jnp.shape(x)[bx:])),
        jnp.broadcast_to(y, (*batch, *jnp.shape(y)[by:])),
    )


def running(meta: StateMeta) -> bool:
    """Whether a loop keeps this intermediate as a running value in its carry."""
    return meta.accumulator and meta.reduce in ELEMENTWISE


def fold_axis(meta: StateMeta, leaves: Sequence, axis: int) -> list:
    """An accumulator with an extra axis at `axis` (one accumulator per index, in order: a
    scan's iterations, a shard_map's shards) folded into one."""
    if meta.reduce in ("stack", "collect"):  # merge it into the occurrence axis after it
        return [
            jnp.reshape(
                x, (*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])
            )
            for x in leaves
        ]
    size = jnp.shape(leaves[0])[axis]
    acc = [jnp.take(x, 0, axis=axis) for x in leaves]
    for i in range(1, size):
        acc = combine(meta, acc, meta, [jnp.take(x, i, axis=axis) for x in leaves])
    return acc


def across_shards(meta: StateMeta, leaves: Sequence, axes: tuple) -> list:
    """Inside a `shard_map`: the elementwise accumulator of all shards (the same on every
    shard), combined with collectives over the manual mesh `axes` in shard order."""
    # Collectives over several axes need values that vary over all of them.
    values, counts = _split(meta, [_compat.vary(x, axes) for x in leaves])
    total = [jax.lax.psum(n, axes) for n in counts]
    if meta.reduce in ("sum", "mean"):
        return [*(jax.lax.psum(v, axes) for v in values), *total]
    if meta.reduce in ("min", "max"):
        out = []
        for v, n in zip(values, counts, strict=True):
            info = (
                jnp.finfo(v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else jnp.iinfo(v.dtype)
            )
            if meta.reduce == "min":
                out.append(jax.lax.pmin(jnp.where(n > 0, v, info.max), axes))
            else:
                out.append(jax.lax.pmax(jnp.where(n > 0, v, info.min), axes))
        return [*out, *total]
    # first / last: the value of the first / last shard, in shard order, that has one.
    index = _compat.vary(jax.lax.axis_index(axes), axes)
    out = []
    for v, n in zip(values, counts, strict=True):
        if meta.reduce == "first":
            chosen = jax.lax.pmin(jnp.where(n > 0, index, jnp.iinfo(jnp.int32).max), axes)
        else:
            chosen = jax.lax.pmax(jnp.where(n > 0, index, -1), axes)
        out.append(jax.lax.psum(jnp.where(index == chosen, v, jnp.zeros_like(v)), axes))
    return [*out, *total]


def ran(meta: StateMeta, leaves: Sequence) -> list:
    """The masks of a `"stack"` or `"collect"` accumulator: per leaf, true where an occurrence
    ran (`"stack"`: shape `(*batch, occurrences)`; `"collect"`: the value's shape)."""
    return list(_split(meta, leaves)[1])


def finalize(meta: StateMeta, leaves: Sequence) -> list:
    """The values `pull` returns for an accumulator."""
    values, counts = _split(meta, leaves)
    if meta.reduce in ("stack", "collect"):
        return list(values)
    out = []
    for v, n in zip(values, counts, strict=True):
        if meta.reduce == "sum":
            out.append(v)
        elif meta.reduce == "mean":
            out.append(jnp.where(n > 0, v / jnp.maximum(n, 1), 0))
        else:
            out.append(jnp.where(n > 0, v, 0).astype(v.dtype))
    return out


def merge(metas: Sequence[StateMeta], leaves: Sequence) -> tuple[tuple[StateMeta, ...], list]:
    """Fold every reduced name's occurrences into one accumulator, at its first position.

    Unreduced intermediates pass through. Raises `ReduceMismatchError` where one name is saved
    with different `reduce` modes, or with values of different shapes or structures.
    """
    start, chunks = 0, []
    for meta in metas:
        chunks.append((meta, list(leaves[start : start + meta.num_arrays])))
        start += meta.num_arrays
    modes: dict[str, StateMeta] = {}
    out: list[list] = []  # [meta, leaves] in order of first appearance
    where: dict[str, int] = {}
    for meta, chunk in chunks:
        first = modes.setdefault(meta.name, meta)
        if first.reduce != meta.reduce:
            raise ReduceMismatchError(first, meta, "reduce modes")
        if meta.reduce is None:
            out.append([meta, chunk])
            continue
        meta, chunk = to_accumulator(meta, chunk)
        if meta.name not in where:
            where[meta.name] = len(out)
            out.append([meta, chunk])
            continue
        slot = out[where[meta.name]]
        if not _compatible(slot[0], slot[1], meta, chunk):
            raise ReduceMismatchError(slot[0], meta, "shapes or structures")
        merged_meta = dataclasses.replace(
            slot[0], batch_ndim=max(slot[0].batch_ndim, meta.batch_ndim)
        )
        slot[1] = combine(slot[0], slot[1], meta, chunk)
        slot[0] = merged_meta
    return tuple(m for m, _ in out), [x for _, chunk in out for x in chunk]


def _compatible(meta_a, a, meta_b, b) -> bool:
    if meta_a.treedef != meta_b.treedef or meta_a.static_leaves != meta_b.static_leaves:
        return False
    if meta_a.reduce in ("stack", "collect"):
        skip_a, skip_b = meta_a.batch_ndim + 1, meta_b.batch_ndim + 1
    else:
        skip_a, skip_b = meta_a.batch_ndim, meta_b.batch_ndim
    return (
        all(
            jnp.shape(x)[skip_a:] == jnp.shape(y)[skip_b:] and x.dtype == y.dtype
            for x, y in zip(a, b, strict=True)
        )
        or meta_a.reduce == "collect"
    )

"""Reductions: how the occurrences of a name saved with `save_inter(..., reduce=mode)` combine.

Every occurrence of a reduced name, wherever it is (straight-line call sites, loop iterations,
branches), folds into one *accumulator*, in program order. The modes are one table, `MODES`:
a mode is one `Mode` entry, and nothing else in statax names a mode. There are two kinds:

* *running* modes (`"mean"`, `"sum"`, `"min"`, `"max"`, `"first"`, `"last"`) keep each array
  leaf beside a count of the same shape (how many occurrences reached each element), so that a
  branch not taken or a loop that never ran contributes nothing. Inside a `scan` or a
  `while_loop` they are a running value in the loop's carry: no per-iteration storage;
* *occurrence-axis* modes (`"stack"`, `"collect"`) keep the occurrences one after another along
  an occurrence axis (after any batch axes). Under `jit` its length is fixed when the program is
  traced, so an occurrence that did not run (a `cond` branch not taken) is a row (or run of
  elements) of zeros; each leaf keeps a boolean mask beside it, true where an occurrence ran
  (`pull(fn, ran=True)` returns it). A `while_loop` refuses them.

`finalize` turns an accumulator into the value `pull` returns. A name none of whose
occurrences ran gives zeros.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from .._jax import primitive_params as _params
from .errors import ReduceMismatchError
from .meta import StateMeta

__all__ = [
    "MODES",
    "Mode",
    "across_shards",
    "check_in_while",
    "combine",
    "finalize",
    "fold_axis",
    "identity",
    "merge",
    "mode",
    "ran",
    "running",
    "stacked",
    "to_accumulator",
]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One reduction mode: what `save_inter(..., reduce=name)` does.

    Attributes:
        name: the mode's name.
        running: a running value beside a count (elementwise); else an occurrence axis beside
            a mask.
        start: occurrence-axis modes: `start(x, b)`, one occurrence's leaf (with `b` batch
            axes) as its rows along the occurrence axis at `b`.
        pick: running modes: `pick(x, m, y, n)`, the value of the occurrences `x` (counted by
            `m`) followed by `y` (counted by `n`).
        across: running modes: `across(v, n, axes)`, inside a `shard_map`, the value over
            every shard (counted by `n`) with collectives over the manual mesh `axes`.
        finish: `finish(v, n)`, the value `pull` returns (`n`: the count; or the mask).
        in_while: whether a `while_loop` may hold it (its iteration count is not known when
            compiled, so an occurrence axis cannot be sized).
        any_shape: whether occurrences of different shapes may combine.
    """

    name: str
    running: bool
    finish: Callable
    start: Callable | None = None
    pick: Callable | None = None
    across: Callable | None = None
    in_while: bool = True
    any_shape: bool = False


def _largest(dtype, sign):
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
    return info.max if sign > 0 else info.min


def _shard_index(axes):
    return _params.vary(jax.lax.axis_index(axes), axes)


def _where_ran(v, n):
    return jnp.where(n > 0, v, 0).astype(v.dtype)


def _values(v, n):
    return v


def _extreme(name, pick, reduce_shards, sign):
    """`"min"` or `"max"`: elementwise, over the occurrences that reached each element."""
    return Mode(
        name,
        running=True,
        pick=lambda x, m, y, n: jnp.where(n == 0, x, jnp.where(m == 0, y, pick(x, y))),
        across=lambda v, n, axes: reduce_shards(jnp.where(n > 0, v, _largest(v.dtype, sign)), axes),
        finish=_where_ran,
    )


_TABLE = (
    Mode(
        "stack",
        running=False,
        start=lambda x, b: jnp.expand_dims(x, b),
        finish=_values,
        in_while=False,
    ),
    Mode(
        "collect",
        running=False,
        start=lambda x, b: jnp.reshape(x, (*jnp.shape(x)[:b], -1)),
        finish=_values,
        in_while=False,
        any_shape=True,
    ),
    Mode(
        "mean",
        running=True,
        pick=lambda x, m, y, n: x + y,
        across=lambda v, n, axes: jax.lax.psum(v, axes),
        finish=lambda v, n: jnp.where(n > 0, v / jnp.maximum(n, 1), 0),
    ),
    Mode(
        "sum",
        running=True,
        pick=lambda x, m, y, n: x + y,
        across=lambda v, n, axes: jax.lax.psum(v, axes),
        finish=_values,
    ),
    _extreme("min", jnp.minimum, jax.lax.pmin, 1),
    _extreme("max", jnp.maximum, jax.lax.pmax, -1),
    Mode(
        "first",
        running=True,
        pick=lambda x, m, y, n: jnp.where(m > 0, x, y),
        # the value of the first shard, in shard order, that has one
        across=lambda v, n, axes: _from_shard(
            v,
            jax.lax.pmin(jnp.where(n > 0, _shard_index(axes), jnp.iinfo(jnp.int32).max), axes),
            axes,
        ),
        finish=_where_ran,
    ),
    Mode(
        "last",
        running=True,
        pick=lambda x, m, y, n: jnp.where(n > 0, y, x),
        across=lambda v, n, axes: _from_shard(
            v, jax.lax.pmax(jnp.where(n > 0, _shard_index(axes), -1), axes), axes
        ),
        finish=_where_ran,
    ),
)


def _from_shard(v, chosen, axes):
    """Shard `chosen`'s `v`, on every shard."""
    return jax.lax.psum(jnp.where(_shard_index(axes) == chosen, v, jnp.zeros_like(v)), axes)


MODES: dict[str, Mode] = {m.name: m for m in _TABLE}


def mode(meta: StateMeta) -> Mode:
    """The `Mode` of a reduced intermediate."""
    return MODES[meta.reduce]


def _split(meta, leaves):
    n = meta.num_values
    return leaves[:n], leaves[n:]


def to_accumulator(meta: StateMeta, leaves: Sequence) -> tuple[StateMeta, list]:
    """One occurrence's values as an accumulator."""
    if meta.accumulator:
        return meta, list(leaves)
    m, b = mode(meta), meta.batch_ndim
    if m.running:
        acc = [*leaves, *(jnp.ones(jnp.shape(x), jnp.int32) for x in leaves)]
    else:
        rows = [m.start(x, b) for x in leaves]
        acc = [*rows, *(jnp.ones(jnp.shape(x)[: b + 1], bool) for x in rows)]
        if m.any_shape:  # one mask entry per element: occurrences of any shape line up
            acc[len(rows) :] = [jnp.ones(jnp.shape(x), bool) for x in rows]
    return dataclasses.replace(meta, accumulator=True), acc


def identity(meta: StateMeta, avals: Sequence) -> list:
    """The accumulator of no occurrence, with the leaves' avals (zeros, counts of zero, masks
    that are all false)."""
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


def combine(meta_a: StateMeta, a: Sequence, meta_b: StateMeta, b: Sequence) -> list:
    """The accumulator of `a`'s occurrences followed by `b`'s (both accumulators)."""
    m = mode(meta_a)
    if not m.running:
        ba, bb = meta_a.batch_ndim, meta_b.batch_ndim
        return [
            jnp.concatenate(_lead(x, ba, y, bb), axis=max(ba, bb))
            for x, y in zip(a, b, strict=True)
        ]
    (va, na), (vb, nb) = _split(meta_a, a), _split(meta_b, b)
    values = [m.pick(x, i, y, j) for x, i, y, j in zip(va, na, vb, nb, strict=True)]
    return [*values, *(i + j for i, j in zip(na, nb, strict=True))]


def _lead(x, bx, y, by):
    """Broadcast the batch axes (the first `bx` of `x`, `by` of `y`) to each other."""
    batch = jnp.broadcast_shapes(jnp.shape(x)[:bx], jnp.shape(y)[:by])
    return (
        jnp.broadcast_to(x, (*batch, *jnp.shape(x)[bx:])),
        jnp.broadcast_to(y, (*batch, *jnp.shape(y)[by:])),
    )


def running(meta: StateMeta) -> bool:
    """Whether a loop keeps this intermediate as a running value in its carry."""
    return meta.accumulator and meta.reduce is not None and mode(meta).running


def stacked(meta: StateMeta) -> bool:
    """Whether this intermediate is reduced along an occurrence axis (`"stack"`, `"collect"`)."""
    return meta.reduce is not None and not mode(meta).running


def check_in_while(meta: StateMeta) -> None:
    """Raise where a `while_loop` cannot hold this intermediate's mode."""
    if meta.reduce is not None and not mode(meta).in_while:
        raise ReduceMismatchError.in_while_loop(meta)


def fold_axis(meta: StateMeta, leaves: Sequence, axis: int) -> list:
    """An accumulator with an extra axis at `axis` (one accumulator per index, in order: a
    scan's iterations, a shard_map's shards) folded into one."""
    if not mode(meta).running:  # merge it into the occurrence axis after it
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
    """Inside a `shard_map`: the running accumulator of all shards (the same on every shard),
    combined with collectives over the manual mesh `axes` in shard order."""
    # Collectives over several axes need values that vary over all of them.
    values, counts = _split(meta, [_params.vary(x, axes) for x in leaves])
    across = mode(meta).across
    out = [across(v, n, axes) for v, n in zip(values, counts, strict=True)]
    return [*out, *(jax.lax.psum(n, axes) for n in counts)]


def ran(meta: StateMeta, leaves: Sequence) -> list:
    """The masks of an occurrence-axis accumulator: per leaf, true where an occurrence ran
    (`"stack"`: shape `(*batch, occurrences)`; `"collect"`: the value's shape)."""
    return list(_split(meta, leaves)[1])


def finalize(meta: StateMeta, leaves: Sequence) -> list:
    """The values `pull` returns for an accumulator."""
    finish = mode(meta).finish
    return [finish(v, n) for v, n in zip(*_split(meta, leaves), strict=True)]


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
    m = mode(meta_a)
    if m.any_shape:
        return True
    skip_a, skip_b = meta_a.batch_ndim, meta_b.batch_ndim
    if not m.running:  # past the occurrence axis
        skip_a, skip_b = skip_a + 1, skip_b + 1
    return all(
        jnp.shape(x)[skip_a:] == jnp.shape(y)[skip_b:] and x.dtype == y.dtype
        for x, y in zip(a, b, strict=True)
    )

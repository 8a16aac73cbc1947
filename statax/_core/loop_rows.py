"""Every iteration of a `while_loop`, kept in rows (`pull(fn, steps=N)`).

A loop whose number of iterations is known only when it runs keeps its marks in buffers of `N`
rows (its `cond_fun`'s in `N + 1`: the evaluation before each iteration, and the one that ended
the loop), zeros where no iteration wrote, beside a count of the iterations that ran. Iteration
`i` writes row `i`; what is planted there comes in with the same rows, and iteration `i` reads
row `i`. Names saved with an elementwise `reduce=` mode keep their running value instead (no
row per iteration). A loop that runs more than `N` iterations raises (`check_bound`): nothing is
truncated silently. The `.ran` flags of `pull(fn, ran=True)` are leaves like the others, so their
rows say which iterations ran.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import reduce as reductions
from .errors import error_if
from .exposers import split_leaves

__all__ = ["check_bound", "empty_rows", "row", "stacked_avals", "write"]


def stacked_avals(avals, rows: int) -> list:
    """The types of `avals` with `rows` rows in front."""
    return [a.update(shape=(rows, *a.shape)) for a in avals]


def empty_rows(metas, avals, rows: int) -> list:
    """What a loop holds of its marks before its first iteration: zeros, in `rows` rows for a
    value (one row per iteration), without them for a running `reduce=` value."""
    out = []
    for meta, part in zip(metas, split_leaves(avals, metas), strict=True):
        for a in part:
            shape = a.shape if reductions.running(meta) else (rows, *a.shape)
            out.append(jnp.zeros(shape, a.dtype))
    return out


def write(metas, held: list, new: list, index) -> list:
    """`held` with iteration `index`'s values `new` in: in row `index` (clamped: a loop past its
    bound raises after it, see `check_bound`), or combined into a running `reduce=` value."""
    out = []
    parts = zip(metas, split_leaves(held, metas), split_leaves(new, metas), strict=True)
    for meta, old, value in parts:
        if reductions.running(meta):
            out.extend(reductions.combine(meta, old, meta, value))
        else:
            for a, b in zip(old, value, strict=True):
                at = jnp.minimum(index, a.shape[0] - 1)
                out.append(jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), at, 0))
    return out


def row(values: list, index) -> list:
    """Row `index` of each of `values` (what is planted in iteration `index`)."""
    return [
        jax.lax.dynamic_index_in_dim(x, jnp.minimum(index, x.shape[0] - 1), 0, keepdims=False)
        for x in values
    ]


def check_bound(leaves: list, count, steps: int, where: str) -> list:
    """`leaves`, which raise when the program runs where the loop ran more iterations than the
    `steps` rows hold (per example under `vmap`: where any did)."""
    message = (
        f"stx.pull(..., steps={steps}): the while_loop {where} ran more iterations than the "
        f"{steps} rows it keeps. Nothing was truncated: the call failed. To fix: pass a "
        "larger steps= (a tuple gives one bound per depth of while_loops)."
    )
    # Only the count goes through the check (a copy of every row would cost), and the smallest
    # value depends on it, so that no compiler drops the check.
    checked = error_if([count], jnp.any(count > steps), message)[0]
    leaves = list(leaves)
    i = min(range(len(leaves)), key=lambda i: leaves[i].size)
    past = jnp.reshape(checked > steps, checked.shape + (1,) * (leaves[i].ndim - checked.ndim))
    leaves[i] = jnp.where(past, jnp.zeros_like(leaves[i]), leaves[i])
    return leaves

"""`stx.first_nonfinite(step)(*args)`: where in the backward pass a gradient stopped being
finite, named by the first mark or selected place (in backward order) whose cotangent did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.meta import KeyName
from .._core.tracebacks import boundary
from .pull import pull

__all__ = ["NonFinite", "first_nonfinite"]


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first place, in backward order, whose cotangent is not finite.

    Attributes:
        key: the cotangent's key, as `pull(fn, cotangents=True)` returns it (`"z_0.grad"`).
        place: the mark's name: a module path or scope for a selection (`"blocks[3]"`).
        location: the `save_inter`'s `"file.py:line"` (for a selection, the line that called
            the module).
        index: where in the occurrences the key stacks: one index per leading axis that a
            `vmap` (the examples, first) or a loop (its iterations) adds, `()` for a value
            marked once. Of the non-finite entries, the first the backward pass reached: the
            latest loop iteration (the backward pass runs loops from their last iteration),
            and of entries at the same iterations, the lowest example (examples run
            together, so the example index only breaks ties).
        value: the forward value there (that occurrence of the mark).
        cotangent: the cotangent there.
    """

    key: str
    place: str
    location: str
    index: tuple[int, ...]
    value: Any
    cotangent: Any

    def __str__(self) -> str:
        at = f" at index {self.index}" if self.index else ""
        bad = np.asarray(self.cotangent)
        counts = f"{int(np.isnan(bad).sum())} NaN, {int(np.isinf(bad).sum())} Inf"
        return (
            f"the first non-finite cotangent in backward order is {self.key!r}{at} "
            f"({self.place}, saved at {self.location}): {counts} of {bad.size}"
        )


def first_nonfinite(fn: Callable, *, at: Any = None) -> Callable[..., tuple[Any, NonFinite | None]]:
    """Run `fn` (a function that differentiates: a train step, a `jax.grad`) and, where its
    output is not finite, find the first mark or selected place, in backward order, whose
    cotangent is not: `first_nonfinite(fn)(*args) -> (out, found)`.

    `found` is `None` where every floating-point leaf of `out` is finite: then it cost one run
    of `fn` and one check of its output. Otherwise `fn` runs again as
    `pull(fn, at=at, cotangents=True)`, and `found` is a `NonFinite`: the key, the module path
    or mark name, the file and line, the loop iteration and example index, and the forward
    value there. Called eagerly (it reads the check on the host).

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def loss(x):
        ...     h = stx.save_inter(x - 1.0, name="h")
        ...     return jnp.sum(jnp.sqrt(h))
        >>> grads, found = stx.first_nonfinite(jax.grad(loss))(jnp.array([2.0, 1.0]))
        >>> found.key, found.value
        ('h_0.grad', Array([1., 0.], dtype=float32))
    """

    @boundary
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _finite(out):
            return out, None
        out, inters = pull(fn, at=at, cotangents=True)(*args, **kwargs)
        return out, _first(inters)

    return run


def _finite(tree) -> bool:
    leaves = [
        jnp.isfinite(x).all()
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return bool(jnp.stack(leaves).all()) if leaves else True


def _reached(index: tuple[int, ...], batch_ndim: int) -> tuple:
    """How early the backward pass reaches the occurrence at `index` (smaller: earlier): the
    later a loop iteration, the earlier (the backward pass runs loops from their last
    iteration); of the same iterations, the lower example first (examples run together)."""
    return (tuple(-i for i in index[batch_ndim:]), index[:batch_ndim])


def _first(inters: dict) -> NonFinite | None:
    """The first non-finite cotangent among `inters` in backward order: the `.grad` keys in
    the order the backward pass made them; of keys stacked alike next to each other (marks of
    one loop body), the one non-finite at the iteration the backward pass reaches first."""
    found = []  # (key, leading index, how early it is reached), in the order the pass made them
    for key, value in inters.items():
        if not KeyName.parse(key).grad:
            continue
        leaves = jax.tree_util.tree_leaves(value)
        site = getattr(key, "site", ())
        lead = len(np.shape(leaves[0])) - len(site[0]) if site else 0
        batch_ndim = min(getattr(key, "batch_ndim", 0), lead)
        bad = np.zeros(np.shape(leaves[0])[:lead], bool)
        for leaf in leaves:
            finite = np.isfinite(np.asarray(leaf))
            bad |= ~finite.reshape(*finite.shape[:lead], -1).all(axis=-1)
        if bad.any():
            indices = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)] if lead else [()]
            index = min(indices, key=lambda ix: _reached(ix, batch_ndim))
            found.append((key, index, _reached(index, batch_ndim)))
    if not found:
        return None
    key, index, reached = found[0]
    for other, other_index, other_reached in found[1:]:  # (the same loop's, next to it)
        if not reached[0] or len(other_reached[0]) != len(reached[0]):
            break
        if other_reached[0] < reached[0]:  # (a later iteration: reached first)
            key, index, reached = other, other_index, other_reached
    parsed = KeyName.parse(key)
    forward = str(parsed.value())
    pick = lambda tree: jax.tree_util.tree_map(lambda x: x[index], tree)  # noqa: E731
    return NonFinite(
        key,
        parsed.name,
        getattr(key, "location", "<unknown>"),
        index,
        pick(inters[forward]) if forward in inters else None,
        pick(inters[key]),
    )

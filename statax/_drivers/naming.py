"""Naming what `pull` returns: keys `name_0, name_1, ...` in program order (`Key`, with the
`save_inter`'s location), the `only=` selection, and the output rebuilt from flat arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core import context as _context
from .._core import reduce as _reduce
from .._core.errors import CotangentsError, KeyCollisionError, SelectionError
from .._core.meta import ARRAY, KeyName, StateMeta, key_names, tap_root
from .._select import report as _report


def check_cotangents(metas: Sequence[StateMeta]) -> None:
    """Under `cotangents=True`, raise where marks were collected and none has a cotangent:
    the function differentiates none of them inside it, and a `.grad` key the user reads next
    would be a bare `KeyError`."""
    if not _context.COTANGENTS.value or _context.PLANTING.value is not None:
        return  # (`plant` says so of a cotangent it was given, by its key)
    metas = [m for m in metas if m.reduce is None]  # (a reduced name has no cotangent)
    if not metas or any(m.grad for m in metas):
        return
    names = sorted({m.name for m in metas})
    shown = ", ".join(map(repr, names[:4])) + (", ..." if len(names) > 4 else "")
    raise CotangentsError(
        f"pull(fn, cotangents=True) read no cotangent: fn differentiates none of its marks "
        f"({shown}; the first at {metas[0].location}) inside it, so no backward pass runs "
        "through them and there is no '.grad' key. Pull a function that differentiates "
        "inside (stx.pull(jax.grad(loss), cotangents=True), a train step that calls "
        "jax.value_and_grad), or drop cotangents=True; for the gradient of a loss with respect "
        "to the marks themselves, use stx.grad_inters(loss)."
    )


def check_only(only, metas: Sequence[StateMeta], everything: Callable) -> None:
    """Raise where `only=` selects nothing, or names a mark the program does not have
    (`everything()`: the program's entry with every mark collected, for the message)."""
    names = {m.name for m in metas}
    if isinstance(only, _Names):
        missing = sorted(only.names - names)
    elif isinstance(only, _Pattern):  # a pattern that matches nothing: a typo, as a name is
        missing = [] if names else [only]
    else:  # a predicate is a filter: one that lets nothing through selects nothing, quietly
        missing = []
    if not missing:
        return
    there = sorted({m.name for m in everything().metas})
    shown = repr(missing[0].pattern.pattern if isinstance(missing[0], _Pattern) else missing[0])
    hint = ""
    parsed = KeyName.parse(missing[0]) if isinstance(missing[0], str) else None
    if parsed is not None and (parsed.occurrence is not None or parsed.suffix):
        base = parsed.name
        if base in there:
            hint = (
                f" {missing[0]!r} is a key: only= takes names, as save_inter was given them "
                f"({base!r})"
                + (
                    f", and selects a mark with its cotangent: only={base!r} with "
                    f"cotangents=True gives '{base}_0' and '{base}_0.grad'."
                    if parsed.grad
                    else "."
                )
            )
    listed = _report.closest(str(missing[0]), there) if there else "none"
    raise SelectionError(
        f"stx.pull(fn, only=...): {shown} selects no mark of the program.{hint} The marks there, "
        f"closest first: {listed}."
    )


class Key(str):
    """A key of the dict `pull` returns: the string `f"{name}_{n}"` (or the name of a reduced
    entry), which also knows where its value was saved, `key.location` (`"file.py:line"`), and
    its `save_inter`'s `reduce` mode (`key.reduce`, `None` for one occurrence). It travels with
    the result: through `dict(inters)`, `summarize=`, and JAX transformations. A cotangent's
    key also knows the shapes of one occurrence's arrays at the mark (`key.site`) and how many
    of the leading axes in front of them are examples of a `vmap` (`key.batch_ndim`; the
    others are loop iterations)."""

    location: str
    reduce: str | None
    site: tuple
    batch_ndim: int

    def __new__(
        cls,
        key: str,
        location: str,
        reduce: str | None = None,
        site: tuple = (),
        batch_ndim: int = 0,
    ) -> Key:
        self = super().__new__(cls, key)
        self.location = location
        self.reduce = reduce
        self.site = site
        self.batch_ndim = batch_ndim
        return self

    def __reduce__(self):
        return (Key, (str(self), self.location, self.reduce, self.site, self.batch_ndim))


def keys_named(entry: str, keys) -> list:
    """The keys among `keys` that `entry` stands for, as a user writes one to a driver's
    per-key option (`axis=`, `axes=`, `sites=`): the key itself (`"h_1"`), or every occurrence
    of a name (`"h"`, as `only=` takes names; a reduced name is its own key)."""
    return [k for k in keys if k == entry or KeyName.parse(str(k)).name == entry]


@functools.lru_cache(maxsize=4096)
def _key(name: str, location: str, reduce: str | None, site=(), batch_ndim=0) -> Key:
    """The `Key` (made once: keys are immutable)."""
    return Key(name, location, reduce, site, batch_ndim)


def origins(inters: dict) -> dict[str, str]:
    """`{key: "file:line"}` for the keys of `inters` that `pull` made."""
    return {key: key.location for key in inters if isinstance(key, Key)}


def unflatten_out(entry, arrays: Sequence) -> Any:
    """The output from its flat arrays (`entry` has `out_static` and `out_treedef`)."""
    it = iter(arrays)
    leaves = [next(it) if s is None else s[0] for s in entry.out_static]
    return jax.tree_util.tree_unflatten(entry.out_treedef, leaves)


def named(metas: Sequence[StateMeta], flat: Sequence, ran: bool, plans: dict) -> dict:
    """`{f"{name}_{n}": value}`, n counting each name's occurrences in program order; a
    reduced name is one entry, keyed by the name itself. With `ran`, a `"stack"` or
    `"collect"` name also gets `f"{name}.ran"`, its masks of occurrences that ran. The keys are
    worked out once per entry (`plans`)."""
    plan = plans.get(ran)
    if plan is None:
        plan = plans[ran] = _plan(metas, ran)
    inters: dict[str, Any] = {}
    for key, meta, start, stop, kind in plan:
        if kind == "array":
            inters[key] = flat[start]
            continue
        leaves = flat[start:stop]
        if kind == "value":
            inters[key] = meta.unflatten(leaves)
        elif kind == "add":
            inters[key] = jax.tree_util.tree_map(jnp.add, inters[key], meta.unflatten(leaves))
        elif kind == "flagged":  # the value, its mask last
            inters[key] = meta.unflatten(leaves[:-1])
        elif kind == "flag":
            inters[key] = leaves[-1]
        elif kind == "final":
            inters[key] = meta.unflatten(_reduce.finalize(meta, leaves))
        else:
            inters[key] = meta.unflatten(_reduce.ran(meta, leaves))
    return inters


def _branches_of(first: StateMeta, second: StateMeta) -> bool:
    """Whether two cotangents share one key as the branches of one batched `cond` make them:
    JAX runs both branches of a `cond` whose predicate is batched (a `select` of the two), so
    the mark of one slot (`tap`) is tapped in each. The cotangent that flows back into the
    branch not taken is zero, example by example, so their sum is the slot's cotangent."""
    return (
        first.grad
        and second.grad
        and first.tap != second.tap
        and tap_root(first.tap) == tap_root(second.tap)
    )


@functools.lru_cache(maxsize=256)
def plans_for(metas: tuple[StateMeta, ...]) -> dict:
    """The `plans` of `named` for `metas`, kept for the next trace of the same marks."""
    return {}


def _plan(metas: Sequence[StateMeta], ran: bool) -> list:
    """`[(Key, meta, start, stop, kind)]`: where each entry of the result comes from, and how
    it is made from its leaves (`kind`: "array", "value", "final" or "ran")."""
    sites: dict[str, StateMeta] = {}
    plan = []
    start = 0
    for parsed, meta in zip(key_names(metas), metas, strict=True):
        key = str(parsed)
        stop = start + meta.num_arrays
        kind = "value" if meta.reduce is None else "final"
        if (
            kind == "value"
            and meta.static_leaves == (ARRAY,)
            and jax.tree_util.treedef_is_leaf(meta.treedef)
            and not meta.flagged
        ):
            kind = "array"  # the value is its one array
        entries = [(key, "flagged" if meta.flagged else kind)]
        if meta.flagged:
            entries.append((str(parsed.ran()), "flag"))
        if ran and meta.reduce is not None and _reduce.stacked(meta):
            entries.append((str(KeyName(meta.name).ran()), "ran"))
        for name, kind in entries:
            if name in sites and _branches_of(sites[name], meta):
                kind = "add"  # the other branch's cotangent at the same slot: zero where it ran
            elif name in sites:
                raise KeyCollisionError(name, sites[name], meta)
            sites[name] = meta
            key = _key(name, meta.location, meta.reduce, meta.site, meta.batch_ndim)
            plan.append((key, meta, start, stop, kind))
        start = stop
    return plan


@dataclasses.dataclass(frozen=True)
class _Names:
    names: frozenset

    def __call__(self, meta: StateMeta) -> bool:
        return meta.name in self.names


@dataclasses.dataclass(frozen=True)
class _Pattern:
    pattern: re.Pattern

    def __call__(self, meta: StateMeta) -> bool:
        return self.pattern.fullmatch(meta.name) is not None


def selection_of(only: Any) -> Callable[[StateMeta], bool] | None:
    """`only` as a hashable predicate on StateMeta (None: everything)."""
    if only is None:
        return None
    if isinstance(only, str):
        return _Names(frozenset([only]))
    if isinstance(only, re.Pattern):
        return _Pattern(only)
    if callable(only):
        return only
    try:
        names = frozenset(only)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"stx.pull(fn, only=...) takes a name, a collection of names, a compiled regular "
            f"expression or a predicate on StateMeta; got {only!r}."
        )
    return _Names(names)

"""`plant`: put values into marked places; `grad_inters`: gradients with respect to them.

A planted mark is decided where it is bound, as `only=` is: while `plant(fn)` traces, a
`save_inter` whose name is planted takes a *choice* and a replacement from outside (with
`take`, so every handler threads them in as it threads intermediates out) and becomes

    select_n(choice, value, replacement, value + replacement, hook_0(value), ...)

The choice of each occurrence (keep, replace, add, or the j-th hook) is a constant of the
program `plant` runs, so the compiler keeps one case and drops the others, and with them any
work that only fed the replaced value. In a sweep's program with `reuse` (a `Switch` that
knows the base run's value), a mark outside every loop is first a `cond` on SKIP, which takes
the replacement whole without the value (see `Switch`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import PlantError
from .._core.exposers import split_leaves
from .._core.meta import ARRAY, KeyName, StateMeta, keys_of, kind_str, kinds_str, unwrap
from .._core.primitive import INPUT, save_inter_p
from .._jax import tracing as _tracing

__all__ = ["Add", "Planting", "Switch", "feed", "loop_rows"]

KEEP, REPLACE, ADD, HOOK = 0, 1, 2, 3  # a choice; HOOK + j is the name's j-th hook
SKIP = -1  # (a `Switch` with `base`) the replacement, whole, and the value not needed


@dataclasses.dataclass(frozen=True)
class Add:
    """A perturbation added to a marked value (what `grad_inters` differentiates)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Switch:
    """A replacement planted where `on` (traced) is true, element by element where `mask` is
    (a pytree of boolean arrays of the value's structure and shapes, as `pull` returns it:
    stacked by loops, batched by a `vmap`); everything else keeps the value the program
    computes. One program then plants or keeps, as the traced `on` says (what `stx.sweep`
    runs: one patch of many, chosen at run time).

    With `base` (the base run's value here, of the value's structure) and `after` (traced:
    the patch is at a mark later in program order), a mark the program runs once (in no loop)
    needs its value only where neither `on` nor `after` is: elsewhere it is `base` with the
    replacement where `on` and `mask` are, and the mark becomes a `cond` whose other branch is
    the value, so that `sinking.sink` can move what computes it in there. (Under a `vmap`
    inside, where the choice is per example, the `cond` is batched into a select: the same
    values, nothing skipped.)

    In a `scan` (one loop around it, `StateMeta.loops`), each row (iteration) of a mark is
    such a `cond`: it takes the base run's row where no mark of the body ran before it with
    the patch in it (`_loop_skips`). `reach` says where the patch may be (a mask as `mask`
    is, not batched: what a chunk of patches covers), so that the rows skipped are one
    number for the whole chunk: a `cond`, not a select."""

    on: Any
    mask: Any
    value: Any
    base: Any = None
    after: Any = None
    reach: Any = None


@dataclasses.dataclass(frozen=True)
class Planting:
    """The plant in force (`_context.PLANTING`): the names that take values in, and the hooks of
    each (compared by identity). Hashable: part of JAX's trace context."""

    names: frozenset
    hooks: tuple  # ((name, (hook, ...)), ...), sorted by name
    masked: bool = False  # a `Switch` is planted: each mark also takes masks in
    skipping: bool = False  # a `Switch` with `base`: each mark is a `cond` on SKIP

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Planting:
        """For `plant`'s `values`: a key `"h_2"` may be occurrence 2 of `h` or a name of its
        own; both are planted, and the keys the walk finds decide."""
        names, hooks = set(), {}
        for key, spec in values.items():
            if not isinstance(key, str):
                raise PlantError(f"stx.plant: keys are strings as pull returns them, got {key!r}")
            candidates = {key}
            parsed = KeyName.parse(key)
            if parsed.occurrence is not None:  # (`"h_0.grad"`: the cotangent of `h`'s first)
                candidates.add(parsed.name + parsed.suffix)
            names |= candidates
            if callable(spec):
                for name in candidates:
                    hooks.setdefault(name, [])
                    if spec not in hooks[name]:
                        hooks[name].append(spec)
        masked = any(isinstance(spec, Switch) for spec in values.values())
        skipping = any(
            isinstance(spec, Switch) and spec.base is not None for spec in values.values()
        )
        hooks = tuple(sorted((n, tuple(h)) for n, h in hooks.items()))
        return cls(frozenset(names), hooks, masked, skipping)

    @property
    def cotangents(self) -> bool:
        """Whether a cotangent is planted (a key `"h_0.grad"`): then the marks tap theirs."""
        return any(KeyName.parse(name).grad for name in self.names)

    def hooks_of(self, name: str) -> tuple:
        return dict(self.hooks).get(name, ())

    def plant(self, meta: StateMeta, arrays: list, value: Any) -> list:
        """A marked value as planted: its arrays chosen among the cases (see the module)."""
        if meta.reduce is not None:
            raise PlantError(
                f"save_inter {meta.name!r} at {meta.location} has reduce={meta.reduce!r}: its "
                "occurrences combine into one entry, so no one of them can be planted. To fix: "
                "plant a name saved without reduce=."
            )
        # The placeholder reads the marked arrays (behind stop_gradient: what comes in is a
        # constant to derivatives), so that it stays where the mark is: a placeholder of
        # constants alone would be hoisted out of a loop body as loop-invariant.
        operands = [jnp.zeros_like(arrays[0], shape=(), dtype=np.int32), *arrays]
        hooks = self.hooks_of(meta.planted_as)
        # (skipping: the step leaf tells whether a loop is around, `feed`)
        stepped = any(map(_takes_step, hooks)) or self.skipping
        tried = [_tried(meta, hook, value, arrays, stepped) for hook in hooks]
        failed = tuple(error for error, _ in tried)
        if self.masked:  # and where, element by element, a replacement goes
            operands += [jnp.zeros_like(x, dtype=bool) for x in arrays]
        if stepped:  # and the iteration, which the loop around gives (`exposers.take`)
            operands.append(operands[0])
        choice, *taken = save_inter_p.bind(
            *map(jax.lax.stop_gradient, operands),
            meta=dataclasses.replace(
                in_meta(meta, self.masked, stepped), failed=failed, stepped=stepped
            ),
            status=INPUT,
        )
        step = taken.pop() if stepped else None
        replacement = taken[: len(arrays)]
        masks = taken[len(arrays) :] if self.masked else [None] * len(arrays)

        def chosen(arrays, replacement, masks):
            index = jnp.minimum(choice, ADD)
            if self.skipping:  # (SKIP, where the value is computed anyway: replaced by mask)
                index = jnp.where(choice == SKIP, REPLACE, index)
            out = []
            for x, r, m in zip(arrays, replacement, masks, strict=True):
                added = x + r if jnp.issubdtype(x.dtype, jnp.number) else x
                replaced = r if m is None else jnp.where(m, r, x)
                out.append(jax.lax.select_n(index, x, replaced, added))
            return out

        if self.skipping and not hooks and not any(map(_tracing.differentiated, arrays)):
            # SKIP takes the replacement whole, and the value is read only in the other
            # branch, where `sinking.sink` moves what computes it (a sweep's program). Under
            # a derivative, the value is computed anyway: derivatives flow through it.
            return jax.lax.cond(
                choice == SKIP, lambda a, r, m: list(r), chosen, arrays, replacement, masks
            )
        out = chosen(arrays, replacement, masks)
        if not hooks:
            return out
        cases = [lambda: out] + [
            _hook_branch(meta, hook, value, arrays, f, step)
            for hook, f in zip(hooks, failed, strict=True)
        ]
        index = jnp.clip(choice - ADD, 0, len(hooks))
        if any(effects for _, effects in tried):
            # A hook with effects (a callback, named state) runs only where it is planted: a
            # branch of a `switch` on the choice, so that its effects happen there alone.
            return jax.lax.switch(index, cases)
        # Without effects, where a hook runs cannot be seen: each is computed beside the value
        # and chosen (as the replacement is), which compiles to less than a `switch`. A hook
        # that fails on this occurrence (another shape) is the value here: no error.
        results = [case() for case in cases]
        return [jax.lax.select_n(index, *r) for r in zip(*results, strict=True)]


def in_meta(meta: StateMeta, masked: bool = False, stepped: bool = False) -> StateMeta:
    """What a planted mark takes in: its choice, then a replacement of the value's structure
    (and, `masked`, masks of it: where the replacement goes; `stepped`, the iteration)."""
    one = jax.tree_util.tree_structure(0)
    trees = (one, meta.treedef) + ((meta.treedef,) if masked else ()) + ((one,) * stepped)
    static = (ARRAY, *meta.static_leaves, *(meta.static_leaves if masked else ()))
    static += (ARRAY,) * stepped
    treedef = jax.tree_util.treedef_tuple(trees)
    return dataclasses.replace(meta, treedef=treedef, static_leaves=static)


def _takes_step(hook) -> bool:
    """Whether `hook` has a parameter named `step` (then it is given the iteration)."""
    try:
        return "step" in inspect.signature(hook).parameters
    except (TypeError, ValueError):  # (no signature to read)
        return False


def _tried(meta, hook, value, arrays, stepped: bool) -> tuple[str, bool]:
    """`hook` traced apart on the marked value (nothing of it runs): the error it raises, or
    `""` (raised by `feed` where the hook is planted: see `Planting.plant`), and whether it has
    effects."""
    step = jnp.zeros((), np.int32) if stepped else None
    try:
        traced = jax.make_jaxpr(lambda: _hooked(meta, hook, value, arrays, step))()
    except Exception as error:  # noqa: BLE001 (any error of the user's hook)
        return f"{type(error).__name__}: {error}", False
    return "", bool(traced.effects)


def _hook_branch(meta, hook, value, arrays, failed: str, step):
    """The branch of a planted mark that runs `hook` (its value unchanged where the hook fails
    there: `feed` raises where it is planted)."""
    if failed:
        return lambda: list(arrays)
    return lambda: _hooked(meta, hook, value, arrays, step)


def _hooked(meta, hook, value, arrays, step=None) -> list:
    new = hook(value, step=step) if step is not None and _takes_step(hook) else hook(value)
    leaves, treedef = jax.tree_util.tree_flatten(new)
    got = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    want = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in arrays]
    if treedef != meta.treedef or got != want:
        raise PlantError(
            f"stx.plant: the hook {hook!r} for {meta.name!r} (save_inter at {meta.location}) "
            f"returned {kinds_str(got)} of structure {treedef}; the marked value is "
            f"{kinds_str(want)} of structure {meta.treedef}. A hook must return a value of the "
            "same shape, dtype and structure."
        )
    return leaves


def feed(
    ins: tuple[StateMeta, ...],
    avals: list,
    values: Mapping[str, Any],
    planting: Planting,
    outs: tuple[StateMeta, ...],
) -> list:
    """The flat values a rewritten jaxpr takes in, for `plant`'s `values`: per planted
    occurrence, its choice (a constant) and its replacement. `outs` (the marks `pull` finds)
    name the marks there are, for an unknown key's error."""
    keys = keys_of(ins, outs)  # (a cotangent after its value, as `pull` keys it)
    known = dict(zip(keys, ins, strict=True))
    names = {meta.planted_as for meta in ins}
    for key in values:
        if key not in known and key not in names:
            sites = "\n".join(
                f"  {k}: {m.location}"
                + ("" if m.reduce is None else f" (reduce={m.reduce!r}: not plantable)")
                for k, m in zip(keys_of(outs), outs, strict=True)
            )
            hint = ""
            if KeyName.parse(str(key)).grad:
                hint = (
                    " A cotangent (`.grad`) is there only where the function differentiates "
                    "the mark (a jax.grad or value_and_grad inside it)."
                )
            raise PlantError(
                f"stx.plant: no marked value {key!r}. The marks it can plant are:\n"
                f'{sites or "  (none)"}\nUse a key as pull returns it ("h_2": the third '
                f'"h"), or a name for every occurrence ("h").{hint}'
            )
    out = []
    start = 0
    specs = [values[k] if k in values else values.get(m.planted_as) for k, m in zip(keys, ins)]
    in_loops = _loop_skips(keys, ins, avals, specs)
    for j, (key, meta) in enumerate(zip(keys, ins, strict=True)):
        leaf_avals = avals[start : start + meta.num_arrays]
        start += meta.num_arrays
        choice_aval, value_avals = leaf_avals[0], leaf_avals[1:]
        step_avals = []
        if meta.stepped:  # (outside any loop: step 0)
            value_avals, step_avals = value_avals[:-1], value_avals[-1:]
        mask_avals = []
        if planting.masked:  # (the masks after the values)
            half = len(value_avals) // 2
            value_avals, mask_avals = value_avals[:half], value_avals[half:]
        spec = specs[j]
        code, replacement = KEEP, None
        if isinstance(spec, Switch):
            masks = [jnp.broadcast_to(m, a.shape) for m, a in zip(_leaves(spec.mask), mask_avals)]
            replacement = spec.value
            if spec.base is not None and (meta.stepped or j in in_loops):
                # A mark outside every loop (a loop takes its step leaf in: `exposers.take`)
                # runs once, after everything before it in program order: where the patch is
                # here or later, what runs before it is the base run, and so is its value. In
                # a scan, row by row (`_loop_skips`).
                on = jnp.asarray(spec.on)
                skip = in_loops[j] if j in in_loops else on | spec.after
                out.append(_switched(spec, choice_aval, skip))
                replacement = jax.tree.map(
                    lambda m, v, b: jnp.where(on & m, v, b), spec.mask, spec.value, spec.base
                )
                masks = [jnp.broadcast_to(on & m, jnp.shape(m)) for m in masks]
            else:
                out.append(_switched(spec, choice_aval))
            out.extend(_replacement(key, meta, replacement, value_avals))
            out.extend(masks)
            out.extend(np.zeros(a.shape, a.dtype) for a in step_avals)
            continue
        if isinstance(spec, Add):
            code, replacement = ADD, spec.value
        elif callable(spec):
            j = planting.hooks_of(meta.planted_as).index(spec)
            if meta.failed and meta.failed[j]:
                raise PlantError(
                    f"stx.plant: the hook {spec!r} for {key!r} (save_inter at {meta.location}) "
                    f"fails there: {meta.failed[j]}"
                )
            code = HOOK + j
        elif spec is not None:
            code, replacement = REPLACE, spec
        out.append(np.full(choice_aval.shape, code, np.int32))
        out.extend(_replacement(key, meta, replacement, value_avals))
        out.extend(np.ones(a.shape, bool) for a in mask_avals)
        out.extend(np.zeros(a.shape, a.dtype) for a in step_avals)
    return out


_FOUND: contextvars.ContextVar = contextvars.ContextVar("statax_loop_rows", default=None)


@contextlib.contextmanager
def loop_rows():
    """While in force, `feed` records the planted keys whose rows a `scan`'s `cond`s skip
    (`_loop_skips`): `{key: (axis, ndim)}`, the loop's axis in the key's value as `pull`
    returns it, and that value's (first leaf's) number of axes. (What a sweep puts in a chunk
    follows it: one row's patches.)"""
    found: dict = {}
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def _loop_skips(keys, ins, avals, specs) -> dict:
    """For the marks of a `scan`'s body planted with a `Switch` that knows the base run (one
    loop around them: `StateMeta.loops`), by their index in `ins`: per row, whether the mark
    may take the base run's value there, shaped to broadcast to its choice.

    The rows run in order (or reversed), and in each the body's marks in program order. Where
    the patch is in this body, a mark may skip up to the first mark and row the chunk's
    patches reach (`Switch.reach`), that one included; where it is elsewhere, every row or
    none, as `Switch.after` says."""
    parts = split_leaves(avals, ins)
    out, i = {}, 0
    while i < len(ins):
        place = _place(ins[i])
        group = range(i, i + (place.count if place is not None else 1))
        i = group.stop
        if place is None or place.index or group.stop > len(ins):
            continue
        if any(
            _place(ins[j]) != place._replace(index=j - group.start)
            or not isinstance(specs[j], Switch)
            or specs[j].base is None
            or len(parts[j][0].shape) <= ins[j].batch_ndim
            or parts[j][0].shape[ins[j].batch_ndim] != place.length
            for j in group
        ):
            continue  # (a mark without a base run's value: every row is computed)
        rows = jnp.arange(place.length)
        done = place.length - 1 - rows if place.reverse else rows  # (how many rows ran before)
        order = {j: done * place.count + j - group.start for j in group}
        first = place.length * place.count
        patched = jnp.zeros((), bool)
        for j in group:
            on = jnp.asarray(specs[j].on)
            reached = on & _rows_reached(specs[j], ins[j].batch_ndim, place.length)
            first = jnp.minimum(first, jnp.min(jnp.where(reached, order[j], first)))
            patched = patched | on
        for j in group:
            skip = jnp.where(patched, order[j] <= first, specs[j].after)
            shape = [1] * len(parts[j][0].shape)
            shape[ins[j].batch_ndim] = place.length
            out[j] = skip.reshape(shape)
            if _FOUND.get() is not None and len(parts[j]) > 1:
                _FOUND.get()[keys[j]] = (ins[j].batch_ndim, len(parts[j][1].shape))
    return out


def _place(meta: StateMeta):
    """The scan a planted mark is in, where it is in one loop and that loop is a `scan`."""
    return meta.loops[0] if len(meta.loops) == 1 else None


def _rows_reached(spec: Switch, axis: int, length: int) -> jax.Array:
    """The rows (along the loop's `axis`) where `spec.reach` is true anywhere: every row where
    it is not given."""
    if spec.reach is None:
        return jnp.ones(length, bool)
    rows = jnp.zeros(length, bool)
    for leaf in _leaves(spec.reach):
        leaf = jnp.asarray(leaf)
        if leaf.ndim <= axis:
            rows = rows | jnp.any(leaf)
        else:
            others = tuple(a for a in range(leaf.ndim) if a != axis)
            rows = rows | jnp.any(leaf, axis=others)
    return rows


def _switched(spec: Switch, choice_aval, skip=False) -> jax.Array:
    """The choice of each occurrence of a `Switch`: SKIP where `skip` is, else replace (where
    its masks say) where it is on, keep elsewhere."""
    on = jnp.broadcast_to(jnp.asarray(spec.on), choice_aval.shape)
    skip = jnp.broadcast_to(skip, choice_aval.shape)
    return jnp.where(skip, SKIP, jnp.where(on, REPLACE, KEEP)).astype(np.int32)


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree)


def _array_leaves(key, meta, leaves: list, static: tuple) -> list:
    """The leaves of a replacement where the marked value has arrays. Its other leaves (a
    string, `None`) are not planted: they must be what the mark holds, as `pull` returns it."""
    out = []
    for x, s in zip(leaves, static, strict=True):
        if s is ARRAY:
            out.append(x)
        elif not (x is s or x is unwrap(s) or _same(x, unwrap(s))):
            raise PlantError(
                f"stx.plant: the replacement for {key!r} (save_inter at {meta.location}) has "
                f"{x!r} where the marked value has {unwrap(s)!r}, which is not an array and "
                "cannot be planted. Pass the value pull returned there."
            )
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an array, an unusual __eq__: not the same
        return False


def _replacement(key, meta, replacement, avals) -> list:
    if replacement is None:
        return [np.zeros(a.shape, a.dtype) for a in avals]
    value_treedef = meta.treedef.children()[1]
    leaves, treedef = jax.tree_util.tree_flatten(replacement)
    if treedef != value_treedef:
        raise PlantError(
            f"stx.plant: the replacement for {key!r} (save_inter at {meta.location}) has "
            f"structure {treedef}; the marked value has {value_treedef}."
        )
    out = []
    static = meta.static_leaves[1 : 1 + value_treedef.num_leaves]  # the value's (after the choice)
    leaves = _array_leaves(key, meta, leaves, static)
    for x, aval in zip(leaves, avals, strict=True):
        x = jnp.asarray(x) if not isinstance(x, (int, float, complex)) else x
        shape = jnp.shape(x)
        unbatched = aval.shape[meta.batch_ndim :]
        dtype_ok = isinstance(x, (int, float, complex)) or x.dtype == aval.dtype
        if not dtype_ok or shape not in (aval.shape, unbatched):
            raise PlantError(
                f"stx.plant: the replacement for {key!r} (save_inter at {meta.location}) is "
                f"({kind_str(shape, jnp.result_type(x))}); expected "
                f"({kind_str(aval.shape, aval.dtype)})"
                + (
                    f" (or ({kind_str(unbatched, aval.dtype)}), broadcast over the batch)"
                    if meta.batch_ndim
                    else ""
                )
                + "."
            )
        out.append(jnp.broadcast_to(jnp.asarray(x, aval.dtype), aval.shape))
    return out

"""Exposers: handlers written as functions that run a primitive with its marks taken out and
bind them again outside it (`mark`, `take`), traced and walked into a `Rewrite`, and reused
under `vmap`; and making marks inert, for handlers that bind an equation as it was.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._jax import jaxprs as _jaxprs
from . import batching as _batching  # noqa: F401  (installs the batching rules records ask for)
from . import context as _context
from .marks import eqn_saves, find_saves, selecting
from .meta import LoopPlace, StateMeta
from .primitive import COLLECTING, IDLE, INERT, INPUT, save_inter_p
from .registry import Exposer, Handler, Rewrite, Rewritten, on_forget, register_handler
from .rewrite import call_equation, pull_open_jaxpr, without_save_effect

__all__ = [
    "Exposer",
    "handler_from_exposer",
    "inert",
    "map_jaxprs",
    "mark",
    "register_exposer",
    "set_steps",
    "split_leaves",
    "take",
    "unstepped",
]


def handler_from_exposer(exposer: Exposer) -> Handler:
    """A handler from an *exposer*, a function that runs the primitive on values.

    `exposer(*args, **params)` binds the primitive with the marks taken out of its jaxprs, and
    whatever else it needs, in the current trace; binds the intermediates again outside, with
    `mark` (and takes the values planted inside from outside, with `take`); and returns the
    primitive's outputs. The handler traces it at the equation's input types and walks the
    result into one `closed_call` equation. The same exposer serves `vmap`
    (`register_exposer`).
    """

    def handler(eqn: jex.JaxprEqn) -> Rewrite:
        closed = _jaxprs.trace(
            lambda *args: exposer(*args, **eqn.params),
            [x.aval for x in eqn.invars],
            name=str(eqn.primitive),
        )
        jaxpr, outs, ins = pull_open_jaxpr(closed.jaxpr)
        return call_equation(eqn, Rewritten(jex.ClosedJaxpr(jaxpr, closed.consts), outs, ins))

    return handler


def register_exposer(primitive: jex.Primitive, exposer: Exposer, **rules) -> None:
    """Register `primitive`'s record with a handler made from `exposer`
    (`handler_from_exposer`), which also runs, under `vmap`, in place of JAX's batching rule
    where the primitive holds marks: `register_handler(primitive, handler_from_exposer(exposer),
    exposer=exposer, **rules)`.

    JAX batches a `cond`, `scan` or `while` as a whole, before `pull` sees it (a batched `cond`
    even becomes a select over both branches). Where such a primitive holds marks, while a
    `pull` traces, the exposer runs per example and is batched with JAX's own rules: the
    primitive inside holds no marks any more, so it is batched by its own rule, and the marks
    bound outside it by the mark's. Elsewhere JAX's rule runs untouched.

    `rules` are the rest of its record (`Rules`' fields). A primitive with a handler of its own
    for the common case (`scan`) passes both: `register_handler(p, h, exposer=e, ...)`.
    """
    register_handler(primitive, handler_from_exposer(exposer), exposer=exposer, **rules)


def mark(leaves: Sequence, metas: Sequence[StateMeta]) -> None:
    """Bind the intermediates `metas` describe (flat `leaves`) again, as marks: in an exposer,
    outside the primitive it took them out of."""
    for meta, part in zip(metas, split_leaves(leaves, metas), strict=True):
        save_inter_p.bind(*part, meta=meta, status=COLLECTING)


def take(
    metas: Sequence[StateMeta],
    avals: Sequence,
    step: Callable | None = None,
    loop: tuple | None = None,
) -> list:
    """Values fed in from outside (flat leaves of `avals`, described by `metas`): in an exposer,
    what the primitive's rewritten jaxprs take in; in a planted mark, its replacement. The
    inverse of `mark`: each binds a placeholder mark that the walk turns into an input.

    A loop's handler passes `step`, a function of a meta and an aval giving its iteration index
    of that type: a planted mark whose hook is given the step (`StateMeta.stepped`) then takes that
    leaf from the loop, not from outside (see `set_steps`). Each mark taken in records the loop
    (`StateMeta.loops`): with `loop`, `(length, reverse)` of a `scan` whose planted values are
    rows, one per iteration (a `LoopPlace`); without, a loop whose values serve every
    iteration."""
    leaves: list = []
    for j, (meta, part) in enumerate(zip(metas, split_leaves(avals, metas), strict=True)):
        if step is not None:
            place = None if loop is None else LoopPlace(*loop, j, len(metas))
            meta = dataclasses.replace(meta, loops=(place, *meta.loops))
        if meta.stepped and step is not None:
            *part, last = part
            leaves.extend(take([unstepped(meta)], part) + [step(meta, last)])
            continue
        zeros = [jnp.zeros(a.shape, a.dtype) for a in part]
        leaves.extend(save_inter_p.bind(*zeros, meta=meta, status=INPUT))
    return leaves


def unstepped(meta: StateMeta) -> StateMeta:
    """What a planted mark given the step (`meta.stepped`: its last leaf) takes from outside
    once a loop gives it the step."""
    trees = meta.treedef.children()[:-1]
    return dataclasses.replace(
        meta,
        treedef=jax.tree_util.treedef_tuple(trees),
        static_leaves=meta.static_leaves[:-1],
        stepped=False,
    )


def set_steps(metas: Sequence[StateMeta], leaves: Sequence, step) -> list:
    """`leaves` (as `take` gave them for `metas`) with each step leaf of a planted mark given
    the step set to `step`, the loop's iteration index (a `while_loop` knows it only inside)."""
    out: list = []
    for meta, part in zip(metas, split_leaves(leaves, metas), strict=True):
        out.extend(part)
        if meta.stepped:
            out[-1] = jnp.broadcast_to(jnp.asarray(step, out[-1].dtype), jnp.shape(out[-1]))
    return out


def split_leaves(leaves: Sequence, metas: Sequence[StateMeta]) -> list[Sequence]:
    """Flat intermediate leaves, cut into one sequence per meta."""
    out, start = [], 0
    for meta in metas:
        out.append(leaves[start : start + meta.num_arrays])
        start += meta.num_arrays
    return out


_INERT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_INERT.clear)  # a new handler may find marks the old ones did not


def inert(jaxpr, which: Callable[[StateMeta], bool] | None = None):
    """`jaxpr` (open or closed) with every mark, at any depth, made inert (never collected); or,
    with `which`, the marks whose meta it accepts.

    For handlers that bind an equation as it was, to delegate to its own rules (custom
    derivatives, linear solves, see `pulled_with_rule`): its marks must not be collected again
    by an enclosing `pull`.
    """
    if _jaxprs.wraps_jaxpr(jaxpr):
        new = inert(jaxpr.jaxpr, which)
        return jaxpr if new is jaxpr.jaxpr else jex.ClosedJaxpr(new, jaxpr.consts)
    with selecting(None):  # every mark, selected or not
        if not find_saves(jaxpr):
            return jaxpr
        if which is not None:
            return _inert(jaxpr, which)
        cached = _INERT.get(jaxpr)
        if cached is None:
            cached = _INERT[jaxpr] = _inert(jaxpr, None)
        return cached


def _inert(jaxpr, which):
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is save_inter_p:
            if which is None or which(eqn.params["meta"]):
                if eqn.params["status"] == IDLE:  # it only reads: inert, it does nothing
                    continue
                eqn = eqn.replace(params=dict(eqn.params, status=INERT))
        elif eqn_saves(eqn):
            eqn = eqn.replace(params=map_jaxprs(eqn.params, lambda j: inert(j, which)))
        if not _still_collects(eqn):
            eqn = eqn.replace(effects=without_save_effect(eqn.effects))
        eqns.append(eqn)
    effects = jaxpr.effects
    if not any(_context.SAVE_EFFECT in eqn.effects for eqn in eqns):
        effects = without_save_effect(effects)
    return jaxpr.replace(eqns=eqns, effects=effects)


def _still_collects(eqn) -> bool:
    """Whether a mark in `eqn` still carries the effect of one a `pull` collects."""
    if eqn.primitive is save_inter_p:
        return eqn.params["status"] == COLLECTING
    return any(_context.SAVE_EFFECT in sub.effects for sub in _jaxprs.jaxprs_in_params(eqn.params))


def map_jaxprs(eqn_params: dict, fn: Callable) -> dict:
    """An equation's params with `fn` applied to every jaxpr in them (alone, or in a tuple or
    named tuple of them)."""
    return {key: _map_jaxprs(value, fn) for key, value in eqn_params.items()}


def _map_jaxprs(value, fn):
    if isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
        return fn(value)
    if isinstance(value, tuple) and any(isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr)) for v in value):
        items = [_map_jaxprs(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value

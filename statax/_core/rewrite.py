"""`pull_jaxpr`: every mark of a jaxpr made an extra output (and every planted one an extra
input), a hook on the one walk (`_core.evaluator.rewrite`).

* a `save_inter` equation is removed: its outputs are its operands, appended to the jaxpr's
  outputs, described by the `StateMeta` in its params; or, for a mark that takes a value in,
  new variables appended to the jaxpr's inputs;
* an equation whose inner jaxprs hold no mark is kept as it is;
* any other equation goes to the handler registered for its primitive, whose `Rewrite` takes
  the original inputs **followed by** the values it takes in and computes the original
  outputs **followed by** the intermediates it exposes. A primitive with no handler is an
  error that names it and says how to register one.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend import source_info_util as source_info_api

from .._jax import jaxprs as _jaxprs
from . import context as _context
from . import cotangents as _cotangents
from . import reduce as _reduce
from . import staging as _staging
from .errors import HandlerError, UnhandledPrimitiveError
from .evaluator import keep
from .evaluator import rewrite as rewrite_jaxpr
from .marks import cached_per_selection, find_saves, known_marks, marks_of, saves_in, selected
from .meta import StateMeta
from .primitive import COLLECTING, INPUT, TAPPING, collected, save_inter_p
from .registry import Rewrite, Rewritten, on_forget, rules_for

__all__ = [
    "call_equation",
    "extend_equation",
    "pull_collected",
    "pull_jaxpr",
    "pull_open_jaxpr",
    "pull_staged",
    "restage_equation",
]


# ---- the walk ------------------------------------------------------------------------------

_PULLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PULLED_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_PULLED.clear)  # a new handler may rewrite what the old ones could not
on_forget(_PULLED_OPEN.clear)


def pull_jaxpr(closed_jaxpr: jex.ClosedJaxpr) -> Rewritten:
    """Expose every `save_inter` of a ClosedJaxpr as an extra output (and take every planted
    one's value as an extra input).

    Args:
        closed_jaxpr: the jaxpr to rewrite.

    Returns:
        `Rewritten(jaxpr, outs, ins)`. `jaxpr` takes the same inputs followed by the flat
        leaves of each value in `ins` (empty unless a rewrite plants marks), and returns the
        old outputs followed by the flat array leaves of each intermediate in `outs`, in
        program order. Occurrences of a name saved with `reduce=` are folded into one. A
        jaxpr without marks comes back as it is. Results are cached per jaxpr object.

    Raises:
        UnhandledPrimitiveError: a higher-order primitive without a handler holds a mark.
    """
    return cached_per_selection(_PULLED, closed_jaxpr, lambda: _pull_closed(closed_jaxpr))


def _pull_closed(closed_jaxpr) -> Rewritten:
    jaxpr, outs, ins = pull_open_jaxpr(closed_jaxpr.jaxpr)
    if jaxpr is closed_jaxpr.jaxpr:
        return Rewritten(closed_jaxpr)
    return _folded(jaxpr, closed_jaxpr.consts, outs, ins)


def _folded(jaxpr: jex.Jaxpr, consts, outs, ins=()) -> Rewritten:
    if any(m.reduce is not None for m in outs):
        jaxpr, outs = _fold_reduced(jaxpr, outs)
    return Rewritten(jex.ClosedJaxpr(jaxpr, consts), tuple(outs), tuple(ins))


def pull_collected(closed_jaxpr: jex.ClosedJaxpr, marks: Sequence[tuple[int, StateMeta]]):
    """`pull_jaxpr` for a jaxpr traced with a `Collector`: its last outputs are the leaves of
    the marks the collector took (`(position, meta)` each, see `Collector`), and the marks
    that the walk finds in its equations go among them by position."""
    if not marks:
        return pull_jaxpr(closed_jaxpr)
    jaxpr = closed_jaxpr.jaxpr
    metas = [meta for _, meta in marks]
    num_out = len(jaxpr.outvars) - sum(m.num_arrays for m in metas)
    if not find_saves(jaxpr):  # every mark was collected: the jaxpr already returns them
        names = [f"statax:{m.name}" for m in metas for _ in range(m.num_arrays)]
        debug_info = _jaxprs.extend_debug_info(jaxpr.debug_info, names, keep=num_out)
        return _folded(jaxpr.replace(debug_info=debug_info), closed_jaxpr.consts, metas)
    # Put each collected mark back where it was made, as the equation a bind would have
    # staged, and walk the whole.
    eqns: list[jex.JaxprEqn] = []
    per_eqn: list[tuple[StateMeta, ...]] = []  # the marks of each, from those found already
    found = marks_of(jaxpr)[1]
    leaves = iter(jaxpr.outvars[num_out:])
    done = 0
    for position, meta in marks:
        eqns.extend(jaxpr.eqns[done:position])
        per_eqn.extend(found[done:position])
        done = position
        invars = [next(leaves) for _ in range(meta.num_arrays)]
        outvars = [jex.Var(x.aval) for x in invars]
        params = {"meta": meta, "status": COLLECTING}
        eqns.append(
            _jaxprs.new_equation(invars, outvars, save_inter_p, params, {_context.SAVE_EFFECT})
        )
        per_eqn.append((meta,))
    eqns.extend(jaxpr.eqns[done:])
    per_eqn.extend(found[done:])
    restored = jaxpr.replace(
        eqns=eqns,
        outvars=jaxpr.outvars[:num_out],
        debug_info=_jaxprs.extend_debug_info(jaxpr.debug_info, [], keep=num_out),
    )
    known_marks(restored, (tuple(m for ms in per_eqn for m in ms), per_eqn))
    return pull_jaxpr(jex.ClosedJaxpr(restored, closed_jaxpr.consts))


def pull_staged(trace, start: int, outs: Sequence, collector) -> tuple[list, list, tuple]:
    """`pull_collected` for a function traced straight into `trace` (`_staging.staging_trace`),
    from its position `start` on, with `collector` taking the marks made at `trace`'s level:
    the equations it staged that hold marks are rewritten in place, in `trace`.

    Returns `(outs, leaves, metas)`: `outs` (the function's flat outputs) as they now are, the
    flat leaves of the intermediates, and their metas, in program order."""
    metas = tuple(meta for _, meta in collector.marks)
    marks_in = saves_in(_staging.staged_as_held(trace, start))
    if not marks_in[0]:  # the usual case: every mark was collected as it was made
        leaves = collector.leaves
        if any(m.reduce is not None for m in metas):
            metas, leaves = _reduce.merge(metas, leaves)
        return list(outs), list(leaves), tuple(metas)
    staged = _staging.staged(trace, start)
    eqns = [eqn for eqn, _ in staged]
    # Walk what was staged as one jaxpr (its free variables are the trace's), returning the
    # outputs that are the trace's tracers (the others cannot change) and the collected leaves
    # (one that is not a tracer of the trace stands in as a fresh variable, and comes back).
    out_vars = [_staging.var_of(trace, x) for x in outs]
    staged_outs = [i for i, v in enumerate(out_vars) if v is not None]
    values = [*(outs[i] for i in staged_outs), *collector.leaves]
    leaf_vars = [_staging.var_of(trace, x) for x in collector.leaves]
    outvars = [out_vars[i] for i in staged_outs] + [
        jex.Var(jax.typeof(x)) if v is None else v
        for v, x in zip(leaf_vars, collector.leaves, strict=True)
    ]
    effects = set().union(*(e.effects for e in eqns))
    jaxpr = jex.Jaxpr([], [], outvars, eqns, effects, _jaxprs.debug_info("pull"))
    known_marks(jaxpr, marks_in)
    marks = [(position - start, meta) for position, meta in collector.marks]
    new, metas, ins = pull_collected(jex.ClosedJaxpr(jaxpr, []), marks)
    assert not ins, "marks are planted only where nothing is staged in place"
    new = new.jaxpr
    _staging.restage(trace, start, new.eqns, staged)
    known = {id(v): x for v, x in zip(outvars, values, strict=True)}

    def value(v):
        if id(v) in known:
            return known[id(v)]
        if isinstance(v, jex.Literal):
            return jnp.asarray(v.val, v.aval.dtype)
        return _staging.tracer_of(trace, v)

    flat = [value(v) for v in new.outvars]
    outs = list(outs)
    for i, x in zip(staged_outs, flat, strict=False):
        outs[i] = x
    return outs, flat[len(staged_outs) :], metas


def _fold_reduced(jaxpr: jex.Jaxpr, metas):
    """Fold the occurrences of each reduced name into one accumulator (see `_reduce.merge`):
    one equation appended after the others, which reads only the intermediates' leaves."""
    num_leaves = sum(m.num_arrays for m in metas)
    num_out = len(jaxpr.outvars) - num_leaves
    leaves = jaxpr.outvars[num_out:]
    merged: list = []

    def fold(*xs):
        new_metas, out = _reduce.merge(metas, xs)
        merged.append(new_metas)
        return out

    closed = _jaxprs.trace(fold, [x.aval for x in leaves], name="reduce")
    outvars = [jex.Var(aval) for aval in closed.out_avals]
    eqn = _jaxprs.new_equation(
        leaves, outvars, jex.primitives.closed_call_p, {"call_jaxpr": closed}, closed.effects
    )
    names = [f"statax:{m.name}" for m in merged[0] for _ in range(m.num_arrays)]
    new = jaxpr.replace(
        eqns=[*jaxpr.eqns, eqn],
        outvars=[*jaxpr.outvars[:num_out], *outvars],
        debug_info=_jaxprs.extend_debug_info(jaxpr.debug_info, names, keep=num_out),
    )
    return new, merged[0]


def pull_open_jaxpr(jaxpr: jex.Jaxpr) -> Rewritten:
    """`pull_jaxpr` for an open `Jaxpr` (as `jax.checkpoint` keeps in its params).

    Occurrences of reduced names are not folded here but by the enclosing `pull_jaxpr`."""
    return cached_per_selection(
        _PULLED_OPEN, jaxpr, lambda: _pull(jaxpr) if find_saves(jaxpr) else Rewritten(jaxpr)
    )


def _pull(jaxpr: jex.Jaxpr) -> Rewritten:
    extra_out: list[jex.Atom] = []
    outs: list[StateMeta] = []
    extra_in: list[jex.Var] = []
    ins: list[StateMeta] = []
    marks = iter(marks_of(jaxpr)[1])  # the marks each equation holds, in order
    eqns: list[jex.JaxprEqn] = []
    emit = eqns.append

    def step(eqn, invars):
        inner = next(marks)
        if eqn.primitive is save_inter_p:  # removed: its outputs are its operands
            meta = eqn.params["meta"]
            if eqn.params["status"] == TAPPING:  # (a tap left by an exposer: it stays)
                return keep(eqn, invars, emit)
            if eqn.params["status"] == INPUT:
                invars = [jex.Var(x.aval) for x in eqn.outvars]
                extra_in.extend(invars)
                ins.append(meta)
            elif collected(eqn.params) and selected(meta):
                extra_out.extend(invars)
                if _cotangents.keeping() and meta.reduce is None and meta.tap is None:
                    meta = dataclasses.replace(meta, tap=_cotangents.number())
                    outs.append(meta)
                    return _tap_left(invars, meta, emit)
                outs.append(meta)
            return invars if eqn.outvars else []  # (an idle mark has none)
        if not inner:
            return keep(eqn, invars, emit)
        handler = rules_for(eqn).handler
        if handler is None:
            in_rules = not any(_jaxprs.jaxprs_in_params(eqn.params))
            raise UnhandledPrimitiveError(eqn.primitive, inner, in_rules=in_rules)
        if any(a is not b for a, b in zip(invars, eqn.invars, strict=True)):
            eqn = eqn.replace(invars=invars)  # (reading the operands of removed marks)
        with source_info_api.user_context(eqn.source_info.traceback):  # errors: the user's line
            rewrite = _check_handler_result(eqn, handler(eqn))
        new_eqn = rewrite.eqn
        emit(new_eqn.replace(effects=without_save_effect(new_eqn.effects)))
        extra_out.extend(new_eqn.outvars[len(eqn.outvars) :])
        outs.extend(rewrite.outs)
        extra_in.extend(new_eqn.invars[len(eqn.invars) :])
        ins.extend(rewrite.ins)
        return new_eqn.outvars[: len(eqn.outvars)]

    outvars = rewrite_jaxpr(jaxpr, step)
    names = [f"statax:{m.name}" for m in outs for _ in range(m.num_arrays)]
    in_names = [f"statax:{m.name}" for m in ins for _ in range(m.num_arrays)]
    new = jaxpr.replace(
        eqns=eqns,
        invars=[*jaxpr.invars, *extra_in],
        outvars=[*outvars, *extra_out],
        effects=without_save_effect(jaxpr.effects),
        debug_info=_jaxprs.extend_debug_info(jaxpr.debug_info, names, arg_names=in_names),
    )
    return Rewritten(new, tuple(outs), tuple(ins))


def _tap_left(invars, meta: StateMeta, emit) -> list:
    """Where a mark is taken out (`_cotangents.kept`): a tap in its place, read downstream, that
    marks the cotangent of the value it exposes (`meta`, numbered)."""
    outvars = [jex.Var(x.aval) for x in invars]
    params = {"meta": meta, "status": TAPPING}
    emit(_jaxprs.new_equation(invars, outvars, save_inter_p, params, frozenset()))
    return outvars


def without_save_effect(effects):
    # Once pulled, no mark is left inside, and so neither is the effect marks carry.
    return effects - {_context.SAVE_EFFECT} if _context.SAVE_EFFECT in effects else effects


def _check_handler_result(eqn, result) -> Rewrite:
    prim = eqn.primitive
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise HandlerError(prim, "must return a Rewrite(eqn, outs, ins)")
    rewrite = Rewrite(*result)
    if not isinstance(rewrite.eqn, jex.JaxprEqn) or not all(
        isinstance(m, tuple) and all(isinstance(x, StateMeta) for x in m)
        for m in (rewrite.outs, rewrite.ins)
    ):
        raise HandlerError(prim, "must return a Rewrite(eqn, outs, ins) of tuples of StateMetas")
    for what, new, old, metas in (
        ("outputs", rewrite.eqn.outvars, eqn.outvars, rewrite.outs),
        ("inputs", rewrite.eqn.invars, eqn.invars, rewrite.ins),
    ):
        expected = len(old) + sum(m.num_arrays for m in metas)
        if len(new) != expected:
            raise HandlerError(
                prim,
                f"returned an equation with {len(new)} {what}; expected the {len(old)} "
                f"original ones followed by {expected - len(old)} array leaves, as many as "
                "its StateMetas count",
            )
    return rewrite


# ---- plumbing for handlers -----------------------------------------------------------------


def extend_equation(eqn: jex.JaxprEqn, rewritten: Rewritten, **params) -> Rewrite:
    """The `Rewrite` of an equation that runs `rewritten.jaxpr` in place of its own jaxpr:
    `eqn` with fresh output variables for the intermediates `rewritten` exposes, fresh input
    variables for the values it takes in, and `params` updated.

    Example, the whole of a handler for a call-like primitive:

        def handler(eqn):
            inner = pull_jaxpr(eqn.params["jaxpr"])
            return extend_equation(eqn, inner, jaxpr=inner.jaxpr)
    """
    in_avals, out_avals = _avals(rewritten.jaxpr)
    new = eqn.replace(
        invars=[*eqn.invars, *(jex.Var(a) for a in in_avals[len(eqn.invars) :])],
        outvars=[*eqn.outvars, *(jex.Var(a) for a in out_avals[len(eqn.outvars) :])],
        params=dict(eqn.params, **params),
    )
    return Rewrite(new, rewritten.outs, rewritten.ins)


def restage_equation(eqn: jex.JaxprEqn, outs: Sequence[StateMeta], **params) -> Rewrite:
    """The `Rewrite` of an equation whose `params`, updated, make it compute more outputs from
    the same inputs (the leaves of the intermediates `outs`): `eqn` with fresh output variables
    for them, typed, as its effects, by the primitive's abstract evaluation, with no trace.

    Example, a `scan` whose body returns its intermediates as extra `ys`:

        body = pull_jaxpr(parts.jaxpr)
        new = params.scan_params(eqn.params, parts._replace(jaxpr=body.jaxpr))
        return restage_equation(eqn, body.outs, **new)
    """
    new_params = dict(eqn.params, **params)
    out_avals, effects = _abstract_eval(eqn.primitive, [x.aval for x in eqn.invars], new_params)
    new = eqn.replace(
        outvars=[*eqn.outvars, *(jex.Var(a) for a in out_avals[len(eqn.outvars) :])],
        params=new_params,
        effects=effects,
    )
    return Rewrite(new, tuple(outs))


def _avals(jaxpr) -> tuple[list, list]:
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return list(jaxpr.in_avals), list(jaxpr.out_avals)
    return [x.aval for x in jaxpr.invars], [x.aval for x in jaxpr.outvars]


def call_equation(eqn: jex.JaxprEqn, rewritten: Rewritten) -> Rewrite:
    """A `closed_call` of `rewritten.jaxpr` (closed) on `eqn`'s inputs, in place of `eqn`."""
    call = eqn.replace(
        primitive=jex.primitives.closed_call_p,
        params={"call_jaxpr": rewritten.jaxpr},
        effects=rewritten.jaxpr.effects,
    )
    return extend_equation(call, rewritten)


def _abstract_eval(prim: jex.Primitive, in_avals: Sequence[Any], params: dict) -> tuple:
    """`(out_avals, effects)` of `prim` bound with `params` on `in_avals` (as a list, for
    primitives with one result too), without a trace."""
    out_avals, effects = prim.abstract_eval(*in_avals, **params)
    return (list(out_avals) if prim.multiple_results else [out_avals]), effects

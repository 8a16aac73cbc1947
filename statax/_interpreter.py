"""`pull_jaxpr`: the walk over a jaxpr, the handler registry, and the plumbing handlers share.

`pull_jaxpr` rewrites a jaxpr so that every value marked with `save_inter` leaves it as an extra
output, and every value that a mark takes in from outside (a planted value, see `take`) comes
from an extra input. It walks the equations once:

* a `save_inter` equation is removed: its outputs are its operands, appended to the jaxpr's
  outputs, described by the `StateMeta` in its params; or, for a mark that takes a value in,
  new variables appended to the jaxpr's inputs;
* an equation whose inner jaxprs hold no mark is kept as it is;
* any other equation goes to the handler registered for its primitive. There is one rule
  shape: a handler returns a `Rewrite`, an equation that takes the original inputs **followed
  by** the flat leaves of the values it takes in (`ins`) and computes the original outputs
  **followed by** the flat leaves of the intermediates it exposes (`outs`), with their
  `StateMeta`s in the same order. The walk appends those extra inputs and outputs to the
  jaxpr's own. A primitive with no handler is an error that names it and says how to register
  one.

Handlers for loops and branches are written as *exposers* (`register_exposer`), a layer on this
one contract: a function that runs the primitive with the marks taken out and binds them again
outside it, traced and walked into a `Rewrite`, and reused under `vmap`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from . import _compat, _equinox, _python_rules, _reduce, _staging
from ._errors import HandlerError, UnhandledPrimitiveError
from ._evaluator import keep
from ._evaluator import rewrite as rewrite_jaxpr
from ._meta import StateMeta
from ._primitive import COLLECTING, IDLE, INERT, INPUT, collected, save_inter_p

__all__ = [
    "Exposer",
    "Handler",
    "Rewrite",
    "Rewritten",
    "acts_on",
    "call_equation",
    "extend_equation",
    "find_saves",
    "find_saves_in_impl",
    "handler_from_exposer",
    "inert",
    "map_jaxprs",
    "mark",
    "on_forget",
    "only_in",
    "pull_collected",
    "pull_jaxpr",
    "pull_open_jaxpr",
    "pull_staged",
    "pulled_with_rule",
    "register_exposer",
    "register_family",
    "register_handler",
    "restage_equation",
    "selecting",
    "split_leaves",
    "take",
    "traced_impl",
    "unregister_family",
    "unregister_handler",
    "zero_tangent",
]


class Rewrite(NamedTuple):
    """What a handler returns for an equation: the one rule shape.

    Attributes:
        eqn: the new equation. Its inputs are the original ones followed by the flat array
            leaves of each value in `ins`; its outputs are the original ones followed by the
            flat array leaves of each intermediate in `outs`.
        outs: one `StateMeta` per intermediate the equation exposes, in order.
        ins: one `StateMeta` per value the equation takes in (a planted mark), in order.
    """

    eqn: jex.JaxprEqn
    outs: tuple[StateMeta, ...] = ()
    ins: tuple[StateMeta, ...] = ()


class Rewritten(NamedTuple):
    """What `pull_jaxpr` returns: the rewritten jaxpr, which takes the original inputs followed
    by the leaves of `ins` and returns the original outputs followed by the leaves of `outs`."""

    jaxpr: Any  # a ClosedJaxpr, or an open Jaxpr for `pull_open_jaxpr`
    outs: tuple[StateMeta, ...] = ()
    ins: tuple[StateMeta, ...] = ()


Handler: TypeAlias = Callable[[jex.JaxprEqn], Rewrite]

_HANDLERS: dict[jex.Primitive, Handler] = {}
_FINDERS: dict[jex.Primitive, Callable[[jex.JaxprEqn], tuple[StateMeta, ...]]] = {}
# Handlers for families of primitives, recognised by their equations: (matches, handler, finder).
# (matches, handler, finder, (thread_state, runs), flags)
_FAMILIES: list[tuple[Callable[[jex.JaxprEqn], bool], Handler, Callable | None, tuple, Any]] = []
# How `stateful` threads state through a primitive, where its handler module says (see
# `register_handler`'s `thread_state`).
_STATE_RULES: dict[jex.Primitive, tuple[Callable | None, Callable | None]] = {}
# The one owner of statax's batching rules for JAX's primitives: primitive -> _Batching. An
# exposer (`register_exposer`) and guards (`register_batching_guard`) share one rule, installed
# once and JAX's own given back when neither is left.
_BATCHING: dict[jex.Primitive, _Batching] = {}
_ON_FORGET: list[Callable[[], None]] = []


class Flags(NamedTuple):
    """What a handler declares of its primitive for the drivers (see `register_handler`)."""

    selectable: bool = False
    runs_python: bool | None = None


_FLAGS: dict[jex.Primitive, Flags] = {}
_NO_FLAGS = Flags()


def register_handler(
    primitive: jex.Primitive,
    handler: Handler | None = None,
    *,
    find_saves: Callable[[jex.JaxprEqn], tuple[StateMeta, ...]] | None = None,
    thread_state: Callable | None = None,
    runs: Callable[[jex.JaxprEqn], jex.ClosedJaxpr | None] | None = None,
    selectable: bool = False,
    runs_python: bool | None = None,
) -> Handler | Callable[[Handler], Handler]:
    """Teach `pull` to see inside a higher-order primitive.

    A handler takes an equation of `primitive` and returns a `Rewrite(new_eqn, outs, ins)`:
    `new_eqn` takes the original inputs followed by the flat leaves of the values in `ins`, and
    computes the original outputs followed by the flat array leaves of every intermediate in
    `outs`. Most handlers call `pull_jaxpr` on the inner jaxpr and `extend_equation` to
    rebuild the equation; loops and branches are written as exposers (`register_exposer`).

    Usable directly, `register_handler(my_p, my_handler)`, or as a decorator,
    `@register_handler(my_p)`. Registering again replaces the previous handler;
    `unregister_handler` removes it.

    Args:
        primitive: the primitive, e.g. `jax.extend.core.primitives.cond_p`.
        handler: the handler; if omitted, `register_handler` returns a decorator.
        find_saves: for a primitive whose inner functions are not jaxprs in its params
            (so `pull` cannot look for marks in them): `find_saves(eqn)` returns the metas
            of the marks the equation holds. By default `pull` looks in the jaxprs of
            `eqn.params`.
        thread_state: how `stateful` threads named state through an equation of
            `primitive` that reads or sets it: `thread_state(eqn, invals, threading) -> outs`
            evaluates the equation on `invals` in the current trace, threading the state of
            `threading` (a `statax.extend.Threading`) through its functions. By default
            state is threaded on the handler's own contract, as values that come in
            (`take`) and go out (`mark`), each of the primitive's functions threaded on its
            own: right for a primitive that calls its functions once, as a call does. A
            loop (state carried) or a branch (state selected) needs a rule.
        runs: for a primitive whose functions are not jaxprs in its params (an equinox
            filter primitive runs Python functions it holds): `runs(eqn)` traces what an
            equation runs, as a jaxpr of the equation's inputs and outputs (or `None`). Under
            `stateful` the state its functions read and set shows there, and an equation
            whose functions touch state is evaluated by threading that jaxpr (as a call).
        selectable: whether selections (`stx.scopes`, `stx.lines`, `stx.primitives`) reach
            into the jaxprs in its params: an equation whose jaxprs are evaluated again, with
            marks in them, must take them as it took the old ones (the same inputs and
            outputs), as a call, a loop or a branch does. Elsewhere a selection of a place
            inside is an error that names the primitive.
        runs_python: whether its rules may run Python functions held in its params, whose
            marks no jaxpr shows (`pull` then traces its impl to find them). `None`: statax
            decides from its impl and params (`_python_rules.runs_python`); `False` for a
            primitive whose impl runs only its jaxprs (a call, a loop, a branch).

    Returns:
        The handler (or the decorator).
    """
    if not isinstance(primitive, jex.Primitive):
        raise TypeError(
            f"register_handler needs a jax.extend.core.Primitive, got {primitive!r}. Pass the "
            "primitive object itself, e.g. jax.extend.core.primitives.closed_call_p."
        )

    def register(h: Handler) -> Handler:
        if not callable(h):
            raise TypeError(f"a handler must be callable, got {h!r}")
        _HANDLERS[primitive] = h
        _FINDERS.pop(primitive, None)
        _STATE_RULES.pop(primitive, None)
        _FLAGS[primitive] = Flags(selectable, runs_python)
        if find_saves is not None:
            _FINDERS[primitive] = find_saves
        if thread_state is not None or runs is not None:
            _STATE_RULES[primitive] = (thread_state, runs)
        _forget_rewrites()
        return h

    return register if handler is None else register(handler)


def unregister_handler(primitive: jex.Primitive) -> None:
    """Remove `primitive`'s handler (and, for an exposer, give JAX its batching rule back):
    `pull` then treats its equations as it treats any primitive without one."""
    _HANDLERS.pop(primitive, None)
    _FINDERS.pop(primitive, None)
    _STATE_RULES.pop(primitive, None)
    _FLAGS.pop(primitive, None)
    if primitive in _BATCHING:
        _BATCHING[primitive].exposer = None
        _settle_batching(primitive)
    _forget_rewrites()


def register_family(
    matches: Callable[[jex.JaxprEqn], bool],
    handler: Handler,
    *,
    find_saves: Callable[[jex.JaxprEqn], tuple[StateMeta, ...]] | None = None,
    thread_state: Callable | None = None,
    runs: Callable[[jex.JaxprEqn], jex.ClosedJaxpr | None] | None = None,
    selectable: bool = False,
    runs_python: bool | None = None,
) -> None:
    """`register_handler` for a family of primitives that is open-ended (every equinox filter
    primitive, whichever library defines it): `handler` (and `find_saves`, `thread_state`,
    `runs` and the flags) serve every equation of a primitive with no handler of its own for
    which `matches(eqn)` is true."""
    flags = Flags(selectable, runs_python)
    _FAMILIES.append((matches, handler, find_saves, (thread_state, runs), flags))
    _forget_rewrites()


def unregister_family(matches: Callable[[jex.JaxprEqn], bool]) -> None:
    """Remove the family registered with `matches`."""
    _FAMILIES[:] = [f for f in _FAMILIES if f[0] is not matches]
    _forget_rewrites()


def on_forget(callback: Callable[[], None]) -> None:
    """Call `callback` whenever the handlers change (for caches of rewrites kept elsewhere)."""
    _ON_FORGET.append(callback)


def _forget_rewrites() -> None:
    """Drop every cached search and rewrite: a new handler may see what the old ones could not."""
    for cache in (_SAVES, _PULLED, _PULLED_OPEN, _INERT, _IMPLS):
        cache.clear()
    for callback in _ON_FORGET:
        callback()


def _rules_for(eqn: jex.JaxprEqn) -> tuple[Handler | None, Callable | None]:
    """`(handler, finder)` for `eqn`: its primitive's, else its family's, else `(None, None)`."""
    handler = _HANDLERS.get(eqn.primitive)
    if handler is not None:
        return handler, _FINDERS.get(eqn.primitive)
    for matches, handler, finder, _, _ in _FAMILIES:
        if matches(eqn):
            return handler, finder
    return None, None


def handler_for(eqn: jex.JaxprEqn) -> Handler | None:
    """`eqn`'s handler: its primitive's, else its family's, else `None`."""
    return _rules_for(eqn)[0]


def state_rules_for(eqn: jex.JaxprEqn) -> tuple[Callable | None, Callable | None]:
    """`(thread_state, runs)` for `eqn` (see `register_handler`): its primitive's, else its
    family's, else `(None, None)`."""
    if eqn.primitive in _STATE_RULES:
        return _STATE_RULES[eqn.primitive]
    if eqn.primitive in _HANDLERS:
        return None, None
    for matches, _, _, rules, _ in _FAMILIES:
        if matches(eqn):
            return rules
    return None, None


def flags_for(eqn: jex.JaxprEqn) -> Flags:
    """What `eqn`'s handler declared of its primitive (see `register_handler`): its
    primitive's, else its family's, else the defaults (no handler: nothing declared)."""
    flags = _FLAGS.get(eqn.primitive)
    if flags is not None:
        return flags
    if eqn.primitive not in _HANDLERS:
        for matches, _, _, _, family_flags in _FAMILIES:
            if matches(eqn):
                return family_flags
    return _NO_FLAGS


# ---- which marks a rewrite acts on ----------------------------------------------------------

# The selection of the `pull` in force (`pull(fn, only=...)`): a predicate on StateMeta or None,
# a config state in JAX's trace context (`_compat.SELECTION`), as the scope is: `save_inter`
# decides where it is bound whether it collects, and JAX keeps traces made under one selection
# apart from the others. Caches below are kept per selection.


@contextlib.contextmanager
def selecting(selection: Callable[[StateMeta], bool] | None):
    """Within, marks are bound and `pull_jaxpr` collects only where `selection` accepts their
    meta; the others are plain identities (their work, if nothing else needs it, compiles
    away)."""
    with _compat.SELECTION(selection):
        yield


def current_selection() -> Callable[[StateMeta], bool] | None:
    """The selection of the `pull` tracing (`pull(fn, only=...)`), a predicate on `StateMeta`,
    or `None` (every mark): for caches kept per selection."""
    return _compat.SELECTION.value


def pulling():
    """Within, marks are bound as a tracing `pull` binds them (collected, `only=` applied):
    for a handler that traces a function JAX would trace only later (a custom rule)."""
    return _compat.PULLING(True)


def pull_differentiates() -> bool:
    """Whether the `pull` tracing has inputs that are differentiated (`jax.jvp(pull(f))`,
    `jax.grad(pull(f))`): then custom rules run, and their marks are keys."""
    return bool(_compat.DIFFERENTIATING.value)


def _selected(meta: StateMeta) -> bool:
    selection = _compat.SELECTION.value
    return selection is None or bool(selection(meta))


def acts_on(params: dict) -> bool:
    """Whether the walk does something with a mark: collects it, or feeds its value in."""
    if params["status"] == INPUT:
        return True
    return collected(params) and _selected(params["meta"])


def _cached(store: weakref.WeakKeyDictionary, key, compute):
    per_rewrite = store.get(key)
    if per_rewrite is None:
        per_rewrite = store[key] = {}
    selection = _compat.SELECTION.value
    if selection not in per_rewrite:
        per_rewrite[selection] = compute()
    return per_rewrite[selection]


# ---- finding marks -------------------------------------------------------------------------

_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_saves(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> tuple[StateMeta, ...]:
    """The `StateMeta` of every mark in `jaxpr` that the walk acts on (collecting it, of the
    current selection only inside a `pull(fn, only=...)`, or feeding its value in), at any
    depth, in order."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return _marks(jaxpr)[0]


def _marks(jaxpr: jex.Jaxpr) -> tuple[tuple[StateMeta, ...], list[tuple[StateMeta, ...]]]:
    """`(find_saves(jaxpr), per_eqn)`: also the marks of each equation (kept for the walk)."""
    return _cached(_SAVES, jaxpr, lambda: _saves_in(jaxpr.eqns))


def _saves_in(eqns: Sequence[jex.JaxprEqn]) -> tuple[tuple[StateMeta, ...], list]:
    per_eqn = []
    for eqn in eqns:
        if eqn.primitive is save_inter_p:
            per_eqn.append((eqn.params["meta"],) if acts_on(eqn.params) else ())
        else:
            per_eqn.append(_eqn_saves(eqn))
    return tuple(m for found in per_eqn for m in found), per_eqn


def _known_marks(jaxpr: jex.Jaxpr, marks: tuple) -> None:
    """Record `_marks(jaxpr)`, worked out otherwise (for the current selection)."""
    _SAVES.setdefault(jaxpr, {})[_compat.SELECTION.value] = marks


def _eqn_saves(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    # (`eqn` may be an equation as a trace holds it, `_staging.staged_as_held`: a finder gets it
    # as a `JaxprEqn`.)
    _, finder = _rules_for(eqn)
    if finder is not None:
        return tuple(finder(_staging.as_equation(eqn)))
    if not eqn.params:
        return ()
    found: tuple[StateMeta, ...] = ()
    for sub in _compat.jaxprs_in_params(eqn.params):
        found += find_saves(sub)
    if found:
        return found
    runs_python = flags_for(eqn).runs_python
    if not (_python_rules.runs_python(eqn) if runs_python is None else runs_python):
        return found
    return find_saves_in_impl(eqn)


# Equations whose impl was traced to look for marks, and what it gave (bounded; the equation is
# held so that its id is not reused).
_IMPLS: OrderedDict = OrderedDict()


# What an impl that cannot be traced abstractly raises (it needs concrete values): its rules
# cannot hold marks that a trace could see. Anything else is raised.
_NOT_ABSTRACT = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    NotImplementedError,
)


def trace_impl(eqn: jex.JaxprEqn, impl: Callable | None = None) -> jex.ClosedJaxpr | None:
    """`eqn`'s primitive's impl rule (or `impl`, one of its kind), traced at the equation's
    input types in the current context, or `None` where it cannot be traced abstractly."""
    try:
        return _compat.trace(
            lambda *args: _python_rules.run_impl(eqn, args, impl),
            [x.aval for x in eqn.invars],
            name=str(eqn.primitive),
        )
    except _NOT_ABSTRACT:
        return None


def traced_impl(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr | None:
    """`eqn`'s primitive's impl rule traced at its input types, with marks collectable (as a
    `pull` traces them), or `None` where the impl cannot be traced abstractly. For primitives
    whose rules run Python code from their params: the marks of that code show up here."""
    key = id(eqn)
    hit = _IMPLS.get(key)
    if hit is not None and hit[0] is eqn:
        return hit[1]
    with _compat.PULLING(True):
        closed = trace_impl(eqn, _equinox.impl_of(eqn))
    _IMPLS[key] = (eqn, closed)
    if len(_IMPLS) > 256:
        _IMPLS.popitem(last=False)
    return closed


def find_saves_in_impl(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    """The marks that `eqn`'s impl rule runs (see `traced_impl`)."""
    closed = traced_impl(eqn)
    return () if closed is None else find_saves(closed)


# ---- the walk ------------------------------------------------------------------------------

_PULLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PULLED_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    return _cached(_PULLED, closed_jaxpr, lambda: _pull_closed(closed_jaxpr))


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
        debug_info = _compat.extend_debug_info(jaxpr.debug_info, names, keep=num_out)
        return _folded(jaxpr.replace(debug_info=debug_info), closed_jaxpr.consts, metas)
    # Put each collected mark back where it was made, as the equation a bind would have
    # staged, and walk the whole.
    eqns: list[jex.JaxprEqn] = []
    per_eqn: list[tuple[StateMeta, ...]] = []  # the marks of each, from those found already
    found = _marks(jaxpr)[1]
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
            _compat.new_equation(invars, outvars, save_inter_p, params, {_compat.SAVE_EFFECT})
        )
        per_eqn.append((meta,))
    eqns.extend(jaxpr.eqns[done:])
    per_eqn.extend(found[done:])
    restored = jaxpr.replace(
        eqns=eqns,
        outvars=jaxpr.outvars[:num_out],
        debug_info=_compat.extend_debug_info(jaxpr.debug_info, [], keep=num_out),
    )
    _known_marks(restored, (tuple(m for ms in per_eqn for m in ms), per_eqn))
    return pull_jaxpr(jex.ClosedJaxpr(restored, closed_jaxpr.consts))


def pull_staged(trace, start: int, outs: Sequence, collector) -> tuple[list, list, tuple]:
    """`pull_collected` for a function traced straight into `trace` (`_staging.staging_trace`),
    from its position `start` on, with `collector` taking the marks made at `trace`'s level:
    the equations it staged that hold marks are rewritten in place, in `trace`.

    Returns `(outs, leaves, metas)`: `outs` (the function's flat outputs) as they now are, the
    flat leaves of the intermediates, and their metas, in program order."""
    metas = tuple(meta for _, meta in collector.marks)
    marks_in = _saves_in(_staging.staged_as_held(trace, start))
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
    jaxpr = jex.Jaxpr([], [], outvars, eqns, effects, _compat.debug_info("pull"))
    _known_marks(jaxpr, marks_in)
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

    closed = _compat.trace(fold, [x.aval for x in leaves], name="reduce")
    outvars = [jex.Var(aval) for aval in closed.out_avals]
    eqn = _compat.new_equation(
        leaves, outvars, jex.primitives.closed_call_p, {"call_jaxpr": closed}, closed.effects
    )
    names = [f"statax:{m.name}" for m in merged[0] for _ in range(m.num_arrays)]
    new = jaxpr.replace(
        eqns=[*jaxpr.eqns, eqn],
        outvars=[*jaxpr.outvars[:num_out], *outvars],
        debug_info=_compat.extend_debug_info(jaxpr.debug_info, names, keep=num_out),
    )
    return new, merged[0]


def pull_open_jaxpr(jaxpr: jex.Jaxpr) -> Rewritten:
    """`pull_jaxpr` for an open `Jaxpr` (as `jax.checkpoint` keeps in its params).

    Occurrences of reduced names are not folded here but by the enclosing `pull_jaxpr`."""
    return _cached(
        _PULLED_OPEN, jaxpr, lambda: _pull(jaxpr) if find_saves(jaxpr) else Rewritten(jaxpr)
    )


def _pull(jaxpr: jex.Jaxpr) -> Rewritten:
    extra_out: list[jex.Atom] = []
    outs: list[StateMeta] = []
    extra_in: list[jex.Var] = []
    ins: list[StateMeta] = []
    marks = iter(_marks(jaxpr)[1])  # the marks each equation holds, in order

    def step(eqn, invars, emit):
        inner = next(marks)
        if eqn.primitive is save_inter_p:  # removed: its outputs are its operands
            meta = eqn.params["meta"]
            if eqn.params["status"] == INPUT:
                invars = [jex.Var(x.aval) for x in eqn.outvars]
                extra_in.extend(invars)
                ins.append(meta)
            elif collected(eqn.params) and _selected(meta):
                extra_out.extend(invars)
                outs.append(meta)
            return invars if eqn.outvars else []  # (an idle mark has none)
        if not inner:
            return keep(eqn, invars, emit)
        handler, _ = _rules_for(eqn)
        if handler is None:
            in_rules = not any(_compat.jaxprs_in_params(eqn.params))
            raise UnhandledPrimitiveError(eqn.primitive, inner, in_rules=in_rules)
        if any(a is not b for a, b in zip(invars, eqn.invars, strict=True)):
            eqn = eqn.replace(invars=invars)  # (reading the operands of removed marks)
        with _compat.user_context(eqn):
            rewrite = _check_handler_result(eqn, handler(eqn))
        new_eqn = rewrite.eqn
        emit(new_eqn.replace(effects=_without_save_effect(new_eqn.effects)))
        extra_out.extend(new_eqn.outvars[len(eqn.outvars) :])
        outs.extend(rewrite.outs)
        extra_in.extend(new_eqn.invars[len(eqn.invars) :])
        ins.extend(rewrite.ins)
        return new_eqn.outvars[: len(eqn.outvars)]

    eqns, outvars = rewrite_jaxpr(jaxpr, step)
    names = [f"statax:{m.name}" for m in outs for _ in range(m.num_arrays)]
    in_names = [f"statax:{m.name}" for m in ins for _ in range(m.num_arrays)]
    new = jaxpr.replace(
        eqns=eqns,
        invars=[*jaxpr.invars, *extra_in],
        outvars=[*outvars, *extra_out],
        effects=_without_save_effect(jaxpr.effects),
        debug_info=_compat.extend_debug_info(jaxpr.debug_info, names, arg_names=in_names),
    )
    return Rewritten(new, tuple(outs), tuple(ins))


def _without_save_effect(effects):
    # Once pulled, no mark is left inside, and so neither is the effect marks carry.
    return effects - {_compat.SAVE_EFFECT} if _compat.SAVE_EFFECT in effects else effects


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
    out_avals, effects = _compat.abstract_eval(
        eqn.primitive, [x.aval for x in eqn.invars], new_params
    )
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


Exposer: TypeAlias = Callable[..., Sequence]


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
        closed = _compat.trace(
            lambda *args: exposer(*args, **eqn.params),
            [x.aval for x in eqn.invars],
            name=str(eqn.primitive),
        )
        jaxpr, outs, ins = pull_open_jaxpr(closed.jaxpr)
        return call_equation(eqn, Rewritten(jex.ClosedJaxpr(jaxpr, closed.consts), outs, ins))

    return handler


def register_exposer(primitive: jex.Primitive, exposer: Exposer, **declared) -> None:
    """Register `exposer` both as `primitive`'s handler and, under `vmap`, as the way the
    primitive is batched where it holds marks (see `handler_from_exposer`).

    JAX batches a `cond`, `scan` or `while` as a whole, before `pull` sees it (a batched `cond`
    even becomes a select over both branches). Where such a primitive holds marks, while a
    `pull` traces, the exposer runs per example and is batched with JAX's own rules: the
    primitive inside holds no marks any more, so it is batched by its own rule, and the marks
    bound outside it by the mark's. Elsewhere JAX's rule runs untouched.

    `declared` (`thread_state` and the flags) are `register_handler`'s.
    """
    register_handler(primitive, handler_from_exposer(exposer), **declared)
    _batching(primitive).exposer = exposer


def register_batching_guard(primitive: jex.Primitive, guard: Callable) -> None:
    """Run `guard(axis_data, dims, params)` before `primitive` is batched (it raises where the
    batching would be wrong), whatever else batches it. Kept by `unregister_handler`."""
    _batching(primitive).guards.append(guard)


@dataclasses.dataclass
class _Batching:
    original: Callable | None  # JAX's own rule
    exposer: Exposer | None = None
    guards: list = dataclasses.field(default_factory=list)


def _batching(primitive: jex.Primitive) -> _Batching:
    entry = _BATCHING.get(primitive)
    if entry is None:
        entry = _BATCHING[primitive] = _Batching(_compat.batching_rule(primitive))

        def rule(axis_data, args, dims, **params):
            for guard in entry.guards:
                guard(axis_data, dims, params)
            exposer = entry.exposer
            if exposer is None or not _params_hold_marks(params):
                return entry.original(axis_data, args, dims, **params)
            return _compat.batch_traced(lambda *a: exposer(*a, **params), axis_data, args, dims)

        _compat.set_batching_rule(primitive, rule)
    return entry


def _settle_batching(primitive: jex.Primitive) -> None:
    """Give JAX its own batching rule back where statax has nothing left to add."""
    entry = _BATCHING[primitive]
    if entry.exposer is None and not entry.guards:
        _compat.set_batching_rule(primitive, _BATCHING.pop(primitive).original)


def _params_hold_marks(params: dict) -> bool:
    # Only while a `pull` traces: outside one, marks are plain identities, and JAX's own
    # batching rule is the cheapest.
    return bool(_compat.PULLING.value) and any(
        find_saves(sub) for sub in _compat.jaxprs_in_params(params)
    )


def mark(leaves: Sequence, metas: Sequence[StateMeta]) -> None:
    """Bind the intermediates `metas` describe (flat `leaves`) again, as marks: in an exposer,
    outside the primitive it took them out of."""
    for meta, part in zip(metas, split_leaves(leaves, metas), strict=True):
        save_inter_p.bind(*part, meta=meta, status=COLLECTING)


def take(metas: Sequence[StateMeta], avals: Sequence) -> list:
    """Values fed in from outside (flat leaves of `avals`, described by `metas`): in an exposer,
    what the primitive's rewritten jaxprs take in; in a planted mark, its replacement. The
    inverse of `mark`: each binds a placeholder mark that the walk turns into an input."""
    leaves: list = []
    for meta, part in zip(metas, split_leaves(avals, metas), strict=True):
        zeros = [jnp.zeros(a.shape, a.dtype) for a in part]
        leaves.extend(save_inter_p.bind(*zeros, meta=meta, status=INPUT))
    return leaves


def split_leaves(leaves: Sequence, metas: Sequence[StateMeta]) -> list[Sequence]:
    """Flat intermediate leaves, cut into one sequence per meta."""
    out, start = [], 0
    for meta in metas:
        out.append(leaves[start : start + meta.num_arrays])
        start += meta.num_arrays
    return out


_INERT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inert(jaxpr, which: Callable[[StateMeta], bool] | None = None):
    """`jaxpr` (open or closed) with every mark, at any depth, made inert (never collected); or,
    with `which`, the marks whose meta it accepts.

    For handlers that bind an equation as it was, to delegate to its own rules (custom
    derivatives, linear solves, see `pulled_with_rule`): its marks must not be collected again
    by an enclosing `pull`.
    """
    if _compat.wraps_jaxpr(jaxpr):
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
        elif _eqn_saves(eqn):
            eqn = eqn.replace(params=map_jaxprs(eqn.params, lambda j: inert(j, which)))
        if not _still_collects(eqn):
            eqn = eqn.replace(effects=_without_save_effect(eqn.effects))
        eqns.append(eqn)
    effects = jaxpr.effects
    if not any(_compat.SAVE_EFFECT in eqn.effects for eqn in eqns):
        effects = _without_save_effect(effects)
    return jaxpr.replace(eqns=eqns, effects=effects)


def _still_collects(eqn) -> bool:
    """Whether a mark in `eqn` still carries the effect of one a `pull` collects."""
    if eqn.primitive is save_inter_p:
        return eqn.params["status"] == COLLECTING
    return any(_compat.SAVE_EFFECT in sub.effects for sub in _compat.jaxprs_in_params(eqn.params))


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


def pulled_with_rule(
    original: Callable,
    primal: jex.ClosedJaxpr,
    args: Sequence,
    *,
    rule: str = "jvp",
    extra: tuple[jex.ClosedJaxpr, tuple[StateMeta, ...]] | None = None,
) -> list:
    """In an exposer, for an equation with rules of its own (custom derivatives, linear solves,
    hijax and equinox primitives): its outputs, computed once by its pulled `primal`, its
    intermediates marked outside.

    `original(*args)` binds the equation as it was (its marks inert); `primal` is a jaxpr that
    computes the same outputs from the same `args` and holds the marks. The pulled `primal`
    runs as a `jax.custom_jvp` (`rule="jvp"`) or `jax.custom_vjp` (`rule="vjp"`, for an
    equation that only has a VJP) whose rule is `original`'s own, so derivatives (and their
    transposes) are the equation's; the intermediates get zero tangents. Only when
    differentiated does the pulled primal also run, behind `stop_gradient`, beside the original
    rule. A loop inside runs once, as unpulled.

    Where a value is planted inside (it takes values in), the function is no longer the one its
    rule describes: it runs as written and is differentiated as written.

    `extra`, `(jaxpr, metas)`: intermediates of the rule itself (see
    `handlers.custom_derivatives`), which `jaxpr` computes from the last of `args`: they are
    computed beside the rule where it runs (the result is differentiated), and are zeros where
    it does not, as a `cond` branch that did not run.
    """
    pulled, metas, ins = pull_jaxpr(primal)
    n = len(primal.out_avals)
    run_pulled = jex.jaxpr_as_fun(pulled)
    run_rule: Callable = lambda *args: ()  # noqa: E731
    if extra is not None:
        closed, more = extra
        metas = (*metas, *more)
        run_rule = _on_last(jex.jaxpr_as_fun(closed), len(closed.in_avals))
    if ins:
        flat = [
            *run_pulled(*args, *take(ins, pulled.in_avals[len(args) :])),
            *_not_run(run_rule, args),
        ]
    else:
        wrap = _with_jvp if rule == "jvp" else _with_vjp
        flat = wrap(original, run_pulled, run_rule, n)(*args)
    mark(flat[n:], metas)
    return list(flat[:n])


def _on_last(fn: Callable, k: int) -> Callable:
    def on_last(*args):
        return fn(*args[len(args) - k :])

    return on_last


def _not_run(run_rule: Callable, args: Sequence) -> list:
    """Zeros in place of what `run_rule` computes, batched under `vmap` as it would be (as the
    rule's own outputs are, which JAX requires of a custom function's primal); the compiler
    removes the computation."""
    return [jnp.where(True, _compat.zeros(jax.typeof(v)), v) for v in run_rule(*args)]


def _with_jvp(original, run_pulled, run_rule, n):
    @jax.custom_jvp
    def run(*args):
        return (*run_pulled(*args), *_not_run(run_rule, args))

    def run_jvp(primals, tangents):
        # Differentiate `original` only where a tangent is not a symbolic zero: the other
        # inputs (a solver's state, say) are constants to it, as they were to the equation.
        live = [i for i, t in enumerate(tangents) if not isinstance(t, _compat.SymbolicZero)]
        outs, out_tangents = jax.jvp(
            only_in(original, primals, live),
            [primals[i] for i in live],
            [tangents[i] for i in live],
        )
        fixed = list(map(jax.lax.stop_gradient, primals))
        saved = (*run_pulled(*fixed)[n:], *run_rule(*fixed))
        return (*outs, *saved), (*out_tangents, *map(zero_tangent, saved))

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run


def _with_vjp(original, run_pulled, run_rule, n):
    @jax.custom_vjp
    def run(*args):
        return (*run_pulled(*args), *_not_run(run_rule, args))

    live: list[int] = []  # the perturbed arguments, as `fwd` found them for `bwd`
    arity: list[int] = []

    def fwd(*args):
        # Differentiate `original` only in the perturbed arguments: the others are constants
        # to it, as they were to the equation (equinox's `filter_custom_vjp` checks this).
        values = [a.value for a in args]
        live[:] = [i for i, a in enumerate(args) if a.perturbed]
        arity[:] = [len(args)]
        outs, vjp = jax.vjp(only_in(original, values, live), *[values[i] for i in live])
        fixed = list(map(jax.lax.stop_gradient, values))
        saved = (*run_pulled(*fixed)[n:], *run_rule(*fixed))
        return (*outs, *saved), vjp

    def bwd(vjp, cts):
        cts = [_instantiate(ct) for ct in cts[:n]]
        grads = dict(zip(live, vjp(tuple(cts)), strict=True))
        return tuple(grads.get(i) for i in range(arity[0]))

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def _instantiate(ct):
    if not isinstance(ct, _compat.SymbolicZero):
        return ct
    return zero_tangent(jax.ShapeDtypeStruct(ct.shape, ct.aval.dtype))


def only_in(fn: Callable, args: Sequence, live: Sequence[int]) -> Callable:
    """`fn` as a function of `args[i]` for `i` in `live` only, the others fixed: what a custom
    rule differentiates, so that unperturbed inputs stay constants, as they were to `fn`."""

    def of_live(*xs):
        full = list(args)
        for i, x in zip(live, xs, strict=True):
            full[i] = x
        return fn(*full)

    return of_live


def zero_tangent(x):
    """The zero tangent of a value: zeros of its dtype, or `float0` zeros for an integer."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)

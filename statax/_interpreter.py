"""`pull_jaxpr`: the walk over a jaxpr, the handler registry, and the plumbing handlers share.

`pull_jaxpr` rewrites a jaxpr so that every value marked with `save_inter` leaves it as an extra
output. It walks the equations once:

* a `save_inter` equation is removed: its outputs are its operands, and its operands are
  appended to the jaxpr's outputs, described by the `StateMeta` in its params;
* an equation whose inner jaxprs hold no mark is kept as it is;
* any other equation goes to the handler registered for its primitive, which returns an
  equation that computes the original outputs **followed by** the flat leaves of the
  intermediates it exposes, and their `StateMeta`s in the same order. A primitive with no
  handler is an error that names it and says how to register one.

The handler contract leaves room for transforms that thread values *into* an equation (extra
inputs, appended after the original ones); `pull` itself only adds outputs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from . import _compat, _equinox, _reduce
from ._errors import HandlerError, UnhandledPrimitiveError
from ._meta import StateMeta
from ._primitive import INERT, bound_status, collected, save_inter_p

__all__ = [
    "Exposer",
    "Handler",
    "call_equation",
    "handler_from_exposer",
    "inert",
    "mark",
    "only_in",
    "register_exposer",
    "split_leaves",
    "find_saves",
    "find_saves_in_impl",
    "pull_jaxpr",
    "pull_open_jaxpr",
    "pulled_with_rule",
    "register_family",
    "register_handler",
    "traced_impl",
    "with_extra_outputs",
    "zero_tangent",
]

Handler: TypeAlias = Callable[[jex.JaxprEqn], tuple[jex.JaxprEqn, tuple[StateMeta, ...]]]

_HANDLERS: dict[jex.Primitive, Handler] = {}


_FINDERS: dict[jex.Primitive, Callable[[jex.JaxprEqn], tuple[StateMeta, ...]]] = {}

# Handlers for families of primitives, recognised by their equations: (matches, handler, finder).
_FAMILIES: list[tuple[Callable[[jex.JaxprEqn], bool], Handler, Callable | None]] = []


def register_handler(
    primitive: jex.Primitive,
    handler: Handler | None = None,
    *,
    find_saves: Callable[[jex.JaxprEqn], tuple[StateMeta, ...]] | None = None,
):
    """Teach `pull` to see inside a higher-order primitive.

    A handler takes an equation of `primitive` and returns `(new_eqn, metas)`: `new_eqn`
    computes the original outputs followed by the flat array leaves of every intermediate it
    exposes, and `metas` describes those intermediates in the same order. Most handlers call
    `pull_jaxpr` on the inner jaxpr and `with_extra_outputs` to rebuild the equation.

    Usable directly, `register_handler(my_p, my_handler)`, or as a decorator,
    `@register_handler(my_p)`. Registering again replaces the previous handler.

    Args:
        primitive: the primitive, e.g. `jax.extend.core.primitives.cond_p`.
        handler: the handler; if omitted, `register_handler` returns a decorator.
        find_saves: for a primitive whose inner functions are not jaxprs in its params
            (so `pull` cannot look for marks in them): `find_saves(eqn)` returns the metas
            of the marks the equation holds. By default `pull` looks in the jaxprs of
            `eqn.params`.

    Returns:
        The handler (or the decorator).
    """
    if not isinstance(primitive, jex.Primitive):
        raise TypeError(
            f"register_handler needs a jax.extend.core.Primitive, got {primitive!r}. Pass the "
            "primitive object itself, e.g. jax.extend.core.primitives.cond_p."
        )

    def register(h: Handler) -> Handler:
        if not callable(h):
            raise TypeError(f"a handler must be callable, got {h!r}")
        _HANDLERS[primitive] = h
        if find_saves is not None:
            _FINDERS[primitive] = find_saves
        _forget_rewrites()
        return h

    return register if handler is None else register(handler)


def register_family(
    matches: Callable[[jex.JaxprEqn], bool],
    handler: Handler,
    *,
    find_saves: Callable[[jex.JaxprEqn], tuple[StateMeta, ...]] | None = None,
) -> None:
    """`register_handler` for a family of primitives that is open-ended (every equinox filter
    primitive, whichever library defines it): `handler` (and `find_saves`) serve every
    equation of a primitive with no handler of its own for which `matches(eqn)` is true."""
    _FAMILIES.append((matches, handler, find_saves))
    _forget_rewrites()


def _forget_rewrites() -> None:
    """Drop cached searches and rewrites: a new handler may see what the old ones could not."""
    _SAVES.clear()
    _PULLED.clear()
    _PULLED_OPEN.clear()


def _rules_for(eqn: jex.JaxprEqn) -> tuple[Handler | None, Callable | None]:
    """`(handler, finder)` for `eqn`: its primitive's, else its family's, else `(None, None)`."""
    handler = _HANDLERS.get(eqn.primitive)
    if handler is not None:
        return handler, _FINDERS.get(eqn.primitive)
    for matches, handler, finder in _FAMILIES:
        if matches(eqn):
            return handler, finder
    return None, None


# ---- finding marks -------------------------------------------------------------------------

# The selection of the `pull` in force (`pull(fn, only=...)`): a predicate on StateMeta, or
# None for every mark. A config state in JAX's trace context (`_compat.SELECTION`), as the
# scope is: `save_inter` decides where it is bound whether it collects, and JAX keeps traces
# made under one selection apart from the others. Caches below are kept per selection.


@contextlib.contextmanager
def selecting(selection: Callable[[StateMeta], bool] | None):
    """Within, marks are bound and `pull_jaxpr` collects only where `selection` accepts their
    meta; the others are plain identities (their work, if nothing else needs it, compiles
    away)."""
    with _compat.SELECTION(selection):
        yield


def _selected(meta: StateMeta) -> bool:
    selection = _compat.SELECTION.value
    return selection is None or bool(selection(meta))


def _cached(store: weakref.WeakKeyDictionary, key, compute):
    per_selection = store.get(key)
    if per_selection is None:
        per_selection = store[key] = {}
    selection = _compat.SELECTION.value
    if selection not in per_selection:
        per_selection[selection] = compute()
    return per_selection[selection]


_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_saves(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> tuple[StateMeta, ...]:
    """The `StateMeta` of every collecting `save_inter` in `jaxpr`, at any depth, in order
    (those of the current selection only, inside a `pull(fn, only=...)`)."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return _cached(_SAVES, jaxpr, lambda: tuple(_iter_saves(jaxpr)))


def _iter_saves(jaxpr: jex.Jaxpr) -> Iterator[StateMeta]:
    for eqn in jaxpr.eqns:
        if eqn.primitive is save_inter_p:
            if collected(eqn.params) and _selected(eqn.params["meta"]):
                yield eqn.params["meta"]
        else:
            yield from _eqn_saves(eqn)


def _eqn_saves(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    _, finder = _rules_for(eqn)
    if finder is not None:
        return tuple(finder(eqn))
    found = tuple(m for sub in _compat.jaxprs_in_params(eqn.params) for m in find_saves(sub))
    if found or not _compat.runs_python(eqn):
        return found
    return find_saves_in_impl(eqn)


# Equations whose impl was traced to look for marks, and what it gave (bounded; the equation is
# held so that its id is not reused).
_IMPLS: OrderedDict = OrderedDict()


def traced_impl(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr | None:
    """`eqn`'s primitive's impl rule traced at its input types, with marks collectable (as a
    `pull` traces them), or `None` where the impl cannot be traced abstractly. For primitives
    whose rules run Python code from their params: the marks of that code show up here."""
    key = id(eqn)
    hit = _IMPLS.get(key)
    if hit is not None and hit[0] is eqn:
        return hit[1]
    try:
        with _compat.PULLING(True):
            closed = _compat.trace(
                lambda *args: _compat.run_impl(eqn, args, _equinox.impl_of(eqn)),
                [x.aval for x in eqn.invars],
                name=str(eqn.primitive),
            )
    except Exception:  # not traceable abstractly: its rules cannot hold marks we could see
        closed = None
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


def pull_jaxpr(closed_jaxpr: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, tuple[StateMeta, ...]]:
    """Expose every `save_inter` of a ClosedJaxpr as an extra output.

    Args:
        closed_jaxpr: the jaxpr to rewrite.

    Returns:
        `(new_closed_jaxpr, metas)`. `new_closed_jaxpr` takes the same inputs and returns the
        old outputs followed by the flat array leaves of each intermediate, in program order;
        `metas[i]` describes the i-th intermediate. A jaxpr without marks comes back as it is.
        Results are cached per jaxpr object.

    Raises:
        UnhandledPrimitiveError: a higher-order primitive without a handler holds a mark.
    """
    return _cached(_PULLED, closed_jaxpr, lambda: _pull_closed(closed_jaxpr))


def _pull_closed(closed_jaxpr):
    jaxpr, metas = pull_open_jaxpr(closed_jaxpr.jaxpr)
    if jaxpr is closed_jaxpr.jaxpr:
        return closed_jaxpr, metas
    if any(m.reduce is not None for m in metas):
        jaxpr, metas = _fold_reduced(jaxpr, metas)
    return jex.ClosedJaxpr(jaxpr, closed_jaxpr.consts), metas


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


def pull_open_jaxpr(jaxpr: jex.Jaxpr) -> tuple[jex.Jaxpr, tuple[StateMeta, ...]]:
    """`pull_jaxpr` for an open `Jaxpr` (as `jax.checkpoint` keeps in its params).

    Occurrences of reduced names are not folded here but by the enclosing `pull_jaxpr`."""
    return _cached(_PULLED_OPEN, jaxpr, lambda: _pull(jaxpr) if find_saves(jaxpr) else (jaxpr, ()))


def _pull(jaxpr: jex.Jaxpr) -> tuple[jex.Jaxpr, tuple[StateMeta, ...]]:
    forwarded: dict[jex.Var, jex.Atom] = {}  # outputs of removed `save_inter`s -> operands

    def read(x: jex.Atom) -> jex.Atom:
        return forwarded.get(x, x) if isinstance(x, jex.Var) else x

    eqns: list[jex.JaxprEqn] = []
    extra: list[jex.Atom] = []
    metas: list[StateMeta] = []
    for eqn in jaxpr.eqns:
        if forwarded:
            eqn = eqn.replace(invars=[read(x) for x in eqn.invars])
        if eqn.primitive is save_inter_p:
            for out, x in zip(eqn.outvars, eqn.invars, strict=True):
                forwarded[out] = x
            if collected(eqn.params) and _selected(eqn.params["meta"]):
                extra.extend(eqn.invars)
                metas.append(eqn.params["meta"])
            continue
        inner = _eqn_saves(eqn)
        if not inner:
            eqns.append(eqn)
            continue
        handler, _ = _rules_for(eqn)
        if handler is None:
            in_rules = not any(_compat.jaxprs_in_params(eqn.params))
            raise UnhandledPrimitiveError(eqn.primitive, inner, in_rules=in_rules)
        with _compat.user_context(eqn):
            new_eqn, new_metas = handler(eqn)
        _check_handler_result(eqn, new_eqn, new_metas)
        eqns.append(new_eqn.replace(effects=_without_save_effect(new_eqn.effects)))
        extra.extend(new_eqn.outvars[len(eqn.outvars) :])
        metas.extend(new_metas)
    names = [f"statax:{m.name}" for m in metas for _ in range(m.num_arrays)]
    new = jaxpr.replace(
        eqns=eqns,
        outvars=[read(x) for x in jaxpr.outvars] + extra,
        effects=_without_save_effect(jaxpr.effects),
        debug_info=_compat.extend_debug_info(jaxpr.debug_info, names),
    )
    return new, tuple(metas)


def _without_save_effect(effects):
    # Once pulled, no mark is left inside, and so neither is the effect marks carry.
    return effects - {_compat.SAVE_EFFECT} if _compat.SAVE_EFFECT in effects else effects


def _check_handler_result(eqn, new_eqn, metas) -> None:
    prim = eqn.primitive
    if not isinstance(new_eqn, jex.JaxprEqn) or not isinstance(metas, tuple):
        raise HandlerError(prim, "must return a (JaxprEqn, tuple[StateMeta, ...]) pair")
    expected = len(eqn.outvars) + sum(m.num_arrays for m in metas)
    if len(new_eqn.outvars) != expected:
        raise HandlerError(
            prim,
            f"returned an equation with {len(new_eqn.outvars)} outputs; expected the "
            f"{len(eqn.outvars)} original ones followed by {expected - len(eqn.outvars)} "
            "array leaves, as many as its StateMetas count",
        )


# ---- plumbing for handlers -----------------------------------------------------------------


Exposer: TypeAlias = Callable[..., tuple[Sequence, Sequence, tuple[StateMeta, ...]]]


def handler_from_exposer(exposer: Exposer) -> Handler:
    """A handler from an *exposer*: a function that runs the primitive on values.

    `exposer(*args, **params) -> (outs, leaves, metas)` binds the primitive (with the marks
    taken out of its jaxprs) and whatever else it needs in the current trace, and returns the
    original outputs, the flat array leaves of the intermediates, and their metas. The handler
    traces it at the equation's input types and wraps the result in one `closed_call` equation.
    The same exposer serves `register_rebatching`, so that `vmap` and `pull` agree.
    """

    def handler(eqn: jex.JaxprEqn) -> tuple[jex.JaxprEqn, tuple[StateMeta, ...]]:
        found: list[tuple[StateMeta, ...]] = []

        def run(*args):
            outs, leaves, metas = exposer(*args, **eqn.params)
            found.append(tuple(metas))
            return [*outs, *leaves]

        closed = _compat.trace(run, [x.aval for x in eqn.invars], name=str(eqn.primitive))
        return call_equation(eqn, closed), found[0]

    return handler


def register_exposer(primitive: jex.Primitive, exposer: Exposer) -> None:
    """Register `exposer` both as `primitive`'s handler and, under `vmap`, as the way the
    primitive is batched where it holds marks (see `handler_from_exposer`)."""
    register_handler(primitive, handler_from_exposer(exposer))

    def staged(*args, **params):
        outs, leaves, metas = exposer(*args, **params)
        mark(leaves, metas)
        return outs

    _compat.register_rebatching(primitive, _params_hold_marks, staged)


def _params_hold_marks(params: dict) -> bool:
    # Only while a `pull` traces: outside one, marks are plain identities, and JAX's own
    # batching rule is the cheapest.
    return bool(_compat.PULLING.value) and any(
        find_saves(sub) for sub in _compat.jaxprs_in_params(params)
    )


_INERT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inert(jaxpr):
    """`jaxpr` (open or closed) with every mark, at any depth, made inert (never collected).

    For handlers that bind an equation as it was, to delegate to its own rules (custom
    derivatives, linear solves, see `pulled_with_rule`): its marks must not be collected again
    by an enclosing `pull`.
    """
    if _compat.wraps_jaxpr(jaxpr):
        new = inert(jaxpr.jaxpr)
        return jaxpr if new is jaxpr.jaxpr else jex.ClosedJaxpr(new, jaxpr.consts)
    with selecting(None):  # every mark, selected or not
        if not find_saves(jaxpr):
            return jaxpr
        return _inert(jaxpr)


def _inert(jaxpr):
    cached = _INERT.get(jaxpr)
    if cached is None:
        eqns = []
        for eqn in jaxpr.eqns:
            if eqn.primitive is save_inter_p:
                eqn = eqn.replace(params=dict(eqn.params, status=INERT))
            elif _eqn_saves(eqn):
                eqn = eqn.replace(params={k: _inert_param(v) for k, v in eqn.params.items()})
            eqns.append(eqn.replace(effects=_without_save_effect(eqn.effects)))
        cached = _INERT[jaxpr] = jaxpr.replace(
            eqns=eqns, effects=_without_save_effect(jaxpr.effects)
        )
    return cached


def _inert_param(value):
    if isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
        return inert(value)
    if isinstance(value, tuple) and any(isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr)) for v in value):
        items = [_inert_param(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def pulled_with_rule(
    original: Callable, primal: jex.ClosedJaxpr, args: Sequence
) -> tuple[list, list, tuple[StateMeta, ...]]:
    """`(outs, leaves, metas)` for an equation with rules of its own (custom derivatives,
    linear solves, hijax and equinox primitives), computed once by its pulled `primal`.

    `original(*args)` binds the equation as it was (its marks inert); `primal` is a jaxpr that
    computes the same outputs from the same `args` and holds the marks. The result is a
    `jax.custom_jvp` whose primal is the pulled `primal` (so a loop inside runs once, as
    unpulled) and whose rule is `original`'s own, so derivatives (and their transposes) are
    the equation's; the intermediates get zero tangents. Only when differentiated does the
    pulled primal also run, behind `stop_gradient`, beside the original rule.
    """
    pulled, metas = pull_jaxpr(primal)
    n = len(primal.out_avals)
    run_pulled = jex.jaxpr_as_fun(pulled)

    @jax.custom_jvp
    def run(*args):
        return tuple(run_pulled(*args))

    def run_jvp(primals, tangents):
        # Differentiate `original` only where a tangent is not a symbolic zero: the other
        # inputs (a solver's state, say) are constants to it, as they were to the equation.
        live = [i for i, t in enumerate(tangents) if not isinstance(t, _compat.SymbolicZero)]
        outs, out_tangents = jax.jvp(
            only_in(original, primals, live),
            [primals[i] for i in live],
            [tangents[i] for i in live],
        )
        saved = run_pulled(*map(jax.lax.stop_gradient, primals))[n:]
        return (*outs, *saved), (*out_tangents, *map(zero_tangent, saved))

    run.defjvp(run_jvp, symbolic_zeros=True)
    flat = run(*args)
    return list(flat[:n]), list(flat[n:]), metas


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


def mark(leaves: Sequence, metas: Sequence[StateMeta]) -> None:
    """Mark flat intermediates again with `save_inter` (the inverse of exposing them)."""
    start = 0
    for meta in metas:
        stop = start + meta.num_arrays
        save_inter_p.bind(*leaves[start:stop], meta=meta, status=bound_status())
        start = stop


def split_leaves(leaves: Sequence, metas: Sequence[StateMeta]) -> list[Sequence]:
    """Flat intermediate leaves, cut into one sequence per meta."""
    out, start = [], 0
    for meta in metas:
        out.append(leaves[start : start + meta.num_arrays])
        start += meta.num_arrays
    return out


def call_equation(eqn: jex.JaxprEqn, closed_jaxpr: jex.ClosedJaxpr) -> jex.JaxprEqn:
    """A `closed_call` of `closed_jaxpr` on `eqn`'s inputs, in place of `eqn`.

    `closed_jaxpr` returns `eqn`'s outputs followed by extra ones, which get fresh variables.
    """
    extra = closed_jaxpr.out_avals[len(eqn.outvars) :]
    return eqn.replace(
        primitive=jex.primitives.closed_call_p,
        params={"call_jaxpr": closed_jaxpr},
        outvars=[*eqn.outvars, *(jex.Var(aval) for aval in extra)],
        effects=closed_jaxpr.effects,
    )


def with_extra_outputs(eqn: jex.JaxprEqn, avals: Sequence, **params) -> jex.JaxprEqn:
    """`eqn` with fresh output variables of `avals` appended and `params` updated.

    Example, the whole of a handler for a call-like primitive:

        def handler(eqn):
            jaxpr, metas = pull_jaxpr(eqn.params["jaxpr"])
            new_avals = jaxpr.out_avals[len(eqn.outvars):]
            return with_extra_outputs(eqn, new_avals, jaxpr=jaxpr), metas
    """
    outvars = [*eqn.outvars, *(jex.Var(aval) for aval in avals)]
    return eqn.replace(outvars=outvars, params=dict(eqn.params, **params))

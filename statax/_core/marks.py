"""Finding marks: which `save_inter`s a jaxpr holds, at any depth, as each primitive's
handler says (its jaxprs, a finder of its own, or the impl of a primitive that runs Python),
under the selection of the `pull` in force. Cached per jaxpr and selection.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from .._jax import jaxprs as _jaxprs
from . import context as _context
from . import cotangents as _cotangents
from . import equinox_internals as _equinox
from . import python_rules as _python_rules
from . import staging as _staging
from .meta import StateMeta
from .primitive import INPUT, collected, save_inter_p
from .registry import on_forget, rules_for

__all__ = [
    "acts_on",
    "find_saves",
    "find_saves_in",
    "find_saves_in_impl",
    "inner_steps",
    "loop_steps",
    "selecting",
    "traced_impl",
]


# ---- which marks a rewrite acts on ----------------------------------------------------------

# The selection of the `pull` in force (`pull(fn, only=...)`): a predicate on StateMeta or None,
# a config state in JAX's trace context (`_context.SELECTION`), as the scope is: `save_inter`
# decides where it is bound whether it collects, and JAX keeps traces made under one selection
# apart from the others. Caches below are kept per selection.


@contextlib.contextmanager
def selecting(selection: Callable[[StateMeta], bool] | None):
    """Within, marks are bound and `pull_jaxpr` collects only where `selection` accepts their
    meta; the others are plain identities (their work, if nothing else needs it, compiles
    away)."""
    with _context.SELECTION(selection):
        yield


def current_selection() -> Callable[[StateMeta], bool] | None:
    """The selection of the `pull` tracing (`pull(fn, only=...)`), a predicate on `StateMeta`,
    or `None` (every mark): for caches kept per selection."""
    return _context.SELECTION.value


def loop_steps() -> tuple[int | None, Any]:
    """For a `while_loop`'s handler, from `pull(fn, steps=...)`: how many iterations this loop
    keeps in rows (`None`: its last one), and what the loops in its body keep (to trace its
    body under, with `inner_steps`). `steps=N` is `N` for every loop; a tuple is per depth of
    `while_loop`s, the outermost first, and a loop deeper than it lists keeps its last."""
    steps = _context.STEPS.value
    if isinstance(steps, tuple):
        return steps[0], (steps[1:] or None)
    return steps, steps


def inner_steps(steps):
    """Within, the `while_loop`s traced keep `steps` (the second of `loop_steps`)."""
    return _context.STEPS(steps)


def pulling():
    """Within, marks are bound as a tracing `pull` binds them (collected, `only=` applied):
    for a handler that traces a function JAX would trace only later (a custom rule)."""
    return _context.PULLING(True)


def pull_differentiates() -> bool:
    """Whether the `pull` tracing has inputs that are differentiated (`jax.jvp(pull(f))`,
    `jax.grad(pull(f))`): then custom rules run, and their marks are keys."""
    return bool(_context.DIFFERENTIATING.value)


def selected(meta: StateMeta) -> bool:
    selection = _context.SELECTION.value
    return selection is None or bool(selection(meta))


def acts_on(params: dict) -> bool:
    """Whether the walk does something with a mark: collects it, or feeds its value in."""
    if params["status"] == INPUT:
        return True
    return collected(params) and selected(params["meta"])


def cached_per_selection(store: weakref.WeakKeyDictionary, key, compute):
    per_rewrite = store.get(key)
    if per_rewrite is None:
        per_rewrite = store[key] = {}
    selection = (_context.SELECTION.value, _cotangents.keeping(), _context.STEPS.value)
    if selection not in per_rewrite:
        per_rewrite[selection] = compute()
    return per_rewrite[selection]


# ---- finding marks -------------------------------------------------------------------------

_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_SAVES.clear)  # a new handler may find marks the old ones did not


def find_saves(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> tuple[StateMeta, ...]:
    """The `StateMeta` of every mark in `jaxpr` that the walk acts on (collecting it, of the
    current selection only inside a `pull(fn, only=...)`, or feeding its value in), at any
    depth, in order."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return marks_of(jaxpr)[0]


def find_saves_in(eqns: Sequence[jex.JaxprEqn]) -> tuple[StateMeta, ...]:
    """`find_saves` of a jaxpr's equations (not cached)."""
    return saves_in(eqns)[0]


def marks_of(jaxpr: jex.Jaxpr) -> tuple[tuple[StateMeta, ...], list[tuple[StateMeta, ...]]]:
    """`(find_saves(jaxpr), per_eqn)`: also the marks of each equation (kept for the walk)."""
    return cached_per_selection(_SAVES, jaxpr, lambda: saves_in(jaxpr.eqns))


def saves_in(eqns: Sequence[jex.JaxprEqn]) -> tuple[tuple[StateMeta, ...], list]:
    per_eqn = []
    for eqn in eqns:
        if eqn.primitive is save_inter_p:
            per_eqn.append((eqn.params["meta"],) if acts_on(eqn.params) else ())
        else:
            per_eqn.append(eqn_saves(eqn))
    return tuple(m for found in per_eqn for m in found), per_eqn


def known_marks(jaxpr: jex.Jaxpr, marks: tuple) -> None:
    """Record `marks_of(jaxpr)`, worked out otherwise (for the current selection)."""
    _SAVES.setdefault(jaxpr, {})[_context.SELECTION.value, _cotangents.keeping()] = marks


def eqn_saves(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    # (`eqn` may be an equation as a trace holds it, `_staging.staged_as_held`: a finder gets it
    # as a `JaxprEqn`.)
    rules = rules_for(eqn)
    if rules.find_saves is not None:
        return tuple(rules.find_saves(_staging.as_equation(eqn)))
    if not eqn.params:
        return ()
    found: tuple[StateMeta, ...] = ()
    for sub in _jaxprs.jaxprs_in_params(eqn.params):
        found += find_saves(sub)
    if found:
        return found
    # What its handler declared, else statax's guess (cheap where the impl is JAX's own).
    declared = rules.runs_python
    if not (_python_rules.runs_python(eqn) if declared is None else declared):
        return found
    return find_saves_in_impl(eqn)


# Equations whose impl was traced to look for marks, and what it gave (bounded; the equation is
# held so that its id is not reused).
_IMPLS: OrderedDict = OrderedDict()
on_forget(_IMPLS.clear)


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
        return _jaxprs.trace(
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
    with _context.PULLING(True):
        closed = trace_impl(eqn, _equinox.impl_of(eqn))
    _IMPLS[key] = (eqn, closed)
    if len(_IMPLS) > 256:
        _IMPLS.popitem(last=False)
    return closed


def find_saves_in_impl(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    """The marks that `eqn`'s impl rule runs (see `traced_impl`)."""
    closed = traced_impl(eqn)
    return () if closed is None else find_saves(closed)

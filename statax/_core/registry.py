"""The handler registry: what statax knows of each higher-order primitive, declared where
its handler is registered.

A handler takes an equation and returns a `Rewrite` (the one rule shape: the equation with
the values it takes in appended to its inputs and the intermediates it exposes appended to its
outputs, with their `StateMeta`s). Beside the handler, its module declares how `stateful`
threads state through the primitive (`thread_state`, `runs`), where its marks are
(`find_saves`) and what the drivers need to know of it (`Flags`: whether selections reach
into it, whether it runs Python). No list of primitives lives anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

from jax.extend import core as jex

from .meta import StateMeta

__all__ = [
    "Handler",
    "Rewrite",
    "Rewritten",
    "on_forget",
    "register_family",
    "register_handler",
    "unregister_family",
    "unregister_handler",
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
# A function that runs a primitive with its marks taken out (see `register_exposer`).
Exposer: TypeAlias = Callable[..., Sequence]

_HANDLERS: dict[jex.Primitive, Handler] = {}
_FINDERS: dict[jex.Primitive, Callable[[jex.JaxprEqn], tuple[StateMeta, ...]]] = {}
# Handlers for families of primitives, recognised by their equations:
# (matches, handler, finder, (thread_state, runs), flags).
_FAMILIES: list[tuple[Callable[[jex.JaxprEqn], bool], Handler, Callable | None, tuple, Any]] = []
# How `stateful` threads state through a primitive, where its handler module says (see
# `register_handler`'s `thread_state`).
_STATE_RULES: dict[jex.Primitive, tuple[Callable | None, Callable | None]] = {}
_ON_FORGET: list[Callable[[], None]] = []  # caches of rewrites, kept where they are made
_ON_UNREGISTER: list[Callable[[jex.Primitive], None]] = []


class Flags(NamedTuple):
    """What a handler declares of its primitive for the drivers (see `register_handler`)."""

    selectable: bool = False
    runs_python: bool | None = None


_FLAGS: dict[jex.Primitive, Flags] = {}
_NO_FLAGS = Flags()
_family_flags = False  # whether any family declared flags


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
    for callback in _ON_UNREGISTER:
        callback(primitive)
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
    global _family_flags
    _FAMILIES.append((matches, handler, find_saves, (thread_state, runs), flags))
    _family_flags = any(f[4] != _NO_FLAGS for f in _FAMILIES)
    _forget_rewrites()


def unregister_family(matches: Callable[[jex.JaxprEqn], bool]) -> None:
    """Remove the family registered with `matches`."""
    global _family_flags
    _FAMILIES[:] = [f for f in _FAMILIES if f[0] is not matches]
    _family_flags = any(f[4] != _NO_FLAGS for f in _FAMILIES)
    _forget_rewrites()


def on_forget(callback: Callable[[], None]) -> None:
    """Call `callback` whenever the handlers change (for caches of rewrites kept elsewhere)."""
    _ON_FORGET.append(callback)


_REBINDINGS: dict[str, Callable] = {}


def register_rebinding(name: str, rule: Callable[[jex.JaxprEqn, list], list]) -> None:
    """Teach `stateful` to bind again an equation of the primitive called `name` on values
    whose types may differ from those it was traced with: `rule(eqn, invals) -> outs`.

    `stateful` evaluates a traced program again with its state's current values in place of
    the traced reads, and a value read from state may, say, vary over a `shard_map`'s manual
    axes where the traced value did not (`handlers.shard_map` registers `pvary` and `pcast`).
    By name, for primitives that JAX keeps private."""
    _REBINDINGS[name] = rule


def rebinding_for(eqn: jex.JaxprEqn) -> Callable | None:
    """The rule `register_rebinding` gave `eqn`'s primitive, or `None`."""
    return _REBINDINGS.get(eqn.primitive.name)


_TRIPS: dict[str, Callable[[jex.JaxprEqn], int | None]] = {}


def register_trips(name: str, rule: Callable[[jex.JaxprEqn], int | None]) -> None:
    """Tell `stx.sites` how many times an equation of the primitive called `name` runs its
    inner jaxprs per run of its own: `rule(eqn) -> int`, or `None` where that is not known when
    it is traced (a `while_loop`). Without a rule, once."""
    _TRIPS[name] = rule


def trips_for(eqn: jex.JaxprEqn) -> int | None:
    """How many times `eqn` runs its inner jaxprs (`register_trips`; 1 without a rule)."""
    rule = _TRIPS.get(eqn.primitive.name)
    return 1 if rule is None else rule(eqn)


def on_unregister(callback: Callable[[jex.Primitive], None]) -> None:
    """Call `callback(primitive)` whenever a primitive's handler is removed (for what was
    installed with it elsewhere: a batching rule)."""
    _ON_UNREGISTER.append(callback)


def _forget_rewrites() -> None:
    """Drop every cached search and rewrite: a new handler may see what the old ones could not."""
    for callback in _ON_FORGET:
        callback()


def rules_for(eqn: jex.JaxprEqn) -> tuple[Handler | None, Callable | None]:
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
    return rules_for(eqn)[0]


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


_NAMED_FLAGS: dict[str, Flags] = {}


def register_flags(name: str, *, selectable: bool = False, runs_python: bool | None = None):
    """Declare what the drivers need to know of the primitive called `name`, one that has no
    handler (it holds no marks) and that JAX keeps private: `register_handler`'s flags. A host
    callback, say, holds a Python function that runs on values on the host, never one whose
    marks `pull` could collect: `register_flags("pure_callback", runs_python=False)`."""
    _NAMED_FLAGS[name] = Flags(selectable, runs_python)
    _forget_rewrites()


def declares_flags(eqn: jex.JaxprEqn) -> bool:
    """Whether flags were declared for `eqn`'s primitive itself (by its handler, or by name),
    or a family declared any (a quick test before `flags_for`, which looks through the
    families)."""
    return eqn.primitive in _FLAGS or eqn.primitive.name in _NAMED_FLAGS or _family_flags


def flags_for(eqn: jex.JaxprEqn) -> Flags:
    """What `eqn`'s handler declared of its primitive (see `register_handler`): its
    primitive's (or what `register_flags` declared by its name), else its family's, else the
    defaults (nothing declared)."""
    flags = _FLAGS.get(eqn.primitive) or _NAMED_FLAGS.get(eqn.primitive.name)
    if flags is not None:
        return flags
    if eqn.primitive not in _HANDLERS:
        for matches, _, _, _, family_flags in _FAMILIES:
            if matches(eqn):
                return family_flags
    return _NO_FLAGS

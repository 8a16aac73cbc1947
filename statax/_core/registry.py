"""The registry: what statax knows of each primitive, one record (`Rules`) per primitive,
registered once, where its handler module says it (as JAX's `discharge.py` keeps one rule
table).

A handler takes an equation and returns a `Rewrite` (the one rule shape: the equation with
the values it takes in appended to its inputs and the intermediates it exposes appended to its
outputs, with their `StateMeta`s). Beside the handler, a primitive's record says how it is
batched where it holds marks (`exposer`, `batching_guard`, `stacking`), how `stateful` threads
state through it (`thread_state`, `runs`, `rebinding`), where its marks are (`find_saves`),
how often it runs its jaxprs (`trips`) and what the drivers need to know of it (`selectable`,
`runs_python`). `rules_for(eqn)` is the one lookup. No list of primitives lives anywhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

from jax.extend import core as jex

from .meta import StateMeta

__all__ = [
    "Handler",
    "Rewrite",
    "Rewritten",
    "Rules",
    "on_forget",
    "register_family",
    "register_handler",
    "register_rules",
    "rules_for",
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rules:
    """Everything statax knows of one primitive (or of a family of them): one record.

    Attributes:
        handler: how `pull` rewrites an equation of it (`Handler`), or `None`: it holds no
            marks statax can reach (a primitive with only flags).
        exposer: the function the handler was made from (`register_exposer`), which also runs
            in place of JAX's batching rule where the primitive holds marks under `vmap`.
        find_saves: for a primitive whose inner functions are not jaxprs in its params (so
            `pull` cannot look for marks in them): `find_saves(eqn)` returns the metas of the
            marks the equation holds. By default `pull` looks in the jaxprs of `eqn.params`.
        thread_state: how `stateful` threads named state through an equation that reads or
            sets it: `thread_state(eqn, invals, threading) -> outs` evaluates the equation on
            `invals` in the current trace, threading the state of `threading` (a
            `statax.extend.Threading`) through its functions. By default state is threaded on
            the handler's own contract, as values that come in (`take`) and go out (`mark`),
            each of the primitive's functions threaded on its own: right for a primitive that
            calls its functions once, as a call does. A loop (state carried) or a branch (state
            selected) needs a rule.
        runs: for a primitive whose functions are not jaxprs in its params (an equinox filter
            primitive runs Python functions it holds): `runs(eqn)` traces what an equation
            runs, as a jaxpr of the equation's inputs and outputs (or `None`). Under
            `stateful` the state its functions read and set shows there, and an equation whose
            functions touch state is evaluated by threading that jaxpr (as a call).
        rebinding: how `stateful` binds again an equation on values whose types may differ
            from those it was traced with: `rebinding(eqn, invals) -> outs` (a value read from
            state may vary over a `shard_map`'s manual axes where the traced one did not).
        batching_guard: `guard(axis_data, dims, params)`, run before the primitive is batched,
            whatever else batches it: it raises where the batching would be wrong
            (`batched_state_guard` makes one).
        stacking: whether it is a loop that stacks its body's marks, one row per iteration (as
            `scan`): cotangents read under `vmap` count it while JAX batches it.
        trips: how many times an equation runs its inner jaxprs per run of its own, for
            `stx.sites`: `trips(eqn) -> int`, or `None` where that is not known when it is
            traced (a `while_loop`). Without a rule, once.
        selectable: whether selections (`stx.scopes`, `stx.lines`, `stx.primitives`) reach
            into the jaxprs in its params: an equation whose jaxprs are evaluated again, with
            marks in them, must take them as it took the old ones (the same inputs and
            outputs), as a call, a loop or a branch does. Elsewhere a selection of a place
            inside is an error that names the primitive.
        runs_python: whether its rules may run Python functions held in its params, whose
            marks no jaxpr shows (`pull` then traces its impl to find them). `None`: statax
            decides from its impl and params (`python_rules.runs_python`); `False` for a
            primitive whose impl runs only its jaxprs (a call, a loop, a branch) or only JAX's
            own functions or a host callback.
        derivative_params: the names of params that hold only its derivative rules (a custom
            JVP or VJP, made anew at every trace): the key of a compiled program that statax
            keeps (`structure.program_key`) leaves them out, as such a program is only run.
        sinking: for a primitive with branches, which of them reads each input and how its
            equation takes work moved in (`sinking.Sinking`): what lets a sweep's program skip
            the run before a patched site.
    """

    handler: Handler | None = None
    exposer: Exposer | None = None
    find_saves: Callable[[jex.JaxprEqn], tuple[StateMeta, ...]] | None = None
    thread_state: Callable | None = None
    runs: Callable[[jex.JaxprEqn], jex.ClosedJaxpr | None] | None = None
    rebinding: Callable[[jex.JaxprEqn, list], list] | None = None
    batching_guard: Callable | None = None
    stacking: bool = False
    trips: Callable[[jex.JaxprEqn], int | None] | None = None
    selectable: bool = False
    runs_python: bool | None = None
    derivative_params: tuple[str, ...] = ()
    sinking: Any = None

    def runs_of(self, eqn: jex.JaxprEqn) -> int | None:
        """How many times `eqn` runs its inner jaxprs (`trips`; 1 without a rule)."""
        return 1 if self.trips is None else self.trips(eqn)

    @property
    def batches(self) -> bool:
        """Whether statax's batching rule stands in for JAX's."""
        return self.exposer is not None or self.batching_guard is not None or self.stacking


NO_RULES = Rules()  # a primitive statax knows nothing of

# primitive -> its record; or, for a primitive that JAX keeps private, its name -> its record.
_RULES: dict[jex.Primitive | str, Rules] = {}
# Records for families of primitives, recognised by their equations: (matches, rules).
_FAMILIES: list[tuple[Callable[[jex.JaxprEqn], bool], Rules]] = []
_ON_FORGET: list[Callable[[], None]] = []  # caches of rewrites, kept where they are made
_ON_CHANGE: list[Callable[[jex.Primitive | str], None]] = []


def register_rules(primitive: jex.Primitive | str, rules: Rules) -> None:
    """The one registration: `rules` is everything statax knows of `primitive` (a
    `jax.extend.core.Primitive`, or the name of one that JAX keeps private), in place of any
    record it had."""
    if not isinstance(primitive, (jex.Primitive, str)):
        raise TypeError(
            f"statax registers rules for a jax.extend.core.Primitive, got {primitive!r}. Pass "
            "the primitive object itself, e.g. jax.extend.core.primitives.closed_call_p (or, "
            "for one that JAX keeps private, its name)."
        )
    if not isinstance(rules, Rules):
        raise TypeError(f"register_rules needs a statax.extend.Rules, got {rules!r}")
    if rules.handler is not None and not callable(rules.handler):
        raise TypeError(f"a handler must be callable, got {rules.handler!r}")
    _RULES[primitive] = rules
    _changed(primitive)


def register_handler(
    primitive: jex.Primitive, handler: Handler | None = None, **rules: Any
) -> Handler | Callable[[Handler], Handler]:
    """Teach `pull` to see inside a higher-order primitive: register its record, `Rules(handler=
    handler, **rules)`.

    A handler takes an equation of `primitive` and returns a `Rewrite(new_eqn, outs, ins)`:
    `new_eqn` takes the original inputs followed by the flat leaves of the values in `ins`, and
    computes the original outputs followed by the flat array leaves of every intermediate in
    `outs`. Most handlers call `pull_jaxpr` on the inner jaxpr and `extend_equation` to
    rebuild the equation; loops and branches are written as exposers (`register_exposer`).

    Usable directly, `register_handler(my_p, my_handler)`, or as a decorator,
    `@register_handler(my_p)`. Registering again replaces the whole record;
    `unregister_handler` removes it.

    Args:
        primitive: the primitive, e.g. `jax.extend.core.primitives.cond_p`.
        handler: the handler; if omitted, `register_handler` returns a decorator.
        **rules: the rest of its record (`Rules`' fields: `find_saves`, `thread_state`,
            `runs`, `rebinding`, `batching_guard`, `stacking`, `trips`, `selectable`,
            `runs_python`, and `exposer`).

    Returns:
        The handler (or the decorator).
    """
    if not isinstance(primitive, jex.Primitive):
        raise TypeError(
            f"register_handler needs a jax.extend.core.Primitive, got {primitive!r}. Pass the "
            "primitive object itself, e.g. jax.extend.core.primitives.closed_call_p."
        )

    def register(h: Handler) -> Handler:
        register_rules(primitive, Rules(handler=h, **rules))
        return h

    return register if handler is None else register(handler)


def unregister_handler(primitive: jex.Primitive | str) -> None:
    """Remove `primitive`'s record (and give JAX its batching rule back): statax then treats its
    equations as it treats any primitive it knows nothing of."""
    if _RULES.pop(primitive, None) is not None:
        _changed(primitive)


def register_family(matches: Callable[[jex.JaxprEqn], bool], handler: Handler, **rules) -> None:
    """`register_handler` for a family of primitives that is open-ended (every equinox filter
    primitive, whichever library defines it): the record `Rules(handler=handler, **rules)`
    serves every equation of a primitive with no record of its own for which `matches(eqn)` is
    true. (Batching a family is JAX's: its record has no `exposer`, guard or `stacking`.)"""
    family = Rules(handler=handler, **rules)
    if family.batches:
        raise ValueError(
            "a family's record cannot change how JAX batches its primitives (exposer, "
            "batching_guard, stacking): register those per primitive."
        )
    _FAMILIES.append((matches, family))
    _forget_rewrites()


def unregister_family(matches: Callable[[jex.JaxprEqn], bool]) -> None:
    """Remove the family registered with `matches`."""
    _FAMILIES[:] = [f for f in _FAMILIES if f[0] is not matches]
    _forget_rewrites()


def rules_for(eqn: jex.JaxprEqn) -> Rules:
    """The one lookup: `eqn`'s record, its primitive's (or its name's), else its family's, else
    `NO_RULES`."""
    rules = _RULES.get(eqn.primitive)
    if rules is None:
        rules = _RULES.get(eqn.primitive.name)
        if rules is None:
            for matches, family in _FAMILIES:
                if matches(eqn):
                    return family
            return NO_RULES
    return rules


def rules_of(primitive: jex.Primitive) -> Rules:
    """`primitive`'s own record (not a family's), or `NO_RULES`."""
    return _RULES.get(primitive, NO_RULES)


def on_forget(callback: Callable[[], None]) -> None:
    """Call `callback` whenever the handlers change (for caches of rewrites kept elsewhere)."""
    _ON_FORGET.append(callback)


def on_change(callback: Callable[[jex.Primitive | str], None]) -> None:
    """Call `callback(primitive)` whenever a primitive's record is registered or removed (for
    what is installed with it in JAX: its batching rule)."""
    _ON_CHANGE.append(callback)


def _changed(primitive) -> None:
    for callback in _ON_CHANGE:
        callback(primitive)
    _forget_rewrites()


def _forget_rewrites() -> None:
    """Drop every cached search and rewrite: a new handler may see what the old ones could not."""
    for callback in _ON_FORGET:
        callback()

"""The one walk over a jaxpr: every driver of statax is a hook on it.

A jaxpr is walked equation by equation, with an environment from its variables to values.
There are two kinds of value, and so two ways to walk:

* `evaluate`: the values are JAX values (tracers of the current trace, or arrays), and each
  equation is *bound* again, inside its own traceback, name stack and `ctx`, as JAX's state
  discharge does (`jax/_src/state/discharge.py`). Whatever the walk stages therefore looks as
  if the user's code had made it: a named scope, a source line and a `jax.named_scope` survive
  a second evaluation, so a selection sees through `stateful` as it sees through `pull`.
* `rewrite`: the values are the jaxpr's own atoms (variables and literals), and each equation
  is *copied*, possibly changed, into a new list of equations: no trace, no bind. An equation
  whose inputs did not change is kept as it is.

The hooks (`step`) are the drivers' own: `stateful` threads state through an equation,
selections add a mark after one, `pull` and `plant` rewrite one through its handler. An
equation a hook leaves alone is bound (`bind_equation`) or kept, as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jex
from jax.extend import source_info_util as source_info_api

from .._jax import jaxprs as _jaxprs

__all__ = ["bind_equation", "equations", "evaluate", "in_context", "keep", "rewrite", "walk"]

Step = Callable[[jex.JaxprEqn, list], Sequence[Any]]


After = Callable[[int, jex.JaxprEqn, dict], None]


def walk(
    jaxpr: jex.Jaxpr,
    inputs: Sequence[Any],
    step: Step,
    literal: Callable | None,
    after: After | None = None,
    free: bool = False,
) -> list:
    """Walk `jaxpr` (open): its constvars and invars take `inputs` (in that order), each
    equation's outputs are `step(eqn, its inputs' values)`, and a literal's value is
    `literal(lit)`. `after(i, eqn, env)`, where given, runs once the `i`th equation's outputs
    are in `env` (variable -> value), and may change any value there (a selection marks the
    values leaving a region). With `free` (a rewrite), values are atoms, a literal stands for
    itself (`literal` is not used), `env` holds only the variables that stand for others
    (`inputs` renames `jaxpr`'s constvars and invars, where given), and any other variable
    stands for itself (also one that nothing in `jaxpr` defines: a rewrite of equations staged
    in a trace, whose variables are the trace's). Returns the values of `jaxpr`'s outputs."""
    lit = jex.Literal
    if free:  # (a rewrite: `env` holds only the variables that stand for others)
        env = {v: x for v, x in zip([*jaxpr.constvars, *jaxpr.invars], inputs) if v is not x}
        get = env.get

        def read(x):
            return x if isinstance(x, lit) else get(x, x)

    else:
        env = dict(zip([*jaxpr.constvars, *jaxpr.invars], inputs, strict=True))

        def read(x):
            return literal(x) if isinstance(x, lit) else env[x]

    for i, eqn in enumerate(jaxpr.eqns):
        # (nothing renamed yet, a rewrite reads the equation's own inputs: no copy)
        invals = [read(x) for x in eqn.invars] if env or not free else eqn.invars
        outs = step(eqn, invals)
        if outs is not eqn.outvars:
            env.update(zip(eqn.outvars, outs, strict=True))
        if after is not None:
            after(i, eqn, env)
    return [read(x) for x in jaxpr.outvars]


@contextlib.contextmanager
def in_context(eqn: jex.JaxprEqn):
    """The context an equation is bound again in: its traceback, its name stack below the
    current one, and its `ctx` (as JAX's state discharge binds each equation)."""
    source = eqn.source_info
    name_stack = source_info_api.current_name_stack() + source.name_stack
    with source_info_api.user_context(source.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def bind_equation(eqn: jex.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list:
    """`eqn` bound on `invals` (with `params` in place of its own, where given): its outputs,
    as a list."""
    outs = _jaxprs.bind(eqn.primitive, invals, eqn.params if params is None else params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def evaluate(
    jaxpr: jex.Jaxpr,
    consts: Sequence,
    args: Sequence,
    step: Step | None = None,
    after: After | None = None,
) -> list:
    """Evaluate `jaxpr` (open, closing over `consts`) on `args` in the current trace: each
    equation is bound in its own context (`in_context`) by `step(eqn, invals)`, by default
    `bind_equation`, and `after` is `walk`'s. Returns its outputs."""
    step = bind_equation if step is None else step

    def bound(eqn, invals):
        with in_context(eqn):
            return step(eqn, invals)

    return walk(jaxpr, [*consts, *args], bound, _literal_value, after)


def _literal_value(x: jex.Literal) -> Any:
    return x.val


Emit = Callable[[jex.JaxprEqn], None]


def rewrite(jaxpr: jex.Jaxpr, step: Step, after: After | None = None) -> list:
    """Rewrite `jaxpr` (open): `step(eqn, invars)` emits the equations that take `eqn`'s place
    (into a list of the caller's, any number of them; `keep` emits `eqn` as it was) and returns
    the atoms that stand for `eqn`'s outputs after it; `after` is `walk`'s, and may emit too.
    Returns the atoms of `jaxpr`'s outputs."""
    return walk(jaxpr, (), step, None, after, free=True)


def keep(eqn: jex.JaxprEqn, invars: Sequence[Any], emit: Emit) -> list:
    """In a `rewrite`'s step: emit `eqn` as it was (reading `invars`, where they changed), and
    return its outputs."""
    if invars is not eqn.invars:
        for a, b in zip(invars, eqn.invars):
            if a is not b:
                eqn = eqn.replace(invars=list(invars))
                break
    emit(eqn)
    return eqn.outvars


def equations(jaxpr: Any):
    """Every equation of `jaxpr` (open or closed) and of the jaxprs in their params, at any
    depth, in program order (an equation before those inside it)."""
    if _jaxprs.wraps_jaxpr(jaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _jaxprs.jaxprs_in_params(eqn.params):
            yield from equations(sub)

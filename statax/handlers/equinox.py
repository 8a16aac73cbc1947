"""Handlers for equinox's own primitives: `eqx.internal.noinline`, and every equinox filter
primitive or `vprim` (lineax's `linear_solve`, and any other library's).

A filter primitive keeps its functions (a lineax operator's matvec, a solver) as Python objects
in its `static` param, and runs them in its impl rule, which is also its lowering. No jaxpr
shows their marks; `pull` finds them by tracing the impl at the equation's input types
(`traced_impl`). The handler computes the outputs and the intermediates once from that traced
impl, pulled, and delegates derivatives to the equation itself (`pulled_with_rule`), so the
primitive's own JVP and transpose rules (lineax's implicit derivatives) keep governing them.
The same code works whether the function closes over a constant or over a traced array (which
equinox closure-converts into jaxprs in `static`).

`noinline` keeps the function it calls out of its params (equinox compiles it separately), so
`pull` cannot see its marks in a jaxpr. This handler rebuilds the function from the equation,
traces it to look for marks, and where there are some, replaces the equation by a call of the
pulled function: while pulled, the function is inlined; unpulled programs keep `noinline`.

Under `stateful`, both run their Python functions traced, and thread the state through them
(as a call does); a primitive whose functions touch no state is bound as it is.

The other equinox constructs need no handler of their own: `eqx.filter_jit` is a `jit`,
`eqx.filter_checkpoint` a `checkpoint`, and `eqx.internal.while_loop` is built from `while`
(`kind="lax"`), custom derivatives around a `while` (`"checkpointed"`) or `scan`s of `cond`s
(`"bounded"`); see the semantics table in the docs. How those loops look in a jaxpr (the carry
equinox adds, its per-example flag) is read here, for the loop handlers (`loops`).
"""

from __future__ import annotations

from collections import OrderedDict

import jax.numpy as jnp
from jax.extend import core as jex

from statax.extend import (
    call_equation,
    equations,
    find_saves,
    find_saves_in_impl,
    handler_from_exposer,
    pull_jaxpr,
    pulled_with_rule,
    register_family,
    register_handler,
    trace,
    trace_impl,
    traced_impl,
)
from statax.extend import equinox as equinox_internals

_noinline_p, _fn_of = equinox_internals.equinox_noinline()
# The function each `noinline` equation calls, traced once: finding its marks and rewriting the
# call share the trace. Keyed by what the equation calls (its function index, its static params,
# held so that their id is not reused, and its input types); bounded.
_TRACED: OrderedDict = OrderedDict()


def _traced(eqn):
    static = eqn.params["static"]
    key = (str(eqn.invars[0]), id(static), tuple(x.aval for x in eqn.invars))
    hit = _TRACED.get(key)
    if hit is not None and hit[0] is static:
        return hit[1]
    fn = _fn_of(eqn)
    closed = None if fn is None else trace(fn, [x.aval for x in eqn.invars], name="noinline")
    _TRACED[key] = (static, closed)
    if len(_TRACED) > 256:
        _TRACED.popitem(last=False)
    return closed


def _find(eqn):
    closed = _traced(eqn)
    return () if closed is None else find_saves(closed)


def _noinline_handler(eqn):
    return call_equation(eqn, pull_jaxpr(_traced(eqn)))


def _noinline_runs(eqn):
    fn = _fn_of(eqn)
    return None if fn is None else trace(fn, [x.aval for x in eqn.invars], name="noinline")


register_handler(_noinline_p, _noinline_handler, find_saves=_find, runs=_noinline_runs)


def _filter_primitive_handler(eqn):
    impl = traced_impl(eqn)

    def original(*args):
        return tuple(eqn.primitive.bind(*args, **eqn.params))

    def exposer(*args, **params):
        return pulled_with_rule(original, impl, args)

    return handler_from_exposer(exposer)(eqn)


def _filter_primitive_runs(eqn):
    # The Python functions the primitive runs (a lineax operator's matvec), traced with it:
    # where they touch state, it is threaded through them, and differentiated as written.
    return trace_impl(eqn, equinox_internals.impl_of(eqn))


register_family(
    equinox_internals.is_equinox_primitive,
    _filter_primitive_handler,
    find_saves=find_saves_in_impl,
    runs=_filter_primitive_runs,
)


# ---- equinox's loops: how they look in a jaxpr (equinox 0.13, `equinox.internal._loop`) --------


def is_bounded_step(body: jex.ClosedJaxpr, init) -> bool:
    """Whether a `scan` with this body and initial carry is a level of an
    `eqx.internal.while_loop(kind="bounded")`: nested scans of `cond(cond_fun(val), ...)`
    over equinox's loop carry `(step, pred, prev_pred, *state)` (see `loop_running`), whose
    `cond_fun` calls `unvmap_any`. Differentiated (`pull(grad(f))`), the loop is JAX's forward
    pass of it, whose dead-code elimination may drop `prev_pred`: `(step, pred)` is what the
    loop needs to know which steps ran, and what it checks."""
    return _equinox_carry(init, prev=False) and _calls(body, "unvmap_any")


def _equinox_carry(init, prev: bool = True) -> bool:
    """Whether `init` starts with equinox's `(step, pred, prev_pred)` (`prev=False`: with
    `(step, pred)`)."""
    if len(init) < 2 + prev:
        return False
    step, *flags = init[: 2 + prev]  # values or their types: both have a shape and a dtype
    flags_ok = all(a.shape == () and a.dtype == jnp.bool_ for a in flags)
    return flags_ok and step.shape == () and jnp.issubdtype(step.dtype, jnp.integer)


def _calls(jaxpr, name: str) -> bool:
    """Whether `jaxpr` binds the primitive called `name`, at any depth."""
    return any(eqn.primitive.name == name for eqn in equations(jaxpr))


def loop_running(cond_jaxpr: jex.ClosedJaxpr, init) -> int | None:
    """For the `while` of an `eqx.internal.while_loop` (any kind but "bounded"), the index in
    its carry of equinox's per-example "still running" flag; else `None`.

    equinox rewrites a loop to carry `(step, pred, prev_pred, *state)` and to stop on
    `unvmap_any(pred)`, so that under `vmap` every example runs until all are done, and the
    body masks the state with `pred` itself (equinox 0.13, `equinox.internal._loop.common`)."""
    if _equinox_carry(init) and _calls(cond_jaxpr, "unvmap_any"):
        return 1
    return None

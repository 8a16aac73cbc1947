"""Handlers for `custom_jvp_call` and `custom_vjp_call` (`jax.custom_jvp`, `jax.custom_vjp`,
and what is built from them: equinox's checkpointed while loop, diffrax's adjoints,
optimistix's implicit derivatives).

Reads `call_jaxpr`, the primal function. The equation is rebound as a custom-derivative function
of statax's whose primal is the *pulled* primal: it returns the original outputs followed by
the intermediates, computed once (a loop inside runs once, as unpulled). Its rule delegates to
the original equation (its marks inert), so the custom rule keeps governing derivatives; the
intermediates get zero tangents (they are the primal's values, as under `grad`). Only when the
result is differentiated does the pulled primal also run, beside the original rule, behind
`stop_gradient`, to provide them.

Under `pull(grad(f))` JAX has already replaced the equation by what it runs: the primal
function for `custom_jvp` (if the JVP rule calls it), `fwd` and `bwd` for `custom_vjp`; their
marks are collected where they run.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex
from jax.extend.core.primitives import custom_jvp_call_p, custom_vjp_call_p

from .. import _compat
from .._interpreter import (
    handler_from_exposer,
    inert,
    only_in,
    pull_jaxpr,
    pulled_with_rule,
    register_handler,
    zero_tangent,
)


def _original(primitive, params):
    """The equation as it was, its marks inert (an enclosing `pull` must not see them again)."""
    kept = _compat.custom_params(params, inert(_compat.custom_primal(params)))

    def original(*args):
        return tuple(_compat.bind(primitive, args, kept))

    return original


def _custom_jvp_exposer(*args, **params):
    original = _original(custom_jvp_call_p, params)
    return pulled_with_rule(original, _compat.custom_primal(params), args)


def _custom_vjp_exposer(*args, **params):
    # As `pulled_with_rule`, with a `custom_vjp` (a custom_vjp function has no JVP to call).
    original = _original(custom_vjp_call_p, params)
    primal = _compat.custom_primal(params)
    pulled, metas = pull_jaxpr(primal)
    run_pulled = jex.jaxpr_as_fun(pulled)
    n = len(primal.out_avals)

    @jax.custom_vjp
    def run(*args):
        return tuple(run_pulled(*args))

    live: list[int] = []  # the perturbed arguments, as `fwd` found them for `bwd`

    def fwd(*args):
        # Differentiate `original` only in the perturbed arguments: the others are constants
        # to it, as they were to the equation (equinox's `filter_custom_vjp` checks this).
        values = [a.value for a in args]
        live[:] = [i for i, a in enumerate(args) if a.perturbed]
        outs, vjp = jax.vjp(only_in(original, values, live), *[values[i] for i in live])
        saved = run_pulled(*map(jax.lax.stop_gradient, values))[n:]
        return (*outs, *saved), vjp

    def bwd(vjp, cts):
        cts = [_instantiate(ct) for ct in cts[:n]]
        grads = dict(zip(live, vjp(tuple(cts)), strict=True))
        return tuple(grads.get(i) for i in range(len(args)))

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    flat = run(*args)
    return flat[:n], flat[n:], metas


def _instantiate(ct):
    if not isinstance(ct, _compat.SymbolicZero):
        return ct
    return zero_tangent(jax.ShapeDtypeStruct(ct.shape, ct.aval.dtype))


register_handler(custom_jvp_call_p, handler_from_exposer(_custom_jvp_exposer))
register_handler(custom_vjp_call_p, handler_from_exposer(_custom_vjp_exposer))

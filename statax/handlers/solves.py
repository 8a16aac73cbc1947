"""Handler for `custom_linear_solve` (`lax.custom_linear_solve`).

Reads `jaxprs` and `const_lengths`. The forward computation is `solve(matvec, b)`, so the
intermediates are the marks of the `solve` function (including those of `matvec` where `solve`
calls it), computed once by the pulled `solve`, which also gives the outputs; derivatives
delegate to the equation itself, as for custom derivatives (`pulled_with_rule`). The separate
`matvec`, `vecmat` and `transpose_solve` jaxprs run only under differentiation, where JAX
builds a new `custom_linear_solve` that this handler sees again.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex
from jax.extend.core.primitives import linear_solve_p

from statax.extend import (
    handler_from_exposer,
    inert,
    params,
    pulled_with_rule,
    register_handler,
    trace,
)


def _linear_solve_exposer(*args, **eqn_params):
    jaxprs, const_lengths = params.linear_solve_parts(eqn_params)
    kept = params.linear_solve_params(eqn_params, type(jaxprs)(*map(_inert, jaxprs)))
    start = const_lengths.matvec + const_lengths.vecmat

    def original(*args):
        return tuple(linear_solve_p.bind(*args, **kept))

    def solve(*args):  # what the equation computes: solve(matvec, b)
        solve_consts = args[start : start + const_lengths.solve]
        return jex.jaxpr_as_fun(jaxprs.solve)(*solve_consts, *args[sum(const_lengths) :])

    primal = trace(solve, [jax.typeof(x) for x in args], name="solve")
    return pulled_with_rule(original, primal, args)


def _inert(jaxpr):
    return None if jaxpr is None else inert(jaxpr)


# Evaluated again with marks inside, a solve takes its new functions as it took the old ones.
register_handler(linear_solve_p, handler_from_exposer(_linear_solve_exposer), selectable=True)

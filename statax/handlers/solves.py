"""Handler for `custom_linear_solve` (`lax.custom_linear_solve`).

Reads `jaxprs` and `const_lengths`. The forward computation is `solve(matvec, b)`, so the
intermediates are the marks of the `solve` function (including those of `matvec` where `solve`
calls it), evaluated, as for custom derivatives, beside the kept equation behind
`stop_gradient`. The separate `matvec`, `vecmat` and `transpose_solve` jaxprs run only under
differentiation, where JAX builds a new `custom_linear_solve` that this handler sees again.
"""

from __future__ import annotations

from jax.extend.core.primitives import linear_solve_p

from .. import _compat
from .._interpreter import handler_from_exposer, inert, pulled_beside, register_handler


def _linear_solve_exposer(*args, **params):
    jaxprs, const_lengths = _compat.linear_solve_parts(params)
    inert_jaxprs = type(jaxprs)(*map(_inert, jaxprs))
    outs = linear_solve_p.bind(*args, **_compat.linear_solve_params(params, inert_jaxprs))
    start = const_lengths.matvec + const_lengths.vecmat
    solve_consts = args[start : start + const_lengths.solve]
    b = args[sum(const_lengths) :]
    return outs, *pulled_beside(jaxprs.solve, (*solve_consts, *b))


def _inert(jaxpr):
    return None if jaxpr is None else inert(jaxpr)


register_handler(linear_solve_p, handler_from_exposer(_linear_solve_exposer))

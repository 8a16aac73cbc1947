"""Handler for `jit` (`jax.jit`, `eqx.filter_jit`, nested jits).

Reads `jaxpr` and rewrites it with `pull_jaxpr`; the intermediates leave as extra outputs of
the jit, with unspecified sharding and layout (the compiler chooses), so `static_argnums`,
`donate_argnums` and in/out shardings of the user's jit are untouched.
"""

from __future__ import annotations

from .._compat import JIT_PRIMITIVE, jit_jaxpr, jit_params
from .._interpreter import pull_jaxpr, register_handler, with_extra_outputs


def _jit_handler(eqn):
    jaxpr, metas = pull_jaxpr(jit_jaxpr(eqn.params))
    new_avals = jaxpr.out_avals[len(eqn.outvars) :]
    return with_extra_outputs(eqn, new_avals, **jit_params(eqn.params, jaxpr)), metas


register_handler(JIT_PRIMITIVE, _jit_handler)

"""Handlers for `custom_jvp_call` and `custom_vjp_call` (`jax.custom_jvp`, `jax.custom_vjp`,
`lax.custom_root`, and equinox's checkpointed while loop, which is built from them).

Reads `call_jaxpr`, the primal function. The equation itself is kept, with its marks made
inert, so the custom rule keeps governing derivatives; beside it, the pulled primal function
runs on the same inputs behind `stop_gradient` and provides the intermediates. Once compiled,
XLA computes the shared work once.

Under `pull(grad(f))` JAX has already replaced the equation by what it runs: the primal
function for `custom_jvp` (if the JVP rule calls it), `fwd` and `bwd` for `custom_vjp`; their
marks are collected where they run.
"""

from __future__ import annotations

from jax.extend.core.primitives import custom_jvp_call_p, custom_vjp_call_p

from .. import _compat
from .._interpreter import handler_from_exposer, inert, pulled_beside, register_handler


def _exposer(primitive):
    def exposer(*args, **params):
        primal = _compat.custom_primal(params)
        outs = _compat.bind(primitive, args, _compat.custom_params(params, inert(primal)))
        return outs, *pulled_beside(primal, args)

    return exposer


for _primitive in (custom_jvp_call_p, custom_vjp_call_p):
    register_handler(_primitive, handler_from_exposer(_exposer(_primitive)))

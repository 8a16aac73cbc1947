"""Handler for `checkpoint` (`jax.checkpoint` / `jax.remat`, with or without a policy, and
`eqx.filter_checkpoint`).

Reads `jaxpr` (an open jaxpr) and pulls it; the intermediates leave as extra outputs of the
checkpoint. Under differentiation, JAX's partial evaluation keeps each mark in the forward pass
and makes the copy that the backward pass replays inert, so every value is collected once.
"""

from __future__ import annotations

from .._compat import REMAT_PRIMITIVE, call_jaxpr, call_params
from .._interpreter import pull_open_jaxpr, register_handler, with_extra_outputs


def _remat_handler(eqn):
    jaxpr, metas = pull_open_jaxpr(call_jaxpr(eqn.params))
    new_avals = [x.aval for x in jaxpr.outvars[len(eqn.outvars) :]]
    return with_extra_outputs(eqn, new_avals, **call_params(eqn.params, jaxpr)), metas


register_handler(REMAT_PRIMITIVE, _remat_handler)

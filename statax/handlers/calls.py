"""Handlers for the call primitives `closed_call` and `call` (`jax.named_call` in older JAX,
and the `closed_call`s that other handlers build).

Reads `call_jaxpr` and pulls it; the intermediates leave as extra outputs of the call.
"""

from __future__ import annotations

from jax.extend.core.primitives import call_p, closed_call_p

from .._compat import call_jaxpr, call_params
from .._interpreter import pull_jaxpr, pull_open_jaxpr, register_handler, with_extra_outputs


def _closed_call_handler(eqn):
    jaxpr, metas = pull_jaxpr(call_jaxpr(eqn.params))
    new_avals = jaxpr.out_avals[len(eqn.outvars) :]
    return with_extra_outputs(eqn, new_avals, **call_params(eqn.params, jaxpr)), metas


def _call_handler(eqn):
    jaxpr, metas = pull_open_jaxpr(call_jaxpr(eqn.params))
    new_avals = [x.aval for x in jaxpr.outvars[len(eqn.outvars) :]]
    return with_extra_outputs(eqn, new_avals, **call_params(eqn.params, jaxpr)), metas


register_handler(closed_call_p, _closed_call_handler)
register_handler(call_p, _call_handler)

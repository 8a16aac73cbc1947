"""Tracing the rule of a custom-derivative equation (a `custom_jvp`'s JVP, a `custom_vjp`'s
`fwd`) as JAX traces it when it differentiates, for the marks in it; and telling a library's
rule from a user's. Written against JAX 0.8 -- 0.12 (`jvp_jaxpr_fun`, `fwd_jaxpr_thunk`, both
memoized `WrappedFun`s in the equation's params).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jex
from jax.extend import linear_util as linear_util_api

from .._jax.primitive_params import custom_primal

__all__ = ["custom_rule", "custom_rule_in_library", "custom_rule_inputs", "custom_rule_params"]


def custom_rule(params: dict) -> jex.ClosedJaxpr:
    """The rule of a `custom_jvp_call` or `custom_vjp_call` equation, traced as JAX traces it
    when it differentiates: the JVP with a tangent for every inexact input (inputs: the
    non-constant primals, then those tangents; outputs: the primal outputs, then the nonzero
    tangents), or `fwd` (inputs: the non-constant primals; outputs: residuals and primal
    outputs), told that no input is perturbed (which matters only to a rule with
    `symbolic_zeros=True`, and equinox's forbid perturbing some). JAX 0.8 -- 0.12:
    `jvp_jaxpr_fun(*symbolic_zeros)`, `fwd_jaxpr_thunk(*perturbed)`, both memoized."""
    avals = custom_primal(params).in_avals[params["num_consts"] :]
    if "jvp_jaxpr_fun" in params:
        zeros = [not jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in avals]
        jaxpr, consts, _ = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    else:
        jaxpr, consts = params["fwd_jaxpr_thunk"].call_wrapped(*[False] * len(avals))
    return jex.ClosedJaxpr(jaxpr, consts)


def custom_rule_in_library(params: dict) -> bool:
    """Whether the rule of a `custom_jvp_call`/`custom_vjp_call` is defined in an installed
    package (JAX's `defjvps`, equinox, a solver library) rather than in the user's code (the
    file in its debug info, JAX 0.8 -- 0.12: `"name at file:line"`)."""
    key = "jvp_jaxpr_fun" if "jvp_jaxpr_fun" in params else "fwd_jaxpr_thunk"
    source = params[key].debug_info.func_src_info or ""
    return "site-packages" in source or "dist-packages" in source


def custom_rule_inputs(params: dict) -> int:
    """How many of `custom_rule`'s inputs are primals (the others are tangents)."""
    return len(custom_primal(params).in_avals) - params["num_consts"]


def custom_rule_params(params: dict, transform: Callable) -> dict:
    """`params` whose rule (`custom_rule`'s, whenever JAX traces it) is `transform(jaxpr)`, a
    function of the open jaxpr."""
    key = "jvp_jaxpr_fun" if "jvp_jaxpr_fun" in params else "fwd_jaxpr_thunk"
    traced = params[key]

    def rule(*flags):
        jaxpr, *rest = traced.call_wrapped(*flags)
        return (transform(jaxpr), *rest)

    return dict(params, **{key: linear_util_api.wrap_init(rule, debug_info=traced.debug_info)})

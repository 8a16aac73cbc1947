"""JAX's trace state and rule tables as statax reads them (JAX 0.8 -- 0.12): the trace in
force, the trace context, derivative tracers, batching and linearization rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from jax.interpreters import ad as ad_api  # isort: skip

from jax.interpreters import batching as batching_api  # isort: skip


from jax._src import config as jax_config  # isort: skip

from jax._src import core  # isort: skip

from jax._src.array import ArrayImpl as ARRAY_TYPE  # isort: skip  (what `jax.Array`s are)


from jax._src.interpreters import ad, batching  # isort: skip


__all__ = [
    "ARRAY_TYPE",
    "batched_outputs",
    "batching_rule",
    "current_trace",
    "differentiated",
    "eager",
    "set_batching_rule",
    "trace_context",
]

_DIFFERENTIATION_TRACERS = (ad_api.JVPTracer, ad.LinearizeTracer)  # JAX 0.8 -- 0.12


def differentiated(x: Any) -> bool:
    """Whether `x` is a tracer of a differentiation (`jvp`, `linearize`, and so `grad`), maybe
    under other transformations (a `vmap` of it: a tracer whose `val` is one)."""
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, _DIFFERENTIATION_TRACERS):
            return True
        x = getattr(x, "val", None)
    return False


def trace_context() -> tuple:
    """Everything in JAX's configuration that changes what tracing produces (x64, disable_jit,
    matmul precision, promotion rules, meshes, statax's own states, ...), hashable: the part of
    `jax.jit`'s cache key that is not the arguments. `jax._src.config` in JAX 0.8 -- 0.12."""
    return jax_config.trace_context()


# Since JAX 0.9 (or so) a linearization rule takes `is_vjp` first; since JAX 0.11.2 it also
# returns a structured residual, which its linear function takes after the residuals.
_TAKES_IS_VJP = "_is_vjp" in ad.fallback_linearize_rule.__code__.co_varnames
_STRUCTURED_RESIDUALS = "structured_res" in ad.LinearizeTrace.process_primitive.__code__.co_varnames


def register_linearization_rule(prim: jex.Primitive, rule: Callable) -> None:
    """Register `rule(nonzeros, *primals, **params) -> (primals_out, nonzeros_out, linear)`,
    `linear(*tangents) -> tangents_out` needing no residuals, as what `jax.grad`'s
    linearization runs for `prim` (by default it traces `prim`'s JVP rule per equation)."""

    def lin(nonzeros, *primals, **params):
        out, nonzeros_out, linear = rule(nonzeros, *primals, **params)
        if _STRUCTURED_RESIDUALS:
            return out, nonzeros_out, (), None, lambda _res, _structured, *t: linear(*t)
        return out, nonzeros_out, (), lambda _res, *t: linear(*t)

    if _TAKES_IS_VJP:
        ad.primitive_linearizations[prim] = lambda _is_vjp, *args, **params: lin(*args, **params)
    else:
        ad.primitive_linearizations[prim] = lin


class _TraceContext:
    """The trace in force as `value` (JAX 0.8 -- 0.9, where `core.trace_ctx` holds it)."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        return core.trace_ctx.trace


# The trace that a `bind` now goes to, as `TRACE.value`: the state that `core.trace_ctx.trace`
# reads (JAX 0.10 -- 0.12), read without the property, since a mark reads it every time.
TRACE = getattr(core, "trace_state_strong_ref", None) or _TraceContext()


def current_trace() -> Any:
    """The trace that a `bind` now goes to (`jax._src.core.trace_ctx.trace` in JAX 0.8 -- 0.12)."""
    return TRACE.value


def eager() -> bool:
    """Whether a `bind` now runs at once (no trace in force: `EvalTrace`, JAX 0.8 -- 0.12)."""
    return type(TRACE.value) is core.EvalTrace


def batching_rule(prim: jex.Primitive) -> Callable | None:
    """`prim`'s batching rule, `rule(axis_data, args, dims, **params) -> (outs, out_dims)`
    (JAX's "fancy" batchers, 0.5+), or `None`."""
    return batching_api.fancy_primitive_batchers.get(prim)


def set_batching_rule(prim: jex.Primitive, rule: Callable | None) -> None:
    """Set (or, with `None`, remove) a rule of the kind `batching_rule` returns."""
    if rule is None:
        batching_api.fancy_primitive_batchers.pop(prim, None)
    else:
        batching_api.fancy_primitive_batchers[prim] = rule


def batched_outputs(closed: jex.ClosedJaxpr, axis_data: Any, in_batched: Sequence[bool]) -> list:
    """Which outputs of `closed` are batched under `vmap` when `in_batched` inputs are (JAX's
    own batching rules decide; `batch_jaxpr`'s signature is unchanged in JAX 0.8 -- 0.12)."""
    return list(batching.batch_jaxpr(closed, axis_data, tuple(in_batched), False)[1])


def is_symbolic_zero(tangent: Any) -> bool:
    """Whether a tangent in a JVP rule is JAX's symbolic zero (`jax.interpreters.ad.Zero`)."""
    return isinstance(tangent, ad_api.Zero)


def instantiate(ct: Any, primal: Any) -> Any:
    """A cotangent in a transpose rule as an array: a symbolic zero as zeros of its type."""
    if isinstance(ct, ad_api.Zero):
        return ad_api.instantiate_zeros(ct)
    return ct

"""Registering the rules of statax's own primitives (`save_inter`, `get_state`, `set_state`)
in JAX's rule tables: lowering, JVP, transpose, batching, and `jax.checkpoint`'s partial
evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jax.extend import core as jex

from jax.interpreters import ad as ad_api  # isort: skip

from jax.interpreters import batching as batching_api  # isort: skip

from jax.interpreters import mlir as mlir_api  # isort: skip

from jax.interpreters import partial_eval as pe_api  # isort: skip


__all__ = [
    "register_batching_rule",
    "register_jvp_rule",
    "register_lowering",
    "register_lowering_identity",
    "register_remat_partial_eval_rule",
    "register_transpose_rule",
    "remat_split",
]


def register_lowering_identity(prim: jex.Primitive, only_reads: Callable[[dict], bool]) -> None:
    """Lower `prim` to no op at all: its outputs are its operands, or, where
    `only_reads(params)`, it has none."""
    mlir_api.register_lowering(
        prim, lambda ctx, *xs, **params: [] if only_reads(params) else list(xs)
    )


def register_lowering(prim: jex.Primitive, rule: Callable) -> None:
    """Lower `prim` with `rule(ctx, *xs, **params)` (for statax's state primitives, which only
    raise: they never reach a compiler)."""
    mlir_api.register_lowering(prim, rule)


def register_jvp_rule(prim: jex.Primitive, rule: Callable) -> None:
    ad_api.primitive_jvps[prim] = rule


def register_transpose_rule(prim: jex.Primitive, rule: Callable) -> None:
    ad_api.primitive_transposes[prim] = rule


def register_batching_rule(prim: jex.Primitive, rule: Callable) -> None:
    """Register `rule(axis_size, vals, dims, **params) -> (vals, dims)`.

    The rule runs for every bind under `vmap`, also when no operand is batched (JAX's
    "fancy" batchers, 0.5+), and `None` marks an unbatched value.
    """

    def fancy(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    batching_api.fancy_primitive_batchers[prim] = fancy


def remat_split(eqn: jex.JaxprEqn, inst_in: Sequence[bool], unknown: bool, replay=None) -> tuple:
    """What a `jax.checkpoint` partial-evaluation rule returns for `eqn`, an equation whose
    outputs have its inputs' types: with `unknown` inputs, staged whole (its known inputs the
    residuals); else run once in the forward pass, and in the backward pass `replay` (an
    equation, or `None` for nothing: its outputs are then known)."""
    residuals = [
        v
        for v, inst in zip(eqn.invars, inst_in, strict=True)
        if isinstance(v, jex.Var) and not inst
    ]
    n = len(eqn.outvars)
    if unknown:
        return None, eqn, [True] * n, [True] * n, residuals
    if replay is None:
        return eqn, None, [False] * n, [False] * n, []
    return eqn, replay, [False] * n, [True] * n, residuals


def register_remat_partial_eval_rule(prim: jex.Primitive, rule: Callable) -> None:
    """Register `rule(saveable, unks_in, inst_in, eqn) -> (known_eqn, staged_eqn, unks_out,
    inst_out, residuals)`, how `jax.checkpoint`'s partial evaluation splits an equation of
    `prim` (signature unchanged in JAX 0.8 -- 0.12)."""
    pe_api.partial_eval_jaxpr_custom_rules[prim] = rule

"""The one module that touches JAX internals.

Every use of `jax._src` or of a version-specific signature lives here, each with the JAX
versions it was written against, so that a new JAX release is an afternoon's work: run the
tests, fix this file. Everything else in statax imports only public JAX
(`jax`, `jax.extend.core`, `jax.tree_util`) and this module.

Tested against JAX 0.8.0 -- 0.10.2 (see `pyproject.toml`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import linear_util as lu  # all supported versions
from jax._src import source_info_util  # all supported versions
from jax._src.interpreters import ad, batching, mlir  # all supported versions
from jax._src.interpreters import partial_eval as pe  # all supported versions
from jax.extend import core as jex

__all__ = [
    "JIT_PRIMITIVE",
    "UNSPECIFIED_SHARDING",
    "extend_debug_info",
    "jaxprs_in_params",
    "keep_marked_calls_alive",
    "bind",
    "register_batching_rule",
    "register_rebatching",
    "trace",
    "register_dce_rule",
    "register_jvp_rule",
    "register_lowering_identity",
    "register_remat_partial_eval_rule",
    "register_transpose_rule",
    "user_context",
]

# Public in `jax.extend.core` since JAX 0.9; `jax._src.core` before.
jaxprs_in_params = getattr(jex, "jaxprs_in_params", None)
if jaxprs_in_params is None:
    from jax._src.core import jaxprs_in_params  # noqa: F401

# `jit_p` (named "jit") since JAX 0.7; `pjit_p` before.
JIT_PRIMITIVE: jex.Primitive = getattr(jex.primitives, "jit_p", None) or jex.primitives.pjit_p

# The sharding that leaves the choice to the compiler, used for the outputs `pull` adds to a jit.
from jax._src.sharding_impls import UNSPECIFIED as UNSPECIFIED_SHARDING  # noqa: E402


def register_lowering_identity(prim: jex.Primitive) -> None:
    """Lower `prim` to no op at all: its outputs are its operands."""
    mlir.register_lowering(prim, lambda ctx, *xs, **params: list(xs))


def register_jvp_rule(prim: jex.Primitive, rule: Callable) -> None:
    ad.primitive_jvps[prim] = rule


def register_transpose_rule(prim: jex.Primitive, rule: Callable) -> None:
    ad.primitive_transposes[prim] = rule


def is_undefined_primal(x: Any) -> bool:
    return ad.is_undefined_primal(x)


def register_batching_rule(prim: jex.Primitive, rule: Callable) -> None:
    """Register `rule(axis_size, vals, dims, **params) -> (vals, dims)`.

    The rule runs for every bind under `vmap`, also when no operand is batched (JAX's
    "fancy" batchers, 0.5+), and `None` marks an unbatched value.
    """

    def fancy(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    batching.fancy_primitive_batchers[prim] = fancy


def register_dce_rule(prim: jex.Primitive, keep: Callable[[jex.JaxprEqn], bool]) -> None:
    """Keep an equation through JAX's dead-code elimination when `keep(eqn)` is true."""

    def rule(used_outputs, eqn):
        if keep(eqn) or any(used_outputs):
            return [True] * len(eqn.invars), eqn
        return [False] * len(eqn.invars), None

    pe.dce_rules[prim] = rule


def keep_marked_calls_alive(holds_marks: Callable[[jex.JaxprEqn], bool]) -> None:
    """Stop JAX's dead-code elimination from dropping a whole higher-order equation (a jit, a
    cond, a scan, ...) whose outputs are all unused but whose inner jaxprs hold marks.

    JAX's DCE rules for call-like primitives drop such an equation outright, without looking
    inside; the rule for `save_inter_p` itself only keeps marks in equations that survive. So
    each registered DCE rule is wrapped: where `holds_marks(eqn)` and no output is used, it
    runs as if every output were used. Elsewhere the rule runs unchanged.
    """
    for prim, rule in list(pe.dce_rules.items()):
        if getattr(rule, "_statax_wrapped", False):
            continue

        def wrapped(used_outputs, eqn, _rule=rule):
            if not any(used_outputs) and holds_marks(eqn):
                used_outputs = [True] * len(used_outputs)
            return _rule(used_outputs, eqn)

        wrapped._statax_wrapped = True
        pe.dce_rules[prim] = wrapped


def register_remat_partial_eval_rule(
    prim: jex.Primitive, recompute_params: Callable[[dict], dict]
) -> None:
    """How `jax.checkpoint`'s partial evaluation splits an identity primitive.

    With known inputs, the equation runs in the forward ("known") pass as it is; the copy that
    rematerialisation replays in the backward ("staged") pass gets `recompute_params(params)`.
    With unknown inputs it is staged whole.
    """

    def rule(saveable, unks_in, inst_in, eqn):
        residuals = [
            v
            for v, inst in zip(eqn.invars, inst_in, strict=True)
            if isinstance(v, jex.Var) and not inst
        ]
        n = len(eqn.outvars)
        if any(unks_in):
            return None, eqn, [True] * n, [True] * n, residuals
        staged = eqn.replace(params=recompute_params(eqn.params))
        return eqn, staged, [False] * n, [True] * n, residuals

    pe.partial_eval_jaxpr_custom_rules[prim] = rule


def trace(fn: Callable, in_avals: Sequence[Any], name: str = "statax") -> jex.ClosedJaxpr:
    """Trace `fn(*args) -> list of arrays` at exactly `in_avals` (shardings, manual axes and
    weak types included, which `jax.make_jaxpr` of `ShapeDtypeStruct`s would not keep)."""
    debug_info = lu.DebugInfo("statax", name, None, None)
    wrapped = lu.wrap_init(lambda *args: list(fn(*args)), debug_info=debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jex.ClosedJaxpr(jaxpr, consts)


def bind(prim: jex.Primitive, args: Sequence[Any], params: dict) -> Any:
    """Bind `prim` with an equation's `params`, as `eval_jaxpr` does (custom derivatives keep
    functions in their params that `bind` takes as leading arguments)."""
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX < 0.9: (subfuns, params)
        subfuns, bind_params = bind_params
        return prim.bind(*subfuns, *args, **bind_params)
    return prim.bind(*args, **bind_params)


def register_rebatching(prim: jex.Primitive, needs_rebatching: Callable[[dict], bool],
                        staged: Callable[..., Sequence[Any]]) -> None:
    """Run `staged(*args, **params)` instead of `prim`'s own batching rule where
    `needs_rebatching(params)`.

    JAX batches a `cond`, `scan` or `while` as a whole, before `pull` sees it (a batched `cond`
    even becomes a select over both branches). Where such a primitive holds marks, `staged`
    takes the intermediates out of it (as `pull`'s handler does) and marks them again outside;
    it is traced per example and batched with JAX's own rules, in which `prim` holds no marks
    any more and so is batched by its own rule. Elsewhere the original rule runs untouched.
    """
    original = batching.fancy_primitive_batchers[prim]

    def rule(axis_data, args, dims, **params):
        if not needs_rebatching(params):
            return original(axis_data, args, dims, **params)
        in_avals = [
            jex.mapped_aval(axis_data.size, d, jax.typeof(x)) if d is not None else jax.typeof(x)
            for x, d in zip(args, dims, strict=True)
        ]
        closed = trace(lambda *a: staged(*a, **params), in_avals, name=f"statax_{prim}")
        batched, out_dims = batching.batch_jaxpr2(closed, axis_data, tuple(dims))
        return jex.jaxpr_as_fun(batched)(*args), list(out_dims)

    rule._statax_original = original
    batching.fancy_primitive_batchers[prim] = rule


def extend_debug_info(debug_info: Any, names: Sequence[str]) -> Any:
    """The debug info of a jaxpr whose outputs gained `names` at the end."""
    if debug_info is None:
        return None
    paths = debug_info.result_paths
    if callable(paths):
        paths = tuple(paths())
    if not isinstance(paths, tuple):
        return debug_info._replace(result_paths=None)
    return debug_info._replace(result_paths=paths + tuple(names))


def user_context(eqn: jex.JaxprEqn):
    """Attribute errors raised while handling `eqn` to the user's line that made it."""
    return source_info_util.user_context(eqn.source_info.traceback)

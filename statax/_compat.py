"""The one module that touches JAX internals.

Every use of `jax._src` or of a version-specific signature lives here, each with the JAX
versions it was written against, so that a new JAX release is an afternoon's work: run the
tests, fix this file. Everything else in statax imports only public JAX
(`jax`, `jax.extend.core`, `jax.tree_util`) and this module.

Tested against JAX 0.8.0 -- 0.12.0.1 (see `pyproject.toml` and `docs/maintaining.md`). A branch
on the version or on behaviour says, in a comment, which versions each side covers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex

# Public modules of JAX's (`jax.interpreters`, `jax.extend`) for what they hold, in every
# supported version (0.8.0 -- 0.12): the rule tables, `dce_jaxpr`, tracing to a jaxpr.
from jax.extend import linear_util as linear_util_api  # isort: skip
from jax.extend import source_info_util as source_info_api  # isort: skip
from jax.interpreters import ad as ad_api  # isort: skip
from jax.interpreters import batching as batching_api  # isort: skip
from jax.interpreters import mlir as mlir_api  # isort: skip
from jax.interpreters import partial_eval as pe_api  # isort: skip

# Private modules, present in every supported version (0.8.0 -- 0.12), for the rest.
from jax._src import api_util  # isort: skip
from jax._src import config as jax_config  # isort: skip
from jax._src import core, dispatch, source_info_util  # isort: skip
from jax._src import effects as effects_lib  # isort: skip
from jax._src import linear_util as lu  # isort: skip
from jax._src.interpreters import ad, batching  # isort: skip
from jax._src.interpreters import partial_eval as pe  # isort: skip
from jax._src.lax import lax as lax_internal  # isort: skip

__all__ = [
    "HI_PRIMITIVE",
    "JAX_VERSION",
    "JIT_PRIMITIVE",
    "PLANTING",
    "PULLING",
    "REMAT_PRIMITIVE",
    "SAVE_EFFECT",
    "SCOPE",
    "SELECTION",
    "DIFFERENTIATING",
    "SHARD_MAP_PRIMITIVE",
    "STAGED_TRACER",
    "STATEFUL",
    "STATE_EFFECT",
    "UNSPECIFIED_SHARDING",
    "LinearSolveParts",
    "ScanParts",
    "ShardMapParts",
    "VARY_PRIMITIVES",
    "WhileParts",
    "as_equation",
    "batch_traced",
    "batched_outputs",
    "batching_rule",
    "bind",
    "call_jaxpr",
    "call_params",
    "cond_branches",
    "cond_params",
    "current_trace",
    "custom_params",
    "custom_primal",
    "custom_rule",
    "custom_rule_in_library",
    "custom_rule_inputs",
    "custom_rule_params",
    "dce",
    "debug_info",
    "defines_nothing",
    "differentiated",
    "eager",
    "equations",
    "extend_debug_info",
    "hi_expand",
    "hi_jaxprs",
    "jaxprs_in_params",
    "jit_call_params",
    "jit_jaxpr",
    "jit_params",
    "linear_solve_params",
    "linear_solve_parts",
    "new_equation",
    "observe",
    "observe_staged",
    "register_batching_rule",
    "register_jvp_rule",
    "register_lowering",
    "register_lowering_identity",
    "register_readers",
    "register_remat_partial_eval_rule",
    "rebind_vary",
    "register_transpose_rule",
    "remat_split",
    "restage",
    "scan_params",
    "set_batching_rule",
    "scan_parts",
    "shard_map_manual_axes",
    "shard_map_parts",
    "staged",
    "staged_as_held",
    "staging_trace",
    "trace_context",
    "trace",
    "trace_length",
    "tracer_of",
    "user_context",
    "var_of",
    "vary",
    "while_parts",
    "wraps_jaxpr",
    "zeros",
]

# (major, minor, patch) of the JAX in use; branches below name the versions they cover.
JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__[:3])

# Public in `jax.extend.core` since JAX 0.9; `jax._src.core` before.
jaxprs_in_params = getattr(jex, "jaxprs_in_params", None)
if jaxprs_in_params is None:
    from jax._src.core import jaxprs_in_params  # noqa: F401


def equations(jaxpr: Any):
    """Every equation of `jaxpr` (open or closed) and of the jaxprs in their params, at any
    depth, in program order (an equation before those inside it)."""
    if wraps_jaxpr(jaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)


def wraps_jaxpr(jaxpr: Any) -> bool:
    """Whether `jaxpr` is a `ClosedJaxpr` wrapping a separate open `Jaxpr` (JAX 0.8 -- 0.10).

    Since JAX 0.11 `ClosedJaxpr` is `Jaxpr` itself, with its consts attached, and `.jaxpr`
    returns the same object: there is nothing to unwrap, and recursing into `.jaxpr` would not
    end."""
    return isinstance(jaxpr, jex.ClosedJaxpr) and jaxpr.jaxpr is not jaxpr


class SaveEffect(effects_lib.Effect):
    """Carried by a mark while a `pull` traces it, so that no transformation drops it.

    JAX removes effect-free equations whose outputs are unused in many places (dead-code
    elimination, and tracing that drops such equations as it goes, as the linearisation of
    JAX 0.9+ does); an effect keeps them. `pull` removes every mark it collects, and its effect
    with it, so the programs it returns carry no effect. Marks traced outside a `pull` carry no
    effect and cost nothing.
    """

    def __repr__(self) -> str:
        return "SaveEffect"


class StateEffect(effects_lib.Effect):
    """Carried by `get_state` and `set_state` (which exist only while `stateful` traces), for
    the reason `SaveEffect` is: no transformation may drop a read or a write of state.
    `stateful` replaces every one of them, so the programs it returns carry no effect."""

    def __repr__(self) -> str:
        return "StateEffect"


SAVE_EFFECT = SaveEffect()
STATE_EFFECT = StateEffect()
for _allowed in (
    effects_lib.control_flow_allowed_effects,
    effects_lib.custom_derivatives_allowed_effects,
    effects_lib.remat_allowed_effects,
    effects_lib.lowerable_effects,
    effects_lib.partial_eval_kept_effects,
):
    _allowed.add_type(SaveEffect)
    _allowed.add_type(StateEffect)

# Whether a `pull` is tracing. Part of JAX's trace context, so that `jax.jit` caches the traces
# it makes inside a `pull` (whose marks carry `SaveEffect`) apart from the others.
PULLING = jax_config.bool_state(
    "statax_pulling",
    False,
    "Internal to statax: true while statax.pull traces a function.",
    include_in_trace_context=True,
)

# The prefix of `statax.scope`s in force ("encoder/attn/"), also part of the trace context, so
# that a function `jax.jit` traced in one scope is traced again in another.
SCOPE = jax_config.string_or_object_state(
    "statax_scope",
    "",
    "Internal to statax: the prefix of the statax.scope in force.",
    include_in_trace_context=True,
)


# The `plant` in force (a `statax._plant.Planting`: which names take values in from outside,
# and their hooks), or None; part of the trace context as the selection is.
PLANTING = jax_config.string_or_object_state(
    "statax_planting",
    None,
    "Internal to statax: the plant in force.",
    include_in_trace_context=True,
)


# The selection of the `pull` tracing (`pull(fn, only=...)`), a predicate on StateMeta or None;
# part of the trace context for the same reason as the scope.
SELECTION = jax_config.string_or_object_state(
    "statax_selection",
    None,
    "Internal to statax: the selection (pull's only=) in force.",
    include_in_trace_context=True,
)


# The state a `stateful` traces with (a `statax._stateful.Given`: the names passed in and the
# kinds of their values), or None outside one; part of the trace context, so that a function
# `jax.jit` traced for one kind of state is traced again for another.
STATEFUL = jax_config.string_or_object_state(
    "statax_stateful",
    None,
    "Internal to statax: the state passed to the statax.stateful tracing.",
    include_in_trace_context=True,
)


# Whether the `pull` tracing has inputs that are being differentiated (`jax.jvp(pull(f))`,
# `jax.grad(pull(f))`): then the rules of custom derivatives run, and their marks are keys.
# Part of the trace context, so that the trace made for one is not used for the other.
DIFFERENTIATING = jax_config.bool_state(
    "statax_differentiating",
    False,
    "Internal to statax: true while statax.pull traces a function whose inputs are differentiated.",
    include_in_trace_context=True,
)

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


# `jit_p` (named "jit") since JAX 0.7; `pjit_p` before.
JIT_PRIMITIVE: jex.Primitive = getattr(jex.primitives, "jit_p", None) or jex.primitives.pjit_p
# `remat_p` is public in `jax.extend.core.primitives` since JAX 0.9.
REMAT_PRIMITIVE: jex.Primitive = getattr(jex.primitives, "remat_p", None)
if REMAT_PRIMITIVE is None:
    from jax._src.ad_checkpoint import remat_p as REMAT_PRIMITIVE  # noqa: N811
# `shard_map_p` is private in all supported versions.
from jax._src.shard_map import shard_map_p as SHARD_MAP_PRIMITIVE  # noqa: E402

# The sharding that leaves the choice to the compiler, used for the outputs `pull` adds to a jit.
from jax._src.sharding_impls import UNSPECIFIED as UNSPECIFIED_SHARDING  # noqa: E402


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


def register_batching_rule(prim: jex.Primitive, rule: Callable) -> None:
    """Register `rule(axis_size, vals, dims, **params) -> (vals, dims)`.

    The rule runs for every bind under `vmap`, also when no operand is batched (JAX's
    "fancy" batchers, 0.5+), and `None` marks an unbatched value.
    """

    def fancy(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    batching_api.fancy_primitive_batchers[prim] = fancy


def register_readers(prim: jex.Primitive, only_reads: Callable[[dict], bool]) -> None:
    """Keep the equations of `prim` where `only_reads(params)`: one with no outputs and no
    effect, which only reads its operands (as `observe` stages it), and which JAX would drop as
    dead wherever it looks for dead code. Elsewhere an equation of `prim` is treated as any
    other. Three of JAX's rule tables (JAX 0.8 -- 0.12):

    * dead-code elimination (`pe_api.dce_rules`; a rule takes `(used_outputs, eqn)` to 0.11 and
      `(used_outputs, live_inputs, eqn)` in 0.12), which keeps it only where the values it
      reads are live without it (`_live_anyway`): it never keeps alive what JAX would drop;
    * partial evaluation by `JaxprTrace` (`scan` hoisting its loop-invariant work, `linearize`
      of a primitive without a rule of its own; `pe_api.custom_partial_eval_rules`), which keeps
      the equation as it keeps an effectful one, in `effect_handles`, staged as
      `JaxprTrace.default_process_primitive` stages one, since no output tracer holds it;
    * staging a bind into a jaxpr (`eval_jaxpr` of a jaxpr holding it, a rule that binds it;
      `pe.custom_staging_rules`, `(trace, source_info, *tracers, **params)`), held as `observe`
      holds it, whatever the frame's auto-DCE (`linearize` traces tangents into a frame that
      drops what no output reads)."""

    def dce(used_outputs, *rest):
        eqn = rest[-1]
        if only_reads(eqn.params):
            if _live_anyway(eqn.invars, sys._getframe(1)):
                return [True] * len(eqn.invars), eqn
            return [False] * len(eqn.invars), None
        return pe._default_dce_rule(used_outputs, *rest)

    def partial_eval(trace, *tracers, **params):
        if not only_reads(params):
            return trace.default_process_primitive(prim, tracers, params)
        tracers = [trace.to_jaxpr_tracer(t) for t in tracers]
        if all(t.pval.is_known() for t in tracers):
            return trace.default_process_primitive(prim, tracers, params)
        tracers = [trace.instantiate_const(t) for t in tracers]
        name_stack = trace._current_truncated_name_stack()
        source = source_info_api.current().replace(name_stack=name_stack)
        recipe = pe.new_eqn_recipe(trace, tracers, [], prim, params, NO_EFFECTS, source)
        trace.effect_handles.append(pe.EffectHandle(tracers, recipe))
        return []

    def staging(trace, source_info, *tracers, **params):
        if only_reads(params):
            _stage_observer(trace, prim, list(tracers), params, source_info)
            return []
        return trace.default_process_primitive(prim, list(tracers), params, source_info)

    pe_api.dce_rules[prim] = dce
    pe_api.custom_partial_eval_rules[prim] = partial_eval
    pe.custom_staging_rules[prim] = staging


def _live_anyway(operands: Sequence[Any], frame) -> bool:
    """Whether every operand of an equation that only reads them is live without it, in the
    dead-code elimination `frame` is running: `pe._dce_jaxpr`, whose local `env` maps each
    variable to whether an equation after this one reads it (JAX 0.8 -- 0.12; equations are
    visited last to first, and a value is marked where it is made, before the program reads
    on). Where that is not what `frame` shows, it says no: the equation is dropped, as any
    equation that defines nothing is, so that it never keeps a value alive that JAX would
    have dropped (which a library can observe: Flax's `nn.scan` refuses a broadcast that
    depends on the carry)."""
    env = frame.f_locals.get("env") if frame.f_code.co_name == "_dce_jaxpr" else None
    if not isinstance(env, dict):
        return False
    return all(env.get(v, False) for v in operands if isinstance(v, jex.Var))


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


def trace(
    fn: Callable, in_avals: Sequence[Any], name: str = "statax", source: Callable | None = None
) -> jex.ClosedJaxpr:
    """Trace `fn(*args) -> list of arrays` at exactly `in_avals` (shardings, manual axes and
    weak types included, which `jax.make_jaxpr` of `ShapeDtypeStruct`s would not keep), without
    `jax.make_jaxpr`'s work around the trace (a `jit` object, argument names from a signature).
    With `source`, JAX's messages name that function (`"f at file.py:3"`) rather than `name`."""
    wrapped = linear_util_api.wrap_init(
        lambda *args: list(fn(*args)), debug_info=debug_info(name, source)
    )
    jaxpr, _, consts = pe_api.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jex.ClosedJaxpr(jaxpr, consts)


def debug_info(name: str, source: Callable | None = None) -> Any:
    """A jaxpr's debug info: made by `name`, from `source` where given."""
    where = name if source is None else api_util.fun_sourceinfo(source)
    return lu.DebugInfo(name, where, None, None)


class _TraceContext:
    """The trace in force as `value` (JAX 0.8 -- 0.9, where `core.trace_ctx` holds it)."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        return core.trace_ctx.trace


# The trace that a `bind` now goes to, as `_TRACE.value`: the state that `core.trace_ctx.trace`
# reads (JAX 0.10 -- 0.12), read without the property, since a mark reads it every time.
_TRACE = getattr(core, "trace_state_strong_ref", None) or _TraceContext()


def current_trace() -> Any:
    """The trace that a `bind` now goes to (`jax._src.core.trace_ctx.trace` in JAX 0.8 -- 0.12)."""
    return _TRACE.value


def eager() -> bool:
    """Whether a `bind` now runs at once (no trace in force: `EvalTrace`, JAX 0.8 -- 0.12)."""
    return type(_TRACE.value) is core.EvalTrace


NO_EFFECTS = core.no_effects


def stage(prim: jex.Primitive, args: Sequence[Any], params: dict, effects) -> list | None:
    """Stage an equation of `prim`, whose outputs have its inputs' types (an identity), into the
    jaxpr trace in force, when every one of `args` is a tracer of it: as `prim.bind` would, less
    its generic work (abstract evaluation, constant folding, checks that do not apply, the
    Python traceback). `None` elsewhere: then bind. (`DynamicJaxprTrace.emit_eqn`, and the
    source info context, the same in JAX 0.8 -- 0.12.)"""
    trace = _tracing_all(args)
    if trace is None:
        return None
    avals = [x.aval for x in args]
    # The context's source info (its name stack) without the Python traceback, which costs
    # as much as the rest: a mark lowers to nothing, and its meta has its location.
    source_info = source_info_util._source_info_context.context
    return trace.emit_eqn(list(args), avals, prim, params, effects, source_info)


def observe(prim: jex.Primitive, args: Sequence[Any], params: dict) -> bool:
    """Stage an equation of `prim` that reads `args` and defines nothing (it has no outputs:
    `prim`'s rules give none for `params`), into the jaxpr trace in force, when every one of
    `args` is a tracer of it; `False` elsewhere (then bind). The program reads on from `args`
    themselves, so the equation costs no variable or tracer; the frame holds it whatever its
    auto-DCE (as `DynamicJaxprTrace.emit_eqn` holds an effectful one, in JAX 0.8 -- 0.12), and
    `prim`'s rules keep it (`register_readers`)."""
    trace = _tracing_all(args)
    if trace is None:
        return False
    _stage_observer(trace, prim, list(args), params)
    return True


def _tracing_all(args: Sequence[Any]) -> Any:
    """The jaxpr trace in force, if every one of `args` is a tracer of it; else `None`."""
    trace = _TRACE.value
    if type(trace) is not pe.DynamicJaxprTrace:
        return None
    for x in args:
        if type(x) is not pe_api.DynamicJaxprTracer or x._trace is not trace:
            return None
    return trace


# The type of a tracer of a jaxpr being staged (`DynamicJaxprTracer`, JAX 0.8 -- 0.12).
STAGED_TRACER = pe_api.DynamicJaxprTracer


def observe_staged(prim: jex.Primitive, x: Any, params: dict) -> bool:
    """`observe` of one value, a `STAGED_TRACER`: all in one function, since every call counts
    where a mark is made."""
    trace = x._trace
    if trace is not _TRACE.value or type(trace) is not _JAXPR_TRACE:
        return False
    parent = x.parent  # the equation that made `x`
    frame = trace.frame
    if parent is None or frame.auto_dce or not _FRAME_HOLDS_TRACING_EQNS:
        _stage_observer(trace, prim, [x], params)
        return True
    # Made by an equation the frame holds for good (no auto-DCE), `x`'s variable stays defined
    # without `x`: the frame takes a `JaxprEqn` on it (as JAX's own `lower_jaxpr` stages one,
    # 0.10 -- 0.12), which costs half a `TracingEqn` and its conversion when the jaxpr is made.
    # Its source info and context are those of the equation that made `x` (looking up the
    # current ones costs as much again).
    frame.tracing_eqns.append(
        _JaxprEqn([x.val], [], prim, params, NO_EFFECTS, parent.source_info, parent.ctx)
    )
    return True


_JAXPR_TRACE, _JaxprEqn = pe.DynamicJaxprTrace, core.JaxprEqn


def _stage_observer(
    trace: Any, prim: jex.Primitive, args: list, params: dict, source_info: Any = None
) -> None:
    if source_info is None:
        source_info = source_info_util._source_info_context.context
    # The context of the equation that made the first input (JAX 0.10 -- 0.12 keep it as the
    # tracer's `parent`), rather than the current one, which costs as much as the rest to look
    # up: the equation lowers to nothing, and a `pull` takes it out.
    parent = getattr(args[0], "parent", None) if args else None
    ctx = _eqn_context() if parent is None else parent.ctx
    e = pe.TracingEqn(args, [], prim, params, NO_EFFECTS, source_info, ctx)
    trace.frame.tracing_eqns.append(_hold(e))


if hasattr(core, "current_jaxpr_eqn_context"):  # JAX 0.10 -- 0.12 (cached)
    _eqn_context = core.current_jaxpr_eqn_context
else:  # JAX 0.8 -- 0.9: as `DynamicJaxprTrace.make_eqn` makes it
    from jax._src import xla_metadata_lib  # isort: skip

    def _eqn_context() -> Any:
        return core.JaxprEqnContext(
            jax_config.compute_on_context_manager.value,
            jax_config.threefry_partitionable.value,
            xla_metadata_lib.current_xla_metadata(),
        )


def defines_nothing(eqn: jex.JaxprEqn) -> bool:
    """Whether `eqn` defines nothing: it has no outputs (as `observe` stages it), or only
    dropped ones (`_`)."""
    return all(type(v) is core.DropVar for v in eqn.outvars)


def trace_length(trace: Any) -> int:
    """How many equations `trace`, a jaxpr trace of `trace` above, has staged so far: the
    position in its jaxpr of the next one. `trace` (no auto-DCE) keeps them all, in order
    (`DynamicJaxprTrace.frame.tracing_eqns` in JAX 0.8 -- 0.12)."""
    return len(trace.frame.tracing_eqns)


def staging_trace() -> Any:
    """The trace in force if it stages a jaxpr whose equations `staged` and `restage` may read
    and edit (a `DynamicJaxprTrace` keeping every equation: no auto-DCE), else `None`."""
    trace = _TRACE.value
    if type(trace) is pe.DynamicJaxprTrace and not trace.frame.auto_dce:
        return trace
    return None


def staged(trace: Any, start: int) -> list[tuple[jex.JaxprEqn, Any]]:
    """`(equation, entry)` for each equation `trace` (of `staging_trace`) staged from position
    `start` on, `entry` being how its frame holds it.

    A frame holds `TracingEqn`s (inputs as tracers, read when the jaxpr is made) behind a
    callable (JAX 0.8 -- 0.9) or as they are (0.10 -- 0.12), where it also holds `JaxprEqn`s
    (`JaxprStackFrame.get_eqns`, which this mirrors)."""
    return [(as_equation(_held(entry)), entry) for entry in trace.frame.tracing_eqns[start:]]


def staged_as_held(trace: Any, start: int) -> list:
    """The equations of `staged`, as the frame holds them (a `TracingEqn` reads tracers where a
    `JaxprEqn` reads variables): enough to search them by primitive and params, without making
    an object per equation (which, for a long program, costs more in garbage collection than
    the search itself). `as_equation` makes one a `JaxprEqn`."""
    return [_held(entry) for entry in trace.frame.tracing_eqns[start:]]


def as_equation(e: Any) -> jex.JaxprEqn:
    """`e`, an equation of `staged_as_held`, as a `JaxprEqn`."""
    if isinstance(e, pe.TracingEqn):
        invars = [t.val for t in e.in_tracers]
        return core.JaxprEqn(invars, e.outvars, e.primitive, e.params, e.effects,
                             e.source_info, e.ctx)  # fmt: skip
    return e


def restage(trace: Any, start: int, eqns: Sequence[jex.JaxprEqn], old: Sequence[tuple]) -> None:
    """Make `eqns` what `trace` staged from position `start` on, in place of `old` (the pairs
    `staged` gave): an equation of `old` keeps its entry; a new one is staged as a
    `TracingEqn`, on the tracers the old ones read where it reads the same variables (a
    constant stays in the jaxpr while a tracer of it lives)."""
    entries = {id(eqn): entry for eqn, entry in old}
    tracers: dict[int, Any] = {}
    for _, entry in old:
        for t in getattr(_held(entry), "in_tracers", ()):
            tracers.setdefault(id(t.val), t)
    held = []
    for eqn in eqns:
        entry = entries.get(id(eqn))
        if entry is None:
            ins = [tracers.get(id(x)) for x in eqn.invars]
            ins = [tracer_of(trace, x) if t is None else t for t, x in zip(ins, eqn.invars)]
            entry = _hold(pe.TracingEqn(ins, eqn.outvars, eqn.primitive, eqn.params,
                                        eqn.effects, eqn.source_info, eqn.ctx))  # fmt: skip
        held.append(entry)
    trace.frame.tracing_eqns[start:] = held


# JAX 0.10 -- 0.12: a frame holds a `TracingEqn` itself; 0.8 -- 0.9 behind a callable.
_FRAME_HOLDS_TRACING_EQNS = "TracingEqn" in pe.JaxprStackFrame.get_eqns.__code__.co_names


def _same(x):
    return x


def _hold(e: Any) -> Any:
    """A frame's entry for `e`, a `TracingEqn`, held whatever the frame's auto-DCE."""
    return e if _FRAME_HOLDS_TRACING_EQNS else functools.partial(_same, e)


def _held(entry: Any) -> Any:
    """The equation a frame's entry holds (see `staged`)."""
    return entry() if callable(entry) else entry


def var_of(trace: Any, x: Any) -> Any:
    """The variable `x` is in `trace`'s jaxpr, if `x` is one of its tracers; else `None`."""
    if type(x) is pe_api.DynamicJaxprTracer and x._trace is trace:
        return x.val
    return None


def tracer_of(trace: Any, var: Any) -> Any:
    """A tracer of `trace` for `var`, a variable (or literal) of its jaxpr (JAX 0.8 -- 0.12)."""
    return pe_api.DynamicJaxprTracer(trace, var.aval, var)


def abstract_eval(prim: jex.Primitive, in_avals: Sequence[Any], params: dict) -> tuple:
    """`(out_avals, effects)` of `prim` bound with `params` on `in_avals` (as a list, for
    primitives with one result too), without a trace."""
    out_avals, effects = prim.abstract_eval(*in_avals, **params)
    return (list(out_avals) if prim.multiple_results else [out_avals]), effects


def new_equation(
    invars: Sequence[Any], outvars: Sequence[Any], prim: jex.Primitive, params: dict, effects
) -> jex.JaxprEqn:
    """A new equation (`jax.extend.core.new_jaxpr_eqn` in JAX 0.8 -- 0.11, deprecated there in
    0.12; `jax._src.core`'s in all)."""
    return core.new_jaxpr_eqn(list(invars), list(outvars), prim, params, effects)


def bind(prim: jex.Primitive, args: Sequence[Any], params: dict) -> Any:
    """Bind `prim` with an equation's `params`, as `eval_jaxpr` does (custom derivatives keep
    functions in their params that `bind` takes as leading arguments)."""
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX < 0.9: (subfuns, params)
        subfuns, bind_params = bind_params
        return prim.bind(*subfuns, *args, **bind_params)
    return prim.bind(*args, **bind_params)


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


def batch_traced(fn: Callable, axis_data: Any, args: Sequence, dims: Sequence) -> tuple:
    """Inside a batching rule: `fn` traced per example and batched with JAX's own rules, applied
    to `args` (batched along `dims`); returns `(outs, out_dims)`."""
    in_avals = [
        core.mapped_aval(axis_data.size, d, jax.typeof(x)) if d is not None else jax.typeof(x)
        for x, d in zip(args, dims, strict=True)
    ]
    closed = trace(fn, in_avals, name="statax_batched")
    batched, out_dims = batching.batch_jaxpr2(closed, axis_data, tuple(dims))
    return jex.jaxpr_as_fun(batched)(*args), list(out_dims)


# ---- what handlers read from and write to equations' params --------------------------------
#
# Handlers never read JAX's param names themselves: a rename in a new JAX release is a change
# here. Each primitive family has a view (`*_parts`) and a way back (`*_params`).


class ScanParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr  # (consts, carry, xs) -> (carry, ys)
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int


# JAX 0.11 replaced scan's `num_consts`/`num_carry` (and, in 0.8 -- 0.9, `linear` and
# `_split_transpose`) by `ft_in`/`ft_out`: `FlatTree`s of (consts, carry, xs) and (carry, ys).
_SCAN_FLAT_TREES = JAX_VERSION >= (0, 11)
if _SCAN_FLAT_TREES:
    from jax._src import flattree as ft  # JAX 0.11+


def scan_parts(params: dict) -> ScanParts:
    """The parts of a `scan` equation, whatever JAX names them."""
    if _SCAN_FLAT_TREES:  # JAX 0.11+
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    else:  # JAX 0.8 -- 0.10
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    return ScanParts(
        params["jaxpr"],
        num_consts,
        num_carry,
        params["length"],
        params["reverse"],
        params["unroll"],
    )


def scan_params(params: dict, parts: ScanParts) -> dict:
    """`params` of a `scan` equation rewritten to `parts` (whose jaxpr may have more ys, or more
    consts, carries or xs, than the original)."""
    jaxpr, num_consts, num_carry = parts.jaxpr, parts.num_consts, parts.num_carry
    num_xs = len(jaxpr.in_avals) - num_consts - num_carry
    num_ys = len(jaxpr.out_avals) - num_carry
    new = dict(params, jaxpr=jaxpr, length=parts.length, reverse=parts.reverse, unroll=parts.unroll)
    if _SCAN_FLAT_TREES:  # JAX 0.11+
        new["ft_in"] = ft.pack((ft.nones(num_consts), ft.nones(num_carry), ft.nones(num_xs)))
        new["ft_out"] = ft.pack((ft.nones(num_carry), ft.nones(num_ys)))
        return new
    new.update(num_consts=num_consts, num_carry=num_carry)
    if "linear" in params:  # JAX 0.8 -- 0.9
        new["linear"] = (False,) * len(jaxpr.in_avals)
    return new


class WhileParts(NamedTuple):
    cond_jaxpr: jex.ClosedJaxpr  # (cond_consts, carry) -> pred
    body_jaxpr: jex.ClosedJaxpr  # (body_consts, carry) -> carry
    cond_nconsts: int
    body_nconsts: int


def while_parts(params: dict) -> WhileParts:
    """The parts of a `while` equation (names unchanged in JAX 0.8 -- 0.12)."""
    return WhileParts(
        params["cond_jaxpr"], params["body_jaxpr"], params["cond_nconsts"], params["body_nconsts"]
    )


def cond_branches(params: dict) -> tuple:
    """The branches of a `cond` equation (`lax.cond`'s false branch first)."""
    return tuple(params["branches"])


def cond_params(params: dict, branches: Sequence) -> dict:
    return dict(params, branches=tuple(branches))


def jit_jaxpr(params: dict) -> jex.ClosedJaxpr:
    return params["jaxpr"]


def jit_params(params: dict, jaxpr: jex.ClosedJaxpr) -> dict:
    """A `jit` equation's params for `jaxpr`, which takes the original inputs followed by new
    ones and returns the original outputs followed by new ones: those get unspecified sharding
    and default layout (the compiler chooses), and are not donated."""
    k = len(jaxpr.out_avals) - len(params["out_shardings"])
    i = len(jaxpr.in_avals) - len(params["in_shardings"])
    return dict(
        params,
        jaxpr=jaxpr,
        out_shardings=(*params["out_shardings"], *(UNSPECIFIED_SHARDING,) * k),
        out_layouts=(*params["out_layouts"], *(None,) * k),
        in_shardings=(*params["in_shardings"], *(UNSPECIFIED_SHARDING,) * i),
        in_layouts=(*params["in_layouts"], *(None,) * i),
        donated_invars=(*params["donated_invars"], *(False,) * i),
    )


@functools.cache
def _empty_jit_params() -> dict:
    (eqn,) = jax.make_jaxpr(jax.jit(lambda: ()))().eqns
    return dict(eqn.params)


def jit_call_params(jaxpr: jex.ClosedJaxpr, name: str) -> dict:
    """The params of a new `jit` equation that calls `jaxpr` (unspecified shardings, default
    layouts, nothing donated, `inline` as `jax.jit` has it: `False` before JAX 0.12,
    `Inline.AUTO` since): binding `JIT_PRIMITIVE` with them stages one equation into a trace,
    where evaluating `jaxpr` would stage each of its equations again."""
    return dict(jit_params(_empty_jit_params(), jaxpr), name=name)


def call_jaxpr(params: dict):
    """The function of a `closed_call`/`call`/`checkpoint` equation (closed or open jaxpr)."""
    return params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]


def checkpoint_options(params: dict) -> dict:
    """`jax.checkpoint`'s keyword arguments that a `checkpoint` equation was made with."""
    return {"prevent_cse": params.get("prevent_cse", True), "policy": params.get("policy")}


def call_params(params: dict, jaxpr) -> dict:
    key = "call_jaxpr" if "call_jaxpr" in params else "jaxpr"
    return dict(params, **{key: jaxpr})


def custom_primal(params: dict) -> jex.ClosedJaxpr:
    """The primal function of a `custom_jvp_call`/`custom_vjp_call` equation."""
    return params["call_jaxpr"]


def custom_params(params: dict, primal: jex.ClosedJaxpr) -> dict:
    return dict(params, call_jaxpr=primal)


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


def zeros(aval: Any) -> jax.Array:
    """Zeros of exactly `aval`'s type: weak type, sharding and varying manual axes included
    (`lax.zeros_like_shaped_array`, JAX 0.8 -- 0.12)."""
    return lax_internal.zeros_like_shaped_array(aval)


def dce(
    jaxpr: jex.Jaxpr, used_outputs: Sequence[bool], keep: bool | Sequence[bool] = False
) -> tuple[jex.Jaxpr, list[bool]]:
    """`jaxpr` with only `used_outputs`, and which inputs it still takes: those they use and
    those `keep` keeps. `pe_api.dce_jaxpr`, unchanged in JAX 0.8 -- 0.12."""
    return pe_api.dce_jaxpr(
        jaxpr, list(used_outputs), keep if isinstance(keep, bool) else list(keep)
    )


class LinearSolveParts(NamedTuple):
    jaxprs: Any  # namedtuple (matvec, vecmat, solve, transpose_solve), some None
    const_lengths: Any  # namedtuple of the same fields: how many consts each takes


def linear_solve_parts(params: dict) -> LinearSolveParts:
    return LinearSolveParts(params["jaxprs"], params["const_lengths"])


def linear_solve_params(params: dict, jaxprs) -> dict:
    return dict(params, jaxprs=jaxprs)


class ShardMapParts(NamedTuple):
    jaxpr: jex.Jaxpr  # the per-shard body, an open jaxpr
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    check_vma: bool
    manual_axes: frozenset  # the mesh axes this shard_map makes manual


def shard_map_parts(params: dict) -> ShardMapParts:
    mesh = params["mesh"]
    return ShardMapParts(
        params["jaxpr"],
        mesh,
        tuple(params["in_specs"]),
        tuple(params["out_specs"]),
        params["check_vma"],
        shard_map_manual_axes(mesh, params),
    )


# JAX 0.11+ has "hijax" primitives: one `call_hi_primitive` equation whose `_prim` param is a
# Python object with its own params and rules (`lax.custom_root` is one since 0.11). None before.
try:
    from jax._src.hijax import call_hi_primitive_p as HI_PRIMITIVE  # JAX 0.11+
except ImportError:  # JAX 0.8 -- 0.10
    HI_PRIMITIVE = None


def hi_jaxprs(params: dict) -> list:
    """The jaxprs a `call_hi_primitive` equation holds in its object's params."""
    return list(jaxprs_in_params(params["_prim"].params))


def hi_expand(params: dict) -> Callable:
    """`f(*flat_args) -> flat outputs`: what a `call_hi_primitive` equation computes, in terms
    of ordinary primitives (its forward pass; its own rules still govern derivatives)."""
    from jax._src.tree_util import tree_leaves_checked

    prim = params["_prim"]

    def expand(*flat):
        return tree_leaves_checked(prim.out_tree, prim.expand(*prim.in_tree.unflatten(flat)))

    return expand


def shard_map_manual_axes(mesh, params: dict) -> frozenset:
    """The mesh axes a `shard_map` equation makes manual (`manual_axes` in JAX 0.8,
    `newly_manual_axes` later; all of the mesh's axes if neither is there)."""
    for key in ("manual_axes", "newly_manual_axes"):
        if key in params:
            return frozenset(params[key])
    return frozenset(mesh.axis_names)


def vary(x, axes: tuple) -> Any:
    """`x` marked as varying over the manual `axes` (a no-op for axes it already varies on)."""
    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):  # JAX 0.10+
        varying = aval.manual_axis_type.varying
    else:  # JAX 0.8 -- 0.9
        varying = getattr(aval, "vma", frozenset(axes))
    missing = tuple(a for a in axes if a not in varying)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # JAX 0.9+
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX 0.8


# The primitives that mark a value as varying over manual axes: `pvary` (JAX 0.8 -- 0.12) and
# `pcast` with `to="varying"` (0.9+).
VARY_PRIMITIVES = frozenset({"pvary", "pcast"})


def rebind_vary(eqn: jex.JaxprEqn, args: Sequence[Any]) -> list:
    """Evaluate a `pvary`/`pcast` equation on `args` that may already vary over some of its
    axes (state read per shard, where it was the same on every shard when traced)."""
    params = eqn.params
    if eqn.primitive.name == "pcast" and params.get("to") != "varying":
        return list(bind(eqn.primitive, args, params))
    axes = tuple(params.get("axes", params.get("axis_name", ())))
    return [vary(x, axes) for x in args]


SymbolicZero = jax.custom_derivatives.SymbolicZero


def runs_python(eqn: jex.JaxprEqn) -> bool:
    """Whether `eqn`'s primitive may run Python code from its params when it is evaluated or
    lowered: its impl is its own Python function (not JAX's `apply_primitive`, which compiles
    the primitive itself), and its params hold a callable that is not a jaxpr. Such code (an
    equinox filter primitive's rule, a lineax operator's matvec) holds marks that no jaxpr
    shows. Host callbacks are left out: they run on the host, on values."""
    if eqn.primitive in _RUN_JAXPRS:
        return False
    impl = eqn.primitive.impl
    if impl is None or eqn.primitive.name in _HOST_CALLBACKS:
        return False
    if isinstance(impl, functools.partial) and impl.func is dispatch.apply_primitive:
        return False
    return any(_holds_callable(v) for v in eqn.params.values())


_HOST_CALLBACKS = frozenset({"debug_callback", "pure_callback", "io_callback", "debug_print"})
# JAX's call and control-flow primitives, whose Python impls run their jaxprs and nothing else.
_RUN_JAXPRS = frozenset(
    {
        JIT_PRIMITIVE,
        REMAT_PRIMITIVE,
        jex.primitives.closed_call_p,
        jex.primitives.scan_p,
        jex.primitives.while_p,
        jex.primitives.cond_p,
    }
)


# Callable objects in params that are not code (a `jit` equation's `ctx_mesh` is a `Mesh`,
# which is callable).
_NOT_CODE = (
    type,
    jex.Primitive,
    jex.Jaxpr,
    jex.ClosedJaxpr,
    jax.sharding.Mesh,
    jax.sharding.AbstractMesh,
)


def _holds_callable(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_callable(v) for v in value)
    return callable(value) and not isinstance(value, _NOT_CODE)


def run_impl(eqn: jex.JaxprEqn, args: Sequence[Any], impl: Callable | None = None) -> list:
    """Run `eqn`'s primitive's impl rule (or `impl`, one of its kind) on `args`, as its
    lowering does for a primitive whose lowering is `mlir.lower_fun(impl)`."""
    return list((impl or eqn.primitive.impl)(*args, **eqn.params))


def extend_debug_info(
    debug_info: Any, names: Sequence[str], keep: int | None = None, arg_names: Sequence[str] = ()
) -> Any:
    """The debug info of a jaxpr whose outputs gained `names` at the end (after its first
    `keep` outputs, where given: the others are replaced), and its inputs `arg_names`."""
    if debug_info is None:
        return None
    if arg_names and isinstance(debug_info.arg_names, tuple):
        debug_info = debug_info._replace(arg_names=debug_info.arg_names + tuple(arg_names))
    paths = debug_info.result_paths
    if callable(paths):
        paths = tuple(paths())
    if not isinstance(paths, tuple):
        return debug_info._replace(result_paths=None)
    return debug_info._replace(result_paths=paths[:keep] + tuple(names))


def user_context(eqn: jex.JaxprEqn):
    """Attribute errors raised while handling `eqn` to the user's line that made it."""
    return source_info_api.user_context(eqn.source_info.traceback)

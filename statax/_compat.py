"""Version shims: what statax reads of JAX that is private or changes between releases.

Each name here hides one such thing (a param's name, a rule table's signature, where a
primitive lives), with the JAX versions it was written against, so that a new JAX release is
an afternoon's work. Logic that leans on JAX's internals lives in modules named for what it
does: `_staging` (the trace frame, equations that only read), `_python_rules` (primitives
that run Python of their own), `_custom_rules` (tracing a custom derivative's rule),
`_fastpaths` (the switch), `_tracebacks`. `docs/maintaining.md` lists every private name each
of them reads (`tools/private_names.py`).

Tested against JAX 0.8.0 -- 0.12.0.1 (see `pyproject.toml` and `docs/maintaining.md`). A branch
on the version or on behaviour says, in a comment, which versions each side covers.
"""

from __future__ import annotations

import functools
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
from jax._src import core  # isort: skip
from jax._src import effects as effects_lib  # isort: skip
from jax._src import linear_util as lu  # isort: skip
from jax._src.interpreters import ad, batching  # isort: skip
from jax._src.lax import lax as lax_internal  # isort: skip

__all__ = [
    "HI_PRIMITIVE",
    "JAX_VERSION",
    "JIT_PRIMITIVE",
    "PLANTING",
    "PULLING",
    "RAN_MASKS",
    "REMAT_PRIMITIVE",
    "SAVE_EFFECT",
    "SCOPE",
    "SELECTION",
    "DIFFERENTIATING",
    "SHARD_MAP_PRIMITIVE",
    "STATEFUL",
    "STATE_EFFECT",
    "UNSPECIFIED_SHARDING",
    "LinearSolveParts",
    "ScanParts",
    "ShardMapParts",
    "VARY_PRIMITIVES",
    "WhileParts",
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
    "dce",
    "debug_info",
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
    "register_batching_rule",
    "register_jvp_rule",
    "register_lowering",
    "register_lowering_identity",
    "register_remat_partial_eval_rule",
    "rebind_vary",
    "register_transpose_rule",
    "remat_split",
    "scan_params",
    "set_batching_rule",
    "scan_parts",
    "shard_map_manual_axes",
    "shard_map_parts",
    "trace_context",
    "trace",
    "user_context",
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


# Whether the `pull` tracing returns masks of the occurrences that ran (`pull(fn, ran=True)`):
# then each mark it collects carries a boolean beside its value. Part of the trace context.
RAN_MASKS = jax_config.bool_state(
    "statax_ran_masks",
    False,
    "Internal to statax: true while statax.pull(fn, ran=True) traces a function.",
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

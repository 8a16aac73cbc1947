"""Staging equations straight into the jaxpr JAX is tracing, and keeping those that only read.

What `save_inter`'s fast paths and `pull`'s inline tracing do with JAX's trace frame
(`DynamicJaxprTrace.frame.tracing_eqns`): stage an equation without `bind`'s generic work
(`stage`), stage one that only reads its operands and defines nothing (`observe`,
`observe_staged`), read and rewrite what a trace has staged (`staged`, `restage`); and the
rules that keep such an equation through JAX's dead-code elimination, partial evaluation and
staging (`register_readers`). Written against JAX 0.8 -- 0.12; `docs/maintaining.md` lists the
private names, and `_fastpaths.probe` checks they are there (the fast paths are off where not).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jex
from jax.extend import source_info_util as source_info_api
from jax.interpreters import partial_eval as pe_api

from .._jax.tracing import TRACE
from .context import NO_EFFECTS

from jax._src import config as jax_config  # isort: skip

from jax._src import core, source_info_util  # isort: skip

from jax._src.interpreters import partial_eval as pe  # isort: skip


__all__ = [
    "STAGED_TRACER",
    "as_equation",
    "defines_nothing",
    "dropped",
    "observe",
    "observe_staged",
    "register_readers",
    "restage",
    "stage",
    "staged",
    "staged_as_held",
    "staging_trace",
    "trace_length",
    "tracer_of",
    "var_of",
]


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
      drops what no output reads).

    The dead-code elimination rule also drops an equation of `prim` whose outputs nothing
    reads where Flax's `nn.scan` eliminates dead code only to learn whether its broadcast
    outputs depend on the carry (`_learning_dependencies`): `prim`'s effect would keep it, and
    with it a dependency, although that trace of the body is thrown away (the scan's own trace
    holds the equation)."""

    def dce(used_outputs, *rest):
        eqn = rest[-1]
        if only_reads(eqn.params):
            if _live_anyway(eqn.invars, sys._getframe(1)):
                return [True] * len(eqn.invars), eqn
            return [False] * len(eqn.invars), None
        if not any(used_outputs) and _learning_dependencies(sys._getframe(1)):
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


# Where a library runs dead-code elimination on a trace it then throws away, to learn what
# depends on what: Flax's `nn.scan` (`flax.core.axes_scan.scan_fn`, flax >= 0.12.9), on the
# trace that computes its broadcast outputs.
_DEPENDENCY_ANALYSES = frozenset({("flax.core.axes_scan", "scan_fn")})


def _learning_dependencies(frame, depth: int = 8) -> bool:
    """Whether the dead-code elimination `frame` is running was called (within `depth`
    frames) by one of `_DEPENDENCY_ANALYSES`."""
    while frame is not None and depth:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _DEPENDENCY_ANALYSES:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


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
    trace = TRACE.value
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
    if trace is not TRACE.value or type(trace) is not _JAXPR_TRACE:
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


_JAXPR_TRACE, _JaxprEqn = pe.DynamicJaxprTrace, jex.JaxprEqn


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
    return all(map(dropped, eqn.outvars))


def dropped(v: Any) -> bool:
    """Whether `v`, an equation's output, is one nothing reads (`_`, `core.DropVar`)."""
    return type(v) is core.DropVar


def trace_length(trace: Any) -> int:
    """How many equations `trace`, a jaxpr trace of `trace` above, has staged so far: the
    position in its jaxpr of the next one. `trace` (no auto-DCE) keeps them all, in order
    (`DynamicJaxprTrace.frame.tracing_eqns` in JAX 0.8 -- 0.12)."""
    return len(trace.frame.tracing_eqns)


def staging_trace() -> Any:
    """The trace in force if it stages a jaxpr whose equations `staged` and `restage` may read
    and edit (a `DynamicJaxprTrace` keeping every equation: no auto-DCE), else `None`."""
    trace = TRACE.value
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
        return jex.JaxprEqn(invars, e.outvars, e.primitive, e.params, e.effects,
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


def register_kept_in_loops(prim: jex.Primitive) -> None:
    """Keep every equation of `prim` inside a `scan` body under `grad`: JAX's partial
    evaluation of a scan hoists out of the loop what depends only on its constants
    (`_scan_known_hoisting`, JAX 0.8 -- 0.12), which would make a read of state (whose only
    input is its `init()`) one read before the loop. In that pass (told by its frame, which
    the rule looks for on the stack), an equation of `prim` is staged with unknown outputs,
    as if it depended on the carry; anywhere else it is partially evaluated as any other.
    Where the frame is not found (a JAX that renames it), nothing changes."""

    def partial_eval(trace, *tracers, **params):
        if not _called_from("_scan_known_hoisting"):
            return trace.default_process_primitive(prim, tracers, params)
        tracers = [trace.instantiate_const(trace.to_jaxpr_tracer(t)) for t in tracers]
        out_avals, effects = prim.abstract_eval(*[t.aval for t in tracers], **params)
        outs = [pe_api.JaxprTracer(trace, pe_api.PartialVal.unknown(a), None) for a in out_avals]
        name_stack = trace._current_truncated_name_stack()
        source = source_info_api.current().replace(name_stack=name_stack)
        recipe = pe.new_eqn_recipe(trace, tracers, outs, prim, params, effects, source)
        trace.effect_handles.append(pe.EffectHandle(tracers, recipe))  # kept, as effectful
        for t in outs:
            t.recipe = recipe
        return outs

    pe_api.custom_partial_eval_rules[prim] = partial_eval


def _called_from(name: str, depth: int = 40) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False

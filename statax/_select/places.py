"""Selections of places in the program (`stx.scopes`, `stx.primitives`, `stx.lines`): a plan
of where each selected value leaves its region, carried out by evaluating the program again
(`_core.evaluator.evaluate`) or by putting marks into what `pull` traced (`rewrite`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jex

from .._core import context as _context
from .._core import staging as _staging
from .._core.errors import SelectionError
from .._core.evaluator import bind_equation, evaluate, keep, rewrite
from .._core.exposers import map_jaxprs
from .._core.flat_calls import flat_function
from .._core.meta import ARRAY, StateMeta
from .._core.primitive import COLLECTING, LEAF, SAVE_EFFECTS, mark_as, save_inter_p
from .._core.registry import rules_for
from .._jax import jaxprs as _jaxprs
from .report import check_found
from .running import marks_found, run_marked
from .vocabulary import Primitives, Scopes, Selection, describe_selections
from .where import holds_jaxprs, is_transform, location_of, stack_of, walk

__all__ = ["collected", "collected_staged"]


# ---- places in the program --------------------------------------------------------------------


def with_places(call, chosen: tuple[Selection, ...], tree, *args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
    dynamic = [eqx.is_array(x) for x in leaves]
    out_info: list = []
    flat = flat_function(call, leaves, treedef, dynamic, out_info)
    arrays = [x for x, d in zip(leaves, dynamic, strict=True) if d]
    with run_marked(chosen) as after_marking:
        closed = _jaxprs.trace(flat, [jax.typeof(x) for x in arrays], name="select")
    eqns = (closed.jaxpr if _jaxprs.wraps_jaxpr(closed) else closed).eqns
    chosen = marks_found(after_marking(), eqns)
    check_found(eqns, chosen)
    outs = iter(_evaluate(closed.jaxpr, closed.consts, arrays, (), chosen))
    out_def, static = out_info[0]
    full = [next(outs) if s is None else s[0] for s in static]
    return jax.tree_util.tree_unflatten(out_def, full)


@dataclasses.dataclass
class _Plan:
    """What `_evaluate` does in one jaxpr: marks after equations (`(name, vars, location,
    reduce)` each) and the selections that go on inside equations (`(stack, selections)`)."""

    after: dict[int, list]
    inside: dict[int, tuple[tuple, tuple]]


def _evaluate(jaxpr, consts, args, stack: tuple, chosen: tuple) -> list:
    """Evaluate `jaxpr` in the current trace, with the selected values marked."""
    plan = _plan(jaxpr.eqns, jaxpr.outvars, stack, chosen)
    reached = {id(jaxpr.eqns[i]): inside for i, inside in plan.inside.items()}

    def step(eqn, invals):
        inside = reached.get(id(eqn))
        if inside is None:
            return bind_equation(eqn, invals)
        again = functools.partial(_again, stack=inside[0], chosen=inside[1])
        return bind_equation(eqn, invals, map_jaxprs(eqn.params, again))

    def after(i, eqn, env):
        for name, variables, location, reduce in plan.after.get(i, ()):
            variables = eqn.outvars if variables is None else variables
            values = [env[v] if isinstance(v, jex.Var) else v.val for v in variables]
            one = len(values) == 1
            marked = mark_as(values[0] if one else tuple(values), name, location, reduce)
            env.update(zip(variables, [marked] if one else marked, strict=True))

    return evaluate(jaxpr, consts, args, step, after)


def _again(sub, *, stack: tuple, chosen: tuple):
    """`sub` (a jaxpr in an equation's params) evaluated again with its selected values
    marked, traced in the current context."""
    closed = sub if isinstance(sub, jex.ClosedJaxpr) else jex.ClosedJaxpr(sub, ())
    new = _jaxprs.trace(
        lambda *args: _evaluate(closed.jaxpr, closed.consts, args, stack, chosen),
        closed.in_avals,
        name="select",
    )
    if isinstance(sub, jex.ClosedJaxpr):
        return new
    assert not new.consts, "an open jaxpr evaluated again closes over nothing"
    return new.jaxpr


def _plan(eqns: Sequence, outvars: Sequence, stack: tuple, chosen: tuple) -> _Plan:
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                last_use[v] = i
    returned = {v for v in outvars if isinstance(v, jex.Var)}
    after: dict[int, list] = {}
    outside: list[set[int]] = []  # per selection, the equations outside its regions
    for selection in chosen:
        if isinstance(selection, Primitives):
            for i, eqn in enumerate(eqns):
                if eqn.primitive.name in selection.names:
                    _refuse_transformed(selection, eqn, stack_of(stack, eqn))
                    # (its outputs, `None`: any it drops are given variables where marked)
                    entry = (eqn.primitive.name, None, location_of(eqn), selection.reduce)
                    after.setdefault(i, []).append(entry)
            outside.append(set(range(len(eqns))))
            continue
        regions = _regions(selection, stack, eqns)
        outside.append({i for i, r in enumerate(regions) if r is None})
        for start, end in _runs(regions):
            name, transformed = regions[start]
            made = [v for eqn in eqns[start : end + 1] for v in eqn.outvars]
            leaving = [v for v in made if last_use.get(v, -1) > end or v in returned]
            if not leaving:
                continue
            if isinstance(selection, Scopes) and _context.COTANGENTS.value:
                _refuse_cotangents(selection, name, eqns[end])
            if transformed:
                _refuse_transformed(selection, eqns[end], stack_of(stack, eqns[end]))
                # (a line's region: the transformation may be inside it, or around it)
            entry = (name, leaving, location_of(eqns[end]), selection.reduce)
            after.setdefault(end, []).append(entry)
    for entries in after.values():  # an inner scope's mark before an outer one's, at one place
        entries.sort(key=lambda e: -e[0].count("/"))
    inside = {}
    for i, eqn in enumerate(eqns):
        if not holds_jaxprs(eqn.params):
            continue
        subs = list(_jaxprs.jaxprs_in_params(eqn.params))
        going_on = tuple(s for s, out in zip(chosen, outside, strict=True) if i in out)
        inner_stack = stack_of(stack, eqn)
        if going_on and any(_matches_in(sub, inner_stack, going_on) for sub in subs):
            if not rules_for(eqn).selectable:  # (its record, where its handler is registered)
                raise SelectionError(
                    f"{describe_selections(going_on)} selects values inside `{eqn.primitive}` (at "
                    f"{location_of(eqn)}), which a selection does not reach into. Select the "
                    "values around it, or mark them by hand with stx.save_inter."
                )
            inside[i] = (inner_stack, going_on)
    return _Plan(after, inside)


def _regions(selection, stack: tuple, eqns: Sequence) -> list:
    """`_region` of each of `eqns`; for scopes, once per name stack (equations made in one
    scope share it)."""
    if not isinstance(selection, Scopes):
        return [_region(selection, stack, eqn) for eqn in eqns]
    seen: dict[int, Any] = {}
    regions = []
    for eqn in eqns:
        names = eqn.source_info.name_stack
        key = id(names)
        if key not in seen:
            seen[key] = (names, selection.region((*stack, *names.stack)))  # (names: kept alive)
        regions.append(seen[key][1])
    return regions


def _region(selection, stack: tuple, eqn) -> tuple[str, bool] | None:
    full = stack_of(stack, eqn)
    if isinstance(selection, Scopes):
        return selection.region(full)
    name = selection.region(eqn)
    return None if name is None else (name, any(is_transform(e) for e in full))


def _runs(regions: list) -> Iterator[tuple[int, int]]:
    """`(start, end)` of each run of equations in one region, one after the other."""
    start = None
    for i, region in enumerate([*regions, None]):
        if start is not None and (region is None or region[0] != regions[start][0]):
            yield start, i - 1
            start = None
        if region is not None and start is None:
            start = i


def _matches_in(jaxpr, stack: tuple, chosen: tuple) -> bool:
    """Whether any equation of `jaxpr` (at any depth) is selected."""
    return any(
        eqn.primitive.name in selection.names
        if isinstance(selection, Primitives)
        else _region(selection, outer, eqn) is not None
        for outer, eqn in walk(jaxpr, stack)
        for selection in chosen
    )


def _refuse_cotangents(selection, name: str, eqn) -> None:
    raise SelectionError(
        f"{selection} with cotangents (pull's cotangents=True, or a '.grad' planted): the "
        f"scope {name!r} (at "
        f"{location_of(eqn)}) is a region of the program, found once the function and its "
        "derivative are traced: no mark is there while the derivative is made, so no cotangent "
        "can be read at a scope. Mark the value with stx.save_inter, or select the module that "
        "computes it (stx.modules; the scopes of Flax Linen and Keras modules are marked as "
        "they run, and give cotangents)."
    )


def _refuse_transformed(selection, eqn, stack: tuple) -> None:
    transforms = [e.name for e in stack if is_transform(e)]
    if not transforms:
        return
    raise SelectionError(
        f"{selection} selects a value (at {location_of(eqn)}) that the function computes under "
        f"{' of '.join(f'`{t}`' for t in transforms)}, applied inside it: there the value is "
        "already transformed (batched along an axis a mark would not put first, or beside its "
        "tangent), so no mark at that place would see it. Where you apply the transformation, "
        "apply it outside the pull (`jax.vmap(stx.pull(f, at=...))`, "
        "`jax.grad(stx.pull(f, at=...), has_aux=True)`); where a library applies it (a solver "
        "differentiating your function), mark the value with stx.save_inter. Or select the "
        "submodule with stx.modules, which marks it where it runs."
    )


# ---- or marks put into a traced program (what `pull` does with them) ---------------------------


# For `pull` (nothing planted, no `ran=`), cheaper than evaluating the program again (`calling`):
# a pass over the equations `pull` traced. A value selected at the pull's own level is handed to
# its `Collector`, as a `save_inter` there hands its value; one further in (a loop body, a
# branch, a `jit`) gets a collecting mark in the jaxpr there, as a `save_inter` would have bound.


def collected(closed, marks: list, chosen: tuple) -> tuple[Any, list]:
    """`(closed, marks)`, a jaxpr `pull` traced and what its `Collector` took, with the
    places `chosen` selects marked."""
    jaxpr = closed.jaxpr if _jaxprs.wraps_jaxpr(closed) else closed
    num_out = len(jaxpr.outvars) - sum(m.num_arrays for _, m in marks)
    top, rewritten = _collect(jaxpr.eqns, jaxpr.outvars[:num_out], chosen)
    if not top and not rewritten:
        return closed, marks
    merged = _merged(marks, jaxpr.outvars[num_out:], top)
    eqns = [rewritten.get(i, eqn) for i, eqn in enumerate(jaxpr.eqns)]
    new = jaxpr.replace(
        eqns=eqns,
        outvars=[*jaxpr.outvars[:num_out], *(v for _, _, vs in merged for v in vs)],
        effects=set(jaxpr.effects).union(*(e.effects for e in rewritten.values())),
    )
    if _jaxprs.wraps_jaxpr(closed):
        new = jex.ClosedJaxpr(new, closed.consts)
    return new, [(p, m) for p, m, _ in merged]


def collected_staged(trace, start: int, outs: Sequence, collector, chosen: tuple) -> None:
    """`collected` for a function `pull` traced straight into `trace` from `start` on
    (`_staging.staging_trace`): the selected values at its level go to `collector`, the
    equations that hold others are restaged with their marks."""
    eqns = [_staging.as_equation(e) for e in _staging.staged_as_held(trace, start)]
    returned = [v for v in (_staging.var_of(trace, x) for x in outs) if v is not None]
    top, rewritten = _collect(eqns, returned, chosen)
    if rewritten:
        staged = _staging.staged(trace, start)
        new = [rewritten.get(i, eqn) for i, (eqn, _) in enumerate(staged)]
        _staging.restage(trace, start, new, staged)
    if not top:
        return
    found = [(start + p, m, [_staging.tracer_of(trace, v) for v in vs]) for p, m, vs in top]
    merged = _merged(collector.marks, collector.leaves, found)
    collector.marks[:] = [(p, m) for p, m, _ in merged]
    collector.leaves[:] = [x for _, _, xs in merged for x in xs]


def _merged(marks: Sequence, leaves: Sequence, found: list) -> list:
    """`(position, meta, leaves)` of a `Collector`'s `marks` (their `leaves` flat) and of the
    marks `found` at the same level, in program order (the collector's first at a position)."""
    it = iter(leaves)
    given = [(p, m, [next(it) for _ in range(m.num_arrays)]) for p, m in marks]
    return sorted([*given, *found], key=lambda mark: mark[0])


def _collect(eqns: Sequence, returned: Sequence, chosen: tuple) -> tuple[list, dict]:
    """`(top, rewritten)`: the marks at this level, `(position, meta, variables)` (`position`:
    how many equations precede them), and the equations that hold others, by index."""
    chosen = marks_found(chosen, eqns)
    check_found(eqns, chosen)
    plan = _plan(eqns, returned, (), chosen)
    selection = _context.SELECTION.value  # `pull(fn, only=...)`: the marks it collects
    top = []
    for i, entries in sorted(plan.after.items()):
        for name, variables, location, reduce in entries:
            variables = eqns[i].outvars if variables is None else variables
            meta = _meta_of(name, len(variables), location, reduce)
            if selection is None or selection(meta):
                top.append((i + 1, meta, list(variables)))
    if any(
        _staging.dropped(v) for _, _, vs in top for v in vs
    ):  # an output nothing reads: no value
        raise SelectionError(
            f"{describe_selections(chosen)} selects an output of a primitive that the program "
            "drops; "
            "select the values around it."
        )
    rewritten = {i: _with_marks_inside(eqns[i], inside) for i, inside in plan.inside.items()}
    return top, rewritten


@functools.lru_cache(maxsize=4096)
def _meta_of(name: str, n: int, location: str, reduce) -> StateMeta:
    """The meta of a selected place's mark (made once: metas are immutable)."""
    treedef = LEAF if n == 1 else jax.tree_util.tree_structure(tuple(range(n)))
    return StateMeta(name, treedef, (ARRAY,) * n, location, reduce=reduce)


def _with_marks_inside(eqn, inside: tuple):
    """`eqn` with its jaxprs marked inside (`inside`: `(stack, selections)`)."""
    params = map_jaxprs(eqn.params, lambda sub: _rebuilt(sub, *inside))
    subs = _jaxprs.jaxprs_in_params(params)
    if any(_context.SAVE_EFFECT in sub.effects for sub in subs):
        return eqn.replace(params=params, effects=eqn.effects | SAVE_EFFECTS)
    return eqn.replace(params=params)


def _rebuilt(sub, stack: tuple, chosen: tuple):
    if _jaxprs.wraps_jaxpr(sub):
        return jex.ClosedJaxpr(_inserted(sub.jaxpr, stack, chosen), sub.consts)
    return _inserted(sub, stack, chosen)  # an open jaxpr (or one with its consts, JAX 0.11+)


def _inserted(jaxpr, stack: tuple, chosen: tuple):
    """`jaxpr` (open) with a collecting mark after each selected place, read downstream."""
    plan = _plan(jaxpr.eqns, jaxpr.outvars, stack, chosen)
    if not plan.after and not plan.inside:
        return jaxpr
    selection = _context.SELECTION.value  # `pull(fn, only=...)`: the marks it collects
    reached = {id(jaxpr.eqns[i]): inside for i, inside in plan.inside.items()}
    outputs_marked = {
        id(jaxpr.eqns[i])
        for i, after in plan.after.items()
        if any(variables is None for _, variables, _, _ in after)  # a primitive's outputs
    }

    eqns: list = []
    emit = eqns.append

    def step(eqn, invars):
        new = eqn
        inside = reached.get(id(eqn))
        if inside is not None:
            new = _with_marks_inside(eqn, inside)
        if id(eqn) in outputs_marked:  # (given variables where it drops them)
            new = new.replace(
                outvars=[jex.Var(v.aval) if _staging.dropped(v) else v for v in eqn.outvars]
            )
        return keep(new, invars, emit)

    def after(i, eqn, env):
        for name, variables, location, reduce in plan.after.get(i, ()):
            variables = eqn.outvars if variables is None else variables
            values = [env.get(v, v) for v in variables]  # (a rewrite keeps only renames)
            meta = _meta_of(name, len(values), location, reduce)
            if selection is not None and not selection(meta):
                continue  # not collected: no mark at all
            outs = [jex.Var(v.aval) for v in values]
            params = {"meta": meta, "status": COLLECTING}
            emit(_jaxprs.new_equation(values, outs, save_inter_p, params, SAVE_EFFECTS))
            env.update(zip(variables, outs, strict=True))

    outvars = rewrite(jaxpr, step, after)
    effects = set(jaxpr.effects).union(*(e.effects for e in eqns))
    return jaxpr.replace(eqns=eqns, outvars=outvars, effects=effects)

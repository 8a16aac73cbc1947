"""Tracing an entry: a pulled function traced and rewritten for one kind of arguments (kept by
`cache`), evaluated, and named; or traced straight into a jaxpr being staged (`inline`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._core import context as _context
from .._core import staging as _staging
from .._core.exposers import mark
from .._core.flat_calls import flat_function
from .._core.marks import selecting
from .._core.meta import StateMeta
from .._core.primitive import Collector, collecting
from .._core.rewrite import pull_collected, pull_staged
from .._jax import jaxprs as _jaxprs
from .._jax import primitive_params as _params
from .._jax import primitives as _primitives
from .._jax import tracing as _tracing
from .._select.plan import Plan
from .cache import (
    TRACED_PY_NUMBERS,
    arguments_key,
    cached,
    traced_avals,
    traced_mask,
)
from .naming import check_cotangents, check_only, named, plans_for, unflatten_out
from .programs import Programs

__all__ = ["Entry", "entry_for", "evaluate", "inline", "summarized"]


@dataclasses.dataclass(slots=True, kw_only=True)
class Entry:
    """What one trace of a pulled function makes, kept per function and kind of arguments."""

    jaxpr: jex.ClosedJaxpr  # the rewritten jaxpr
    metas: tuple[StateMeta, ...]
    out_treedef: Any
    out_static: tuple[Any, ...]  # per output leaf: None where an array goes, else (leaf,)
    num_out: int
    literals: tuple[tuple[int, Any], ...]  # (position, dtype) of outputs that are constants
    ins: tuple[StateMeta, ...]  # what the rewritten jaxpr takes in (planted marks)
    in_avals: tuple
    call: dict | None  # params of a `jit` equation that calls `jaxpr`, its constants first as
    # arguments (None: inline it)
    plans: dict = dataclasses.field(default_factory=dict)  # ran -> how the dict is made
    checked: bool = False  # whether `only=` was checked against the marks (`check_only`)


def inline(trace, call, leaves, treedef, only, ran, traced_places: Plan = Plan()):
    """`pull` where a jaxpr is being staged (under `jit`, `make_jaxpr`, in a loop body): the
    function is traced straight into it, as it would be unpulled. Its marks are handed over as
    they are made, and the equations that hold marks further in (a `jit`, a loop) are
    rewritten where they stand."""
    if any(isinstance(x, TRACED_PY_NUMBERS) for x in leaves):  # traced, as `_trace` does
        traced = traced_mask(leaves, treedef)
        leaves = [
            jnp.asarray(x) if t and isinstance(x, TRACED_PY_NUMBERS) else x
            for x, t in zip(leaves, traced, strict=True)
        ]
    tree, args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    collector = Collector()
    start = _staging.trace_length(trace)
    with traced_places.tracing(only, lambda: metas) as chosen:
        with (
            selecting(only),
            _context.PULLING(True),
            _context.RAN_MASKS(ran),
            collecting(collector),
        ):
            collector.trace = trace
            out = call(tree, *args, **kwargs)
            collector.trace = None  # (a mark made once the function has returned is not its own)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        if traced_places:
            with selecting(only):
                chosen().collected_staged(trace, start, out_leaves, collector)
        new_leaves, flat, metas = pull_staged(trace, start, out_leaves, collector)
    if only is not None:
        everything = lambda: _trace(  # noqa: E731
            None, call, leaves, treedef, *traced_avals(leaves, treedef), traced_places
        )
        check_only(only, metas, everything)
    check_cotangents(metas)
    if any(a is not b for a, b in zip(new_leaves, out_leaves, strict=True)):
        out = jax.tree_util.tree_unflatten(out_def, new_leaves)
    return out, named(metas, flat, ran, plans_for(metas))


def entry_for(
    root, call, leaves, treedef, only, at=(), traced_places: Plan = Plan()
) -> tuple[Entry, list]:
    """The cached trace and rewrite for these arguments (made on a miss), and the dynamic ones."""
    traced, dynamic, key = arguments_key(leaves, treedef)
    key = (only, at, *key)
    make = lambda: _trace(root, call, leaves, treedef, traced, only, key[-1], traced_places)  # noqa: E731
    entry = cached(root, key, make)
    if only is not None and not entry.checked:
        everything = lambda: _trace(  # noqa: E731
            root, call, leaves, treedef, traced, None, key[-1], traced_places
        )
        check_only(only, entry.metas, everything)
        entry.checked = True
    return entry, dynamic


def evaluate(
    entry: Entry, args: Sequence, ran: bool, remark: bool = False
) -> tuple[Any, dict[str, Any]]:
    if entry.call is not None and any(isinstance(x, jax.core.Tracer) for x in args):
        # In a trace, one equation (as a `jax.jit` of the function would be): evaluating the
        # jaxpr would stage each of its equations again, doubling the cost of tracing. Its
        # constants go in as arguments, so that they become the trace's own: a program keyed by
        # what it computes (`Programs`) is then the same for new values of what `fn` reads.
        flat = _primitives.JIT_PRIMITIVE.bind(*entry.jaxpr.consts, *args, **entry.call)
    else:
        flat = jex.jaxpr_as_fun(entry.jaxpr)(*args)
    if remark:
        mark(flat[entry.num_out :], entry.metas)
    if entry.literals:  # a constant comes back as an array, whatever JAX's literal is
        flat = list(flat)
        for i, dtype in entry.literals:
            flat[i] = jnp.asarray(flat[i], dtype)
    n = entry.num_out
    inters = named(entry.metas, flat[n:], ran, entry.plans)
    return unflatten_out(entry, flat[:n]), inters


def summarized(entry: Entry, summarize: Callable, ran: bool) -> Callable:
    """One compiled program that runs the function and summarises every intermediate, so that
    only the summaries leave the device (kept by what it computes: `Programs`)."""
    return functools.partial(_SUMMARIES, functools.partial(_summarizing, entry, summarize, ran))


_SUMMARIES = Programs(keep=32)


def _summarizing(entry: Entry, summarize: Callable, ran: bool, *args):
    out, inters = evaluate(entry, args, ran)
    return out, {key: summarize(value) for key, value in inters.items()}


def _trace(root, call, leaves, treedef, traced, only, avals, places: Plan = Plan()) -> Entry:
    out_info = []
    flat_fn = flat_function(call, leaves, treedef, traced, out_info)
    collector = Collector()

    def run(*args):  # flat_fn, handing its marks to `collector`
        collector.trace = _tracing.current_trace()
        outs = flat_fn(*args)
        collector.trace = None  # (a mark made once the function has returned is not its own)
        return [*outs, *collector.leaves]

    source = root.__call__ if isinstance(root, type) else root
    # (`selecting`: in force where marks are bound, as in rebatched loops, and for the rewrite)
    with selecting(only), places.tracing(only, lambda: metas) as chosen:
        with _context.PULLING(True), collecting(collector):
            closed = _jaxprs.trace(run, avals, "pull", source)
        n = len(closed.jaxpr.outvars) - len(collector.leaves)  # the function's own outputs
        marks = collector.marks
        if places:
            closed, marks = chosen().collected(closed, marks)
        new, metas, ins = pull_collected(closed, marks)
    check_cotangents(metas)  # (once per entry: the trace context is part of its key)
    out_def, out_static = out_info[0]
    literals = tuple(
        (i, x.aval.dtype) for i, x in enumerate(new.jaxpr.outvars) if isinstance(x, jex.Literal)
    )
    in_avals = tuple(new.in_avals[len(avals) :])
    escaped = any(isinstance(c, jax.core.Tracer) for c in new.consts)
    call_params = (
        None
        if escaped
        else _params.jit_call_params(_jaxprs.constants_as_inputs(new.jaxpr), _name_of(root))
    )
    return Entry(
        jaxpr=new,
        metas=metas,
        out_treedef=out_def,
        out_static=out_static,
        num_out=n,
        literals=literals,
        ins=ins,
        in_avals=in_avals,
        call=call_params,
    )


def _name_of(root) -> str:
    """`"pull(f)"`, the name of the `jit` equation that calls the rewritten `f` (`root`, as
    `split_callable` gives it: a module's class, a method's function)."""
    return f"pull({getattr(root, '__name__', type(root).__name__)})"

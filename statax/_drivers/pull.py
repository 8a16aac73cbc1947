"""`pull`: trace, rewrite with `pull_jaxpr`, cache, evaluate, and name the intermediates."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._core import context as _context
from .._core import fastpaths as _fastpaths
from .._core import staging as _staging
from .._core.errors import SelectionError
from .._core.exposers import mark, take
from .._core.flat_calls import call_plain, call_tree, flat_function, split_callable
from .._core.marks import selecting
from .._core.meta import ARRAY, StateMeta
from .._core.primitive import Collector, collecting
from .._core.registry import on_forget
from .._core.rewrite import pull_collected, pull_staged
from .._core.tracebacks import boundary
from .._jax import jaxprs as _jaxprs
from .._jax import primitive_params as _params
from .._jax import primitives as _primitives
from .._jax import tracing as _tracing
from .._select import applying as _applying
from .._select import objects as _objects
from .._select import places as _places
from .._select import running as _running
from .._select import vocabulary as _vocabulary
from . import nnx as _nnx
from . import planting as _plant
from .cache import (
    TRACED_PY_NUMBERS,
    arguments_key,
    cached,
    is_array,
    lookup,
    store,
    traced_avals,
    traced_mask,
)
from .naming import check_only, named, plans_for, selection_of, unflatten_out

__all__ = ["pull"]


@dataclasses.dataclass(slots=True, kw_only=True)
class _Entry:
    """What one trace of a pulled function makes, kept per function and kind of arguments."""

    jaxpr: jex.ClosedJaxpr  # the rewritten jaxpr
    metas: tuple[StateMeta, ...]
    out_treedef: Any
    out_static: tuple[Any, ...]  # per output leaf: None where an array goes, else (leaf,)
    num_out: int
    literals: tuple[tuple[int, Any], ...]  # (position, dtype) of outputs that are constants
    ins: tuple[StateMeta, ...]  # what the rewritten jaxpr takes in (planted marks)
    in_avals: tuple
    call: dict | None  # params of a `jit` equation that calls `jaxpr` (None: inline it)
    summarized: dict = dataclasses.field(default_factory=dict)  # summarize -> its evaluation
    plans: dict = dataclasses.field(default_factory=dict)  # ran -> how the dict is made
    checked: bool = False  # whether `only=` was checked against the marks (`check_only`)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fn"],
    meta_fields=["only", "enabled", "summarize", "ran", "planting", "at", "cotangents"],
)
@dataclasses.dataclass(frozen=True)
class Pulled:
    """What `pull` returns: a pytree whose leaves are `fn`'s (as an `eqx.Module`'s would be),
    with plain attributes, which a call reads without `eqx.Module`'s per-access work."""

    fn: Callable
    only: Any
    enabled: bool
    summarize: Any
    ran: bool = False
    planting: Any = None  # for `plant`: a `_plant.Planting`
    at: tuple = ()  # selections (`_select`): marks made where none were written
    cotangents: bool = False  # also the cotangents that flow back through the marks

    @property
    def __wrapped__(self) -> Callable:
        """`fn`: `inspect.signature` gives `fn`'s signature (which tools and
        `jax.jit(..., static_argnames=...)` read), and JAX names a trace by `fn`."""
        return self.fn

    @boundary
    def __call__(self, *args, **kwargs):
        known = self.__dict__.get("_compiled")  # (generation, tree, compiled), once it has run
        if known is not None and known[0] == _generation and _fastpaths.on and _tracing.eager():
            # An eager call of a pull that has run compiled: straight to it, which takes the
            # call if it is on arrays (see `_run_compiled`).
            result = _run_compiled(known[2], known[1], args, kwargs)
            if result is not None:
                return result
        return call_pulled(self, args, kwargs)


# The work of a call is in functions, not methods: each method access on an `eqx.Module` builds
# a bound-method module, which costs more than the rest of a cached call.


def call_pulled(pulled: Pulled, args, kwargs, values=None):
    """`pulled(*args, **kwargs)`: `(out, intermediates)`; for `plant`, with `values` planted."""
    if pulled.at:  # the objects of an `of=` model mark their calls before anything is flattened
        with (
            _context.PLACES((*_context.PLACES.value, *pulled.at)),
            _objects.objects_marked(pulled.at),
        ):
            return _call_pulled(pulled, args, kwargs, values)
    return _call_pulled(pulled, args, kwargs, values)


def _call_pulled(pulled: Pulled, args, kwargs, values=None):
    fn = pulled.fn
    if not pulled.enabled:
        return fn(*args, **kwargs), {}
    is_node = _nnx.node_test()  # None unless Flax NNX is imported
    root, tree, call = split_callable(fn)
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs), is_leaf=is_node)
    at, in_program = pulled.at, ()
    if at:  # marks by object where the objects are live (in NNX's merge), in the program around
        call = _applying.calling(call, at, objects=True, fn=fn)
        # Places in the program: put into what `pull` traces; where something is planted, or
        # `ran=` asks for flags, by evaluating the program again with `save_inter`s there.
        planted = values is not None or pulled.planting is not None or _context.PLANTING.value
        if not planted and not pulled.ran:
            in_program = tuple(s for s in at if not isinstance(s, _vocabulary.Modules))
            at = tuple(s for s in at if s not in in_program)
    eager = (
        _fastpaths.on
        and not at
        and not pulled.cotangents
        and values is None
        and pulled.summarize is None
        and pulled.planting is None
        and all(map(is_array, leaves))
    )
    if eager:
        compiled = lookup(root, (pulled.only, pulled.ran, pulled.at), _COMPILED)
        if compiled is not None:
            result = _run_compiled(compiled, tree, args, kwargs)
            if result is not None:
                # This pull's next calls on arrays go straight here (its `tree` is fixed).
                object.__setattr__(pulled, "_compiled", (_generation, tree, compiled))
                return result
    if is_node is not None and any(map(is_node, leaves)):
        # Flax NNX objects: keep their reference semantics, as `nnx.jit` does.
        packed, args, kwargs, nodes = _nnx.split(leaves, treedef)
        leaves, treedef = jax.tree_util.tree_flatten((packed, args, kwargs))
        call = _applying.calling(_nnx.calling(call), at, objects=False)
        (out, state), inters = _run(pulled, root, call, leaves, treedef, values, False, in_program)
        _nnx.update(nodes, state)
        return out, inters
    call = _applying.calling(call, at, objects=False)
    return _run(pulled, root, call, leaves, treedef, values, eager, in_program)


# root callable (held weakly) -> OrderedDict((only, ran, at) -> compiled evaluation)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_generation = 0  # counts the times the handlers changed (a pull keeps its compiled evaluation)


def _forget_compiled() -> None:
    _COMPILED.clear()
    global _generation
    _generation += 1


on_forget(_forget_compiled)


class _NotCompiled(Exception):
    """Raised while a compiled evaluation traces a function that is not all one `jit`."""


class _InOrder:
    """The intermediates as a compiled evaluation returns them, in program order (a `dict`
    comes out of a `jax.jit` in key order: `"l10_0"` before `"l2_0"`)."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: tuple, values: list):
        self.keys, self.values = keys, values


jax.tree_util.register_pytree_node(
    _InOrder, lambda x: (x.values, x.keys), lambda keys, values: _InOrder(keys, values)
)


def _run_compiled(compiled, tree, args, kwargs) -> tuple | None:
    """`(out, intermediates)` from the compiled evaluation, or None where, for these arguments,
    the function is not one `jit` or they are not all arrays: then the call takes the path of
    any other (which raises any error that is the function's own).

    A call checks nothing that `jax.jit` does not. Its caches find the evaluation compiled only
    for arguments of the tree and types of arrays that traced it (`evaluate` refuses anything
    else when it traces); a Python or NumPy number or array of those types runs it too, as
    the function, one `jit`, would run them. `jit` refuses what is not a JAX type."""
    _CALL.arguments, _CALL.traced = (tree, args, kwargs), False
    try:
        out, inters = compiled(tree, *args, **kwargs)
    except _NotCompiled:
        return None
    except (TypeError, ValueError):
        if _CALL.traced:  # the function's own error
            raise
        return None  # refused by `jit` itself (not a JAX type): the plain path says why
    finally:
        _CALL.arguments = None
    return out, dict(zip(inters.keys, inters.values, strict=True))


# `arguments`: those of the call of a compiled evaluation under way; `traced`: whether it traced.
_CALL = threading.local()


def _compile(root, call, only, ran, at) -> None:
    """Keep a compiled evaluation for `root` called with `only`, `ran` and the places `at`
    selects in the program (once its first eager call has found it to be one `jit`: errors in
    the first trace are raised from `pull`'s own)."""
    key = (only, ran, at)
    if lookup(root, key, _COMPILED) is None:
        plain = isinstance(call, functools.partial)
        store(root, key, jax.jit(_evaluation(weakref.ref(root), plain, only, ran, at)), _COMPILED)


def _evaluation(root_ref, plain: bool, only, ran, at) -> Callable:
    # `root` is held weakly, so that the cache entry this lives in does not keep it alive.
    def evaluate(tree, *args, **kwargs):
        _CALL.traced = True
        arguments = getattr(_CALL, "arguments", None)  # the call's own, not their tracers
        leaves = jax.tree_util.tree_leaves(arguments, _nnx.node_test())
        if arguments is None or not all(map(is_array, leaves)):
            raise _NotCompiled
        root = root_ref()
        if plain:
            call = functools.partial(call_plain, root)
        else:  # (see `split_callable`)
            call = call_tree if isinstance(root, type) else root
        leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
        with _context.RAN_MASKS(ran):
            entry, dynamic = _entry(root, call, leaves, treedef, only, at, at)
        if not _one_jit(entry):
            raise _NotCompiled
        out, inters = _evaluate(entry, dynamic, ran)
        return out, _InOrder(tuple(inters), list(inters.values()))

    return evaluate


def _one_jit(entry: _Entry) -> bool:
    """Whether `entry` is one `jit` equation, and returns arrays only."""
    eqns = entry.jaxpr.jaxpr.eqns
    return (
        len(eqns) == 1
        and eqns[0].primitive is _primitives.JIT_PRIMITIVE
        and not entry.ins
        and all(s is None for s in entry.out_static)
        and all(leaf is ARRAY for meta in entry.metas for leaf in meta.static_leaves)
    )


def _run(pulled, root, call, leaves, treedef, values, eager=False, in_program=()):
    only, planting, summarize, ran = pulled.only, pulled.planting, pulled.summarize, pulled.ran
    if values is None and planting is None and summarize is None and _fastpaths.on:
        trace = _staging.staging_trace()
        if trace is not None and _context.PLANTING.value is None:
            with _context.COTANGENTS(pulled.cotangents):
                return _inline(trace, call, leaves, treedef, only, ran, in_program)
    # `plant` traces with its planting in force (within an enclosing plant, that one stays).
    # Where the inputs are differentiated, the rules of custom derivatives run: their marks
    # are keys (see `handlers.custom_derivatives`); where they are not, there are none.
    differentiating = any(map(_tracing.differentiated, leaves))
    with (
        contextlib.nullcontext() if planting is None else _context.PLANTING(planting),
        _context.DIFFERENTIATING(differentiating),
        _context.RAN_MASKS(ran),
        _context.COTANGENTS(pulled.cotangents),
    ):
        entry, dynamic = _entry(root, call, leaves, treedef, only, pulled.at, in_program)
    if eager and _one_jit(entry):
        _compile(root, call, only, ran, pulled.at)
    if values is not None:  # `plant`: its values, checked against the marks
        fed = _plant.feed(entry.ins, entry.in_avals, values, planting, entry.metas)
    elif entry.ins:  # within an enclosing plant: what it plants comes in from outside
        fed = take(entry.ins, entry.in_avals)
    else:
        fed = []
    if summarize is not None:
        return _summarized(entry, summarize, ran)(*dynamic, *fed)
    # A planted run inside an enclosing pull: its intermediates (as planted) are marks again.
    remark = planting is not None and bool(_context.PULLING.value)
    return _evaluate(entry, [*dynamic, *fed], ran, remark)


def _inline(trace, call, leaves, treedef, only, ran, in_program=()):
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
    with _objects.calls_checked(lambda: metas, only):
        with (
            selecting(only),
            _context.PULLING(True),
            _context.RAN_MASKS(ran),
            collecting(collector),
            _running.run_marked(in_program) as chosen,
        ):
            collector.trace = trace
            out = call(tree, *args, **kwargs)
            collector.trace = None  # (a mark made once the function has returned is not its own)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        if in_program:
            with selecting(only):
                _places.collected_staged(trace, start, out_leaves, collector, chosen())
        new_leaves, flat, metas = pull_staged(trace, start, out_leaves, collector)
    if only is not None:
        everything = lambda: _trace(  # noqa: E731
            None, call, leaves, treedef, *traced_avals(leaves, treedef), in_program
        )
        check_only(only, metas, everything)
    if any(a is not b for a, b in zip(new_leaves, out_leaves, strict=True)):
        out = jax.tree_util.tree_unflatten(out_def, new_leaves)
    return out, named(metas, flat, ran, plans_for(metas))


def _entry(root, call, leaves, treedef, only, at=(), in_program=()) -> tuple[_Entry, list]:
    """The cached trace and rewrite for these arguments (made on a miss), and the dynamic ones."""
    traced, dynamic, key = arguments_key(leaves, treedef)
    key = (only, at, *key)
    make = lambda: _trace(root, call, leaves, treedef, traced, only, key[-1], in_program)  # noqa: E731
    entry = cached(root, key, make)
    if only is not None and not entry.checked:
        everything = lambda: _trace(  # noqa: E731
            root, call, leaves, treedef, traced, None, key[-1], in_program
        )
        check_only(only, entry.metas, everything)
        entry.checked = True
    return entry, dynamic


def _evaluate(
    entry: _Entry, args: Sequence, ran: bool, remark: bool = False
) -> tuple[Any, dict[str, Any]]:
    if entry.call is not None and any(isinstance(x, jax.core.Tracer) for x in args):
        # In a trace, one equation (as a `jax.jit` of the function would be): evaluating the
        # jaxpr would stage each of its equations again, doubling the cost of tracing.
        flat = _primitives.JIT_PRIMITIVE.bind(*args, **entry.call)
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


def _summarized(entry: _Entry, summarize: Callable, ran: bool) -> Callable:
    """One compiled program that runs the function and summarises every intermediate, so that
    only the summaries leave the device."""
    compiled = entry.summarized.get((summarize, ran))
    if compiled is None:

        def run(*args):
            out, inters = _evaluate(entry, args, ran)
            return out, {key: summarize(value) for key, value in inters.items()}

        compiled = entry.summarized[summarize, ran] = eqx.filter_jit(run)
    return compiled


def _trace(root, call, leaves, treedef, traced, only, avals, in_program=()) -> _Entry:
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
    with selecting(only), _objects.calls_checked(lambda: metas, only):
        with _context.PULLING(True), collecting(collector), _running.run_marked(in_program) as sel:
            closed = _jaxprs.trace(run, avals, "pull", source)
        n = len(closed.jaxpr.outvars) - len(collector.leaves)  # the function's own outputs
        marks = collector.marks
        if in_program:
            closed, marks = _places.collected(closed, marks, sel())
        new, metas, ins = pull_collected(closed, marks)
    out_def, out_static = out_info[0]
    literals = tuple(
        (i, x.aval.dtype) for i, x in enumerate(new.jaxpr.outvars) if isinstance(x, jex.Literal)
    )
    in_avals = tuple(new.in_avals[len(avals) :])
    escaped = any(isinstance(c, jax.core.Tracer) for c in new.consts)
    call_params = None if escaped else _params.jit_call_params(new, _name_of(root))
    return _Entry(
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


def pull(
    fn: Callable,
    *,
    only: Any = None,
    enabled: bool = True,
    summarize: Callable | None = None,
    ran: bool = False,
    at: Any = None,
    cotangents: bool = False,
) -> Callable:
    """Transform `fn` to also return every value marked with `save_inter` inside it.

    Args:
        fn: any callable: a function, a jitted/vmapped/differentiated function, an
            `eqx.Module`. Its arguments follow equinox's filter convention: array leaves are
            traced, other leaves are static (as in `eqx.filter_jit`), with one exception: a
            Python float or complex passed directly as an argument is traced, weakly typed, as
            `jax.jit` traces it (so `pull(f)(1.0)` does not retrace for `2.0`). Python ints
            and bools stay static.
        only: collect only some marks: a name or a collection of names (exact, scopes
            included), a compiled regular expression (`re.compile("encoder/.*")`, matched
            against the whole name), or a predicate on `StateMeta`. The others stay plain
            identities, and work that only they needed disappears from the compiled program.
        enabled: `False` turns `pull` off: the function runs as it is and returns
            `(out, {})`, compiling to exactly the unmarked program. Pass it as a static
            argument to switch collection per call under `jit`.
        summarize: a function applied to every intermediate inside the compiled program
            (`stx.stats`, or any function of a pytree); the dict then holds its results, and
            only they leave the device.
        ran: also return, beside each value that may be the zeros of code that did not run (a
            `cond` branch not taken under `jit` or `vmap`, a `while_loop` that ran no
            iteration), whether it ran: for an occurrence `"h_0"`, an entry `"h_0.ran"`, a
            boolean (per example under a `vmap`, per row where a `scan` stacks it); for a name
            saved with `reduce="stack"` or `"collect"`, an entry `f"{name}.ran"` of boolean
            masks with the value's structure: true for each row (`"stack"`: shape
            `(*batch, occurrences)`) or element (`"collect"`: the value's shape) that comes
            from an occurrence that ran. `describe` says which values did not run.
        at: also mark places nobody marked: a selection, or a list of them, as
            `stx.scopes(...)`, `stx.modules(...)`, `stx.primitives(...)` and `stx.lines(...)`
            make (see "Looking inside a model you did not write"). Their values come back as
            marks written there would, beside the marks written by hand.
        cotangents: also return the cotangent that flows back through each mark where `fn`
            differentiates (`jax.grad`, `jax.value_and_grad`, `jax.vjp`, equinox's and NNX's
            inside `fn`): for an occurrence `"h_0"`, `"h_0.grad"`, from the same backward
            pass, stacked as the value is (per iteration in a `scan`, per example under
            `vmap`). `plant` replaces or transforms them by the same keys. See "Debugging
            gradients".

    Returns:
        A callable with `fn`'s signature returning `(out, intermediates)`: `fn`'s output and a
        dict `{f"{name}_{n}": value}`, `n` counting each name's `save_inter` calls from 0 in
        program order. Each key is a `str` that also knows where its value was saved,
        `key.location` (`"file.py:line"`), as `describe` shows. It composes with `jit`,
        `grad` (use `has_aux=True` outside), `vmap`, `jacfwd`, `jacrev`, `hessian` and
        equinox's filtered transforms, in either order. Called where a jaxpr is being staged
        (under `jit`, `make_jaxpr`, in a loop body), it traces `fn` straight into that jaxpr,
        as `fn` alone would be, and stages the marked values as outputs, nothing else;
        called eagerly, it traces `fn` once per argument types and shapes and caches that.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     stx.save_inter(x ** 2, name="sq")
        ...     return jnp.sum(x)
        >>> out, inters = stx.pull(jax.jit(f))(jnp.arange(3.0))
        >>> inters
        {'sq_0': Array([0., 1., 4.], dtype=float32)}
    """
    if not callable(fn):
        raise TypeError(f"stx.pull needs a callable, got {fn!r} of type {type(fn).__name__}.")
    at = _vocabulary.selections(at)
    if cotangents:
        refuse_program_places(at)
    return Pulled(
        fn,
        only=selection_of(only),
        enabled=bool(enabled),
        summarize=summarize,
        ran=bool(ran),
        at=at,
        cotangents=bool(cotangents),
    )


def refuse_program_places(at: tuple) -> None:
    """Cotangents come from marks made where their values are differentiated: module
    selections and the scopes of Flax Linen and Keras modules are (marked as they run); other
    places in the program are found once the function, and its derivative, are traced."""
    for selection in at:
        if not isinstance(selection, (_vocabulary.Modules, _vocabulary.Scopes)):
            raise SelectionError(
                f"stx.pull(fn, at={selection}, cotangents=True): a primitive or a line is found "
                "in the program once its derivative is traced already, so no cotangent can be "
                "read there. Select the module that computes it (stx.modules, or the scope of a "
                "Flax Linen or Keras module), or mark the value with stx.save_inter."
            )

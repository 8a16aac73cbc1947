"""`pull`: trace, rewrite with `pull_jaxpr`, cache, evaluate, and name the intermediates."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex

from . import _compat, _fastpaths, _nnx, _plant, _reduce, _select, _staging
from ._errors import KeyCollisionError, SelectionError
from ._interpreter import mark, on_forget, pull_collected, pull_staged, selecting, take
from ._meta import ARRAY, StateMeta, hashable, keys_of
from ._primitive import Collector, collecting
from ._tracebacks import boundary

__all__ = ["pull"]

_TRACED_PY_NUMBERS = (float, complex)
_MAX_ENTRIES_PER_FUNCTION = 64


class _Entry(NamedTuple):
    jaxpr: jex.ClosedJaxpr  # the rewritten jaxpr
    metas: tuple[StateMeta, ...]
    out_treedef: Any
    out_static: tuple[Any, ...]  # per output leaf: None where an array goes, else (leaf,)
    num_out: int
    literals: tuple[tuple[int, Any], ...]  # (position, dtype) of outputs that are constants
    summarized: dict  # summarize function -> compiled evaluation that applies it
    ins: tuple[StateMeta, ...]  # what the rewritten jaxpr takes in (planted marks)
    in_avals: tuple
    plans: dict  # ran -> how the flat intermediates become the named dict
    call: dict | None  # params of a `jit` equation that calls `jaxpr` (None: inline it)
    checked: list  # `[True]` once `only=` was checked against the marks (`_check_only`)


# root callable (held weakly) -> OrderedDict(key -> _Entry), least recently used first.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_CACHE.clear)  # a new handler may see what the old ones could not


def _split_callable(fn: Callable) -> tuple[Any, Any, Callable]:
    """`(weak_root, tree, call)` such that `fn(*args, **kwargs)` is `call(tree, *args, **kwargs)`.

    The cache holds `weak_root` weakly; `tree` is flattened with the arguments, so the arrays of
    an `eqx.Module` (or of a bound method's object) are traced, not baked in.
    """
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(fn)):
        return type(fn), fn, _call_tree
    if inspect.ismethod(fn):
        return fn.__func__, fn.__self__, fn.__func__
    return fn, None, functools.partial(_call_plain, fn)


def _call_plain(fn, _tree, *args, **kwargs):
    return fn(*args, **kwargs)


def _call_tree(tree, *args, **kwargs):
    return tree(*args, **kwargs)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fn"],
    meta_fields=["only", "enabled", "summarize", "ran", "planting", "at"],
)
@dataclasses.dataclass(frozen=True)
class _Pulled:
    """What `pull` returns: a pytree whose leaves are `fn`'s (as an `eqx.Module`'s would be),
    with plain attributes, which a call reads without `eqx.Module`'s per-access work."""

    fn: Callable
    only: Any
    enabled: bool
    summarize: Any
    ran: bool = False
    planting: Any = None  # for `plant`: a `_plant.Planting`
    at: tuple = ()  # selections (`_select`): marks made where none were written

    @property
    def __wrapped__(self) -> Callable:
        """`fn`: `inspect.signature` gives `fn`'s signature (which tools and
        `jax.jit(..., static_argnames=...)` read), and JAX names a trace by `fn`."""
        return self.fn

    @boundary
    def __call__(self, *args, **kwargs):
        known = self.__dict__.get("_compiled")  # (generation, tree, compiled), once it has run
        if known is not None and known[0] == _GENERATION[0] and _fastpaths.on and _compat.eager():
            # An eager call of a pull that has run compiled: straight to it, which takes the
            # call if it is on arrays (see `_run_compiled`).
            result = _run_compiled(known[2], known[1], args, kwargs)
            if result is not None:
                return result
        return call_pulled(self, args, kwargs)


# The work of a call is in functions, not methods: each method access on an `eqx.Module` builds
# a bound-method module, which costs more than the rest of a cached call.


def call_pulled(pulled: _Pulled, args, kwargs, values=None):
    """`pulled(*args, **kwargs)`: `(out, intermediates)`; for `plant`, with `values` planted."""
    if pulled.at:  # the objects of an `of=` model mark their calls before anything is flattened
        with _select.objects_marked(pulled.at):
            return _call_pulled(pulled, args, kwargs, values)
    return _call_pulled(pulled, args, kwargs, values)


def _call_pulled(pulled: _Pulled, args, kwargs, values=None):
    fn = pulled.fn
    if not pulled.enabled:
        return fn(*args, **kwargs), {}
    is_node = _nnx.node_test()  # None unless Flax NNX is imported
    root, tree, call = _split_callable(fn)
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs), is_leaf=is_node)
    at, in_program = pulled.at, ()
    if at:  # marks by object where the objects are live (in NNX's merge), in the program around
        call = _select.calling(call, at, objects=True, fn=fn)
        # Places in the program: put into what `pull` traces; where something is planted, or
        # `ran=` asks for flags, by evaluating the program again with `save_inter`s there.
        planted = values is not None or pulled.planting is not None or _compat.PLANTING.value
        if not planted and not pulled.ran:
            in_program = tuple(s for s in at if not isinstance(s, _select.Modules))
            at = tuple(s for s in at if s not in in_program)
    eager = (
        _fastpaths.on
        and not at
        and values is None
        and pulled.summarize is None
        and pulled.planting is None
        and all(map(_is_array, leaves))
    )
    if eager:
        compiled = lookup(root, (pulled.only, pulled.ran), _COMPILED)
        if compiled is not None:
            result = _run_compiled(compiled, tree, args, kwargs)
            if result is not None:
                # This pull's next calls on arrays go straight here (its `tree` is fixed).
                object.__setattr__(pulled, "_compiled", (_GENERATION[0], tree, compiled))
                return result
    if is_node is not None and any(map(is_node, leaves)):
        # Flax NNX objects: keep their reference semantics, as `nnx.jit` does.
        packed, args, kwargs, nodes = _nnx.split(leaves, treedef)
        leaves, treedef = jax.tree_util.tree_flatten((packed, args, kwargs))
        call = _select.calling(_nnx.calling(call), at, objects=False)
        (out, state), inters = _run(pulled, root, call, leaves, treedef, values, False, in_program)
        _nnx.update(nodes, state)
        return out, inters
    call = _select.calling(call, at, objects=False)
    return _run(pulled, root, call, leaves, treedef, values, eager, in_program)


# ---- eager calls of a function that is all one `jit` ------------------------------------------
#
# Called on arrays, `pull(jax.jit(f))` runs through a `jax.jit` of its own evaluation, kept per
# function: its C++ dispatch checks the arguments and finds the compiled program, with none of
# the Python work of a call above. What it compiles is what an eager evaluation runs (the
# rewritten jaxpr is one `jit` equation). Functions that are not (`pull(f)` of a plain `f`
# runs op by op, as `f` would), and calls on anything but arrays, take the path above.

_ARRAY = type(jnp.zeros(()))  # what `jax.Array`s are (jaxlib's `ArrayImpl`)
_is_array = _ARRAY.__instancecheck__  # (no tracer is one)
# root callable (held weakly) -> OrderedDict((only, ran) -> compiled evaluation)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GENERATION = [0]  # counts the times the handlers changed (a pull keeps its compiled evaluation)


def _forget_compiled() -> None:
    _COMPILED.clear()
    _GENERATION[0] += 1


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


def _compile(root, call, only, ran) -> None:
    """Keep a compiled evaluation for `root` called with `only` and `ran` (once its first eager
    call has found it to be one `jit`: errors in the first trace are raised from `pull`'s own)."""
    key = (only, ran)
    if lookup(root, key, _COMPILED) is None:
        plain = isinstance(call, functools.partial)
        store(root, key, jax.jit(_evaluation(weakref.ref(root), plain, only, ran)), _COMPILED)


def _evaluation(root_ref, plain: bool, only, ran) -> Callable:
    # `root` is held weakly, so that the cache entry this lives in does not keep it alive.
    def evaluate(tree, *args, **kwargs):
        _CALL.traced = True
        arguments = getattr(_CALL, "arguments", None)  # the call's own, not their tracers
        leaves = jax.tree_util.tree_leaves(arguments, _nnx.node_test())
        if arguments is None or not all(map(_is_array, leaves)):
            raise _NotCompiled
        root = root_ref()
        if plain:
            call = functools.partial(_call_plain, root)
        else:  # (see `_split_callable`)
            call = _call_tree if isinstance(root, type) else root
        leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
        with _compat.RAN_MASKS(ran):
            entry, dynamic = _entry(root, call, leaves, treedef, only)
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
        and eqns[0].primitive is _compat.JIT_PRIMITIVE
        and not entry.ins
        and all(s is None for s in entry.out_static)
        and all(leaf is ARRAY for meta in entry.metas for leaf in meta.static_leaves)
    )


def _run(pulled, root, call, leaves, treedef, values, eager=False, in_program=()):
    only, planting, summarize, ran = pulled.only, pulled.planting, pulled.summarize, pulled.ran
    if values is None and planting is None and summarize is None and _fastpaths.on:
        trace = _staging.staging_trace()
        if trace is not None and _compat.PLANTING.value is None:
            return _inline(trace, call, leaves, treedef, only, ran, in_program)
    # `plant` traces with its planting in force (within an enclosing plant, that one stays).
    # Where the inputs are differentiated, the rules of custom derivatives run: their marks
    # are keys (see `handlers.custom_derivatives`); where they are not, there are none.
    differentiating = any(map(_compat.differentiated, leaves))
    with (
        contextlib.nullcontext() if planting is None else _compat.PLANTING(planting),
        _compat.DIFFERENTIATING(differentiating),
        _compat.RAN_MASKS(ran),
    ):
        entry, dynamic = _entry(root, call, leaves, treedef, only, pulled.at, in_program)
    if eager and _one_jit(entry):
        _compile(root, call, only, ran)
    if values is not None:  # `plant`: its values, checked against the marks
        fed = _plant.feed(entry.ins, entry.in_avals, values, planting, entry.metas)
    elif entry.ins:  # within an enclosing plant: what it plants comes in from outside
        fed = take(entry.ins, entry.in_avals)
    else:
        fed = []
    if summarize is not None:
        return _summarized(entry, summarize, ran)(*dynamic, *fed)
    # A planted run inside an enclosing pull: its intermediates (as planted) are marks again.
    remark = planting is not None and bool(_compat.PULLING.value)
    return _evaluate(entry, [*dynamic, *fed], ran, remark)


def _inline(trace, call, leaves, treedef, only, ran, in_program=()):
    """`pull` where a jaxpr is being staged (under `jit`, `make_jaxpr`, in a loop body): the
    function is traced straight into it, as it would be unpulled. Its marks are handed over as
    they are made, and the equations that hold marks further in (a `jit`, a loop) are
    rewritten where they stand."""
    if any(isinstance(x, _TRACED_PY_NUMBERS) for x in leaves):  # traced, as `_trace` does
        traced = _traced_mask(leaves, treedef)
        leaves = [
            jnp.asarray(x) if t and isinstance(x, _TRACED_PY_NUMBERS) else x
            for x, t in zip(leaves, traced, strict=True)
        ]
    tree, args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    collector = Collector()
    start = _staging.trace_length(trace)
    with _select.calls_checked(lambda: metas, only):
        with (
            selecting(only),
            _compat.PULLING(True),
            _compat.RAN_MASKS(ran),
            collecting(collector),
            _select.linen_marked(in_program) as chosen,
        ):
            collector.trace = trace
            out = call(tree, *args, **kwargs)
            collector.trace = None  # (a mark made once the function has returned is not its own)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        if in_program:
            with selecting(only):
                _select.collected_staged(trace, start, out_leaves, collector, chosen())
        new_leaves, flat, metas = pull_staged(trace, start, out_leaves, collector)
    if only is not None:
        everything = lambda: _trace(  # noqa: E731
            None, call, leaves, treedef, *_traced_avals(leaves, treedef), in_program
        )
        _check_only(only, metas, everything)
    if any(a is not b for a, b in zip(new_leaves, out_leaves, strict=True)):
        out = jax.tree_util.tree_unflatten(out_def, new_leaves)
    return out, _name(metas, flat, ran, _plans(metas))


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
        _check_only(only, entry.metas, everything)
        entry.checked.append(True)
    return entry, dynamic


def _traced_avals(leaves, treedef) -> tuple[list, None, tuple]:
    """`(traced, None, avals)`: `_trace`'s arguments after `call, leaves, treedef`, for `pull`
    of everything."""
    traced, dynamic, _ = arguments_key(leaves, treedef)
    return traced, None, tuple(map(jax.typeof, dynamic))


def _check_only(only, metas: Sequence[StateMeta], everything: Callable) -> None:
    """Raise where `only=` selects nothing, or names a mark the program does not have
    (`everything()`: the program's entry with every mark collected, for the message)."""
    names = {m.name for m in metas}
    if isinstance(only, _Names):
        missing = sorted(only.names - names)
    elif isinstance(only, _Pattern):  # a pattern that matches nothing: a typo, as a name is
        missing = [] if names else [only]
    else:  # a predicate is a filter: one that lets nothing through selects nothing, quietly
        missing = []
    if not missing:
        return
    there = sorted({m.name for m in everything().metas})
    shown = repr(missing[0].pattern.pattern if isinstance(missing[0], _Pattern) else missing[0])
    hint = ""
    if isinstance(missing[0], str) and re.fullmatch(r".+_\d+", missing[0]):
        base = missing[0].rsplit("_", 1)[0]
        if base in there:
            hint = (
                f" {missing[0]!r} is a key: only= takes names, as save_inter was given them "
                f"({base!r})."
            )
    listed = _select.closest(str(missing[0]), there) if there else "none"
    raise SelectionError(
        f"stx.pull(fn, only=...): {shown} selects no mark of the program.{hint} The marks there, "
        f"closest first: {listed}."
    )


def cached(root, key, make: Callable, cache: weakref.WeakKeyDictionary = _CACHE):
    """The entry (a trace and what was made of it, with a `jaxpr`) kept for `root` and `key`,
    made by `make()` on a miss and kept unless its jaxpr closes over tracers (of a trace that
    ends): the one trace-and-cache pipeline of `pull` and `stateful`."""
    entry = lookup(root, key, cache)
    if entry is None:
        entry = make()
        if not any(isinstance(c, jax.core.Tracer) for c in entry.jaxpr.consts):
            store(root, key, entry, cache)
    return entry


def arguments_key(leaves: list, treedef) -> tuple[list, list, tuple]:
    """`(traced, dynamic, key)`: which leaves are traced, those leaves, and what a cached trace
    for them is keyed by (as `jax.jit`: JAX's trace context too, so that no result traced
    under other flags comes back)."""
    traced = _traced_mask(leaves, treedef)
    dynamic = [leaf for leaf, t in zip(leaves, traced, strict=True) if t]
    key = (
        _compat.trace_context(),
        treedef,
        tuple(None if t else hashable(leaf) for leaf, t in zip(leaves, traced, strict=True)),
        tuple(map(jax.typeof, dynamic)),
    )
    return traced, dynamic, key


def _evaluate(
    entry: _Entry, args: Sequence, ran: bool, remark: bool = False
) -> tuple[Any, dict[str, Any]]:
    if entry.call is not None and any(isinstance(x, jax.core.Tracer) for x in args):
        # In a trace, one equation (as a `jax.jit` of the function would be): evaluating the
        # jaxpr would stage each of its equations again, doubling the cost of tracing.
        flat = _compat.JIT_PRIMITIVE.bind(*args, **entry.call)
    else:
        flat = jex.jaxpr_as_fun(entry.jaxpr)(*args)
    if remark:
        mark(flat[entry.num_out :], entry.metas)
    if entry.literals:  # a constant comes back as an array, whatever JAX's literal is
        flat = list(flat)
        for i, dtype in entry.literals:
            flat[i] = jnp.asarray(flat[i], dtype)
    n = entry.num_out
    inters = _name(entry.metas, flat[n:], ran, entry.plans)
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


class Key(str):
    """A key of the dict `pull` returns: the string `f"{name}_{n}"` (or the name of a reduced
    entry), which also knows where its value was saved, `key.location` (`"file.py:line"`), and
    its `save_inter`'s `reduce` mode (`key.reduce`, `None` for one occurrence). It travels with
    the result: through `dict(inters)`, `summarize=`, and JAX transformations."""

    location: str
    reduce: str | None

    def __new__(cls, key: str, location: str, reduce: str | None = None) -> Key:
        self = super().__new__(cls, key)
        self.location = location
        self.reduce = reduce
        return self

    def __reduce__(self):
        return (Key, (str(self), self.location, self.reduce))


@functools.lru_cache(maxsize=4096)
def _key(name: str, location: str, reduce: str | None) -> Key:
    """The `Key` (made once: keys are immutable)."""
    return Key(name, location, reduce)


def origins(inters: dict) -> dict[str, str]:
    """`{key: "file:line"}` for the keys of `inters` that `pull` made."""
    return {key: key.location for key in inters if isinstance(key, Key)}


def _traced_mask(leaves: list, treedef) -> list[bool]:
    """Array leaves are traced; so is a Python float or complex passed directly as an argument.

    Python ints and bools stay static, as in `eqx.filter_jit`: they are sizes, flags and
    `static_argnums` far more often than data.
    """
    traced = [eqx.is_array(leaf) for leaf in leaves]
    if not any(isinstance(leaf, _TRACED_PY_NUMBERS) for leaf in leaves):
        return traced
    _, args_def, kwargs_def = treedef.children()
    start = treedef.children()[0].num_leaves
    for child in (*args_def.children(), *kwargs_def.children()):
        if (
            child.num_leaves == 1
            and isinstance(leaves[start], _TRACED_PY_NUMBERS)
            and (jax.tree_util.treedef_is_leaf(child))
        ):
            traced[start] = True
        start += child.num_leaves
    return traced


def lookup(root, key, cache: weakref.WeakKeyDictionary = _CACHE) -> Any:
    """The entry cached for `root` under `key` in `cache` (pull's by default), or None."""
    try:
        entries = cache.get(root)
    except TypeError:  # not weakly referenceable: not cached
        return None
    if entries is None:
        return None
    entry = entries.get(key)
    if entry is not None:
        entries.move_to_end(key)
    return entry


def store(root, key, entry, cache: weakref.WeakKeyDictionary = _CACHE) -> None:
    """Cache `entry` for `root` under `key`, keeping the most recently used few per root."""
    try:
        entries = cache.setdefault(root, OrderedDict())
    except TypeError:
        return
    entries[key] = entry
    if len(entries) > _MAX_ENTRIES_PER_FUNCTION:
        entries.popitem(last=False)


def flat_function(call, leaves, treedef, traced, out_info: list) -> Callable:
    """`call` as a function of the traced leaves only, returning its array outputs flat; the
    output's structure and non-array leaves go to `out_info` when it is traced."""

    def flat_fn(*dynamic):
        it = iter(dynamic)
        full = [next(it) if t else leaf for leaf, t in zip(leaves, traced, strict=True)]
        tree, args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        out = call(tree, *args, **kwargs)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        is_arr = [eqx.is_array(x) for x in out_leaves]
        static = tuple(None if a else (x,) for x, a in zip(out_leaves, is_arr, strict=True))
        out_info.append((out_def, static))
        return [x for x, a in zip(out_leaves, is_arr, strict=True) if a]

    return flat_fn


def _trace(root, call, leaves, treedef, traced, only, avals, in_program=()) -> _Entry:
    out_info = []
    flat_fn = flat_function(call, leaves, treedef, traced, out_info)
    collector = Collector()

    def run(*args):  # flat_fn, handing its marks to `collector`
        collector.trace = _compat.current_trace()
        outs = flat_fn(*args)
        collector.trace = None  # (a mark made once the function has returned is not its own)
        return [*outs, *collector.leaves]

    source = root.__call__ if isinstance(root, type) else root
    # (`selecting`: in force where marks are bound, as in rebatched loops, and for the rewrite)
    with selecting(only), _select.calls_checked(lambda: metas, only):
        with _compat.PULLING(True), collecting(collector), _select.linen_marked(in_program) as sel:
            closed = _compat.trace(run, avals, "pull", source)
        n = len(closed.jaxpr.outvars) - len(collector.leaves)  # the function's own outputs
        marks = collector.marks
        if in_program:
            closed, marks = _select.collected(closed, marks, sel())
        new, metas, ins = pull_collected(closed, marks)
    out_def, out_static = out_info[0]
    literals = tuple(
        (i, x.aval.dtype) for i, x in enumerate(new.jaxpr.outvars) if isinstance(x, jex.Literal)
    )
    in_avals = tuple(new.in_avals[len(avals) :])
    escaped = any(isinstance(c, jax.core.Tracer) for c in new.consts)
    call_params = None if escaped else _compat.jit_call_params(new, _name_of(root))
    return _Entry(
        new, metas, out_def, out_static, n, literals, {}, ins, in_avals, {}, call_params, []
    )


def _name_of(root) -> str:
    """`"pull(f)"`, the name of the `jit` equation that calls the rewritten `f` (`root`, as
    `_split_callable` gives it: a module's class, a method's function)."""
    return f"pull({getattr(root, '__name__', type(root).__name__)})"


def unflatten_out(entry, arrays: Sequence) -> Any:
    """The output from its flat arrays (`entry` has `out_static` and `out_treedef`)."""
    it = iter(arrays)
    leaves = [next(it) if s is None else s[0] for s in entry.out_static]
    return jax.tree_util.tree_unflatten(entry.out_treedef, leaves)


def _name(metas: Sequence[StateMeta], flat: Sequence, ran: bool, plans: dict) -> dict:
    """`{f"{name}_{n}": value}`, n counting each name's occurrences in program order; a
    reduced name is one entry, keyed by the name itself. With `ran`, a `"stack"` or
    `"collect"` name also gets `f"{name}.ran"`, its masks of occurrences that ran. The keys are
    worked out once per entry (`plans`)."""
    plan = plans.get(ran)
    if plan is None:
        plan = plans[ran] = _plan(metas, ran)
    inters: dict[str, Any] = {}
    for key, meta, start, stop, kind in plan:
        if kind == "array":
            inters[key] = flat[start]
            continue
        leaves = flat[start:stop]
        if kind == "value":
            inters[key] = meta.unflatten(leaves)
        elif kind == "flagged":  # the value, its mask last
            inters[key] = meta.unflatten(leaves[:-1])
        elif kind == "flag":
            inters[key] = leaves[-1]
        elif kind == "final":
            inters[key] = meta.unflatten(_reduce.finalize(meta, leaves))
        else:
            inters[key] = meta.unflatten(_reduce.ran(meta, leaves))
    return inters


@functools.lru_cache(maxsize=256)
def _plans(metas: tuple[StateMeta, ...]) -> dict:
    """The `plans` of `_name` for `metas`, kept for the next trace of the same marks."""
    return {}


def _plan(metas: Sequence[StateMeta], ran: bool) -> list:
    """`[(Key, meta, start, stop, kind)]`: where each entry of the result comes from, and how
    it is made from its leaves (`kind`: "array", "value", "final" or "ran")."""
    sites: dict[str, StateMeta] = {}
    plan = []
    start = 0
    for key, meta in zip(keys_of(metas), metas, strict=True):
        stop = start + meta.num_arrays
        kind = "value" if meta.reduce is None else "final"
        if (
            kind == "value"
            and meta.static_leaves == (ARRAY,)
            and jax.tree_util.treedef_is_leaf(meta.treedef)
            and not meta.flagged
        ):
            kind = "array"  # the value is its one array
        entries = [(key, "flagged" if meta.flagged else kind)]
        if meta.flagged:
            entries.append((key + ".ran", "flag"))
        if ran and meta.reduce is not None and _reduce.stacked(meta):
            entries.append((meta.name + ".ran", "ran"))
        for name, kind in entries:
            if name in sites:
                raise KeyCollisionError(name, sites[name], meta)
            sites[name] = meta
            plan.append((_key(name, meta.location, meta.reduce), meta, start, stop, kind))
        start = stop
    return plan


def pull(
    fn: Callable,
    *,
    only: Any = None,
    enabled: bool = True,
    summarize: Callable | None = None,
    ran: bool = False,
    at: Any = None,
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
    return _Pulled(
        fn, _selection(only), bool(enabled), summarize, bool(ran), None, _select.selections(at)
    )


@dataclasses.dataclass(frozen=True)
class _Names:
    names: frozenset

    def __call__(self, meta: StateMeta) -> bool:
        return meta.name in self.names


@dataclasses.dataclass(frozen=True)
class _Pattern:
    pattern: re.Pattern

    def __call__(self, meta: StateMeta) -> bool:
        return self.pattern.fullmatch(meta.name) is not None


def _selection(only: Any) -> Callable[[StateMeta], bool] | None:
    """`only` as a hashable predicate on StateMeta (None: everything)."""
    if only is None:
        return None
    if isinstance(only, str):
        return _Names(frozenset([only]))
    if isinstance(only, re.Pattern):
        return _Pattern(only)
    if callable(only):
        return only
    try:
        names = frozenset(only)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"stx.pull(fn, only=...) takes a name, a collection of names, a compiled regular "
            f"expression or a predicate on StateMeta; got {only!r}."
        )
    return _Names(names)

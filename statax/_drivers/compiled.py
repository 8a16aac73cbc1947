"""The eager compiled path of `pull(jax.jit(f))`: called on arrays, the pull runs one `jax.jit`
of its own evaluation, kept per function, selection and `ran=`, whose C++ dispatch checks the
arguments and finds the compiled program (see `cache`)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable

import jax

from .._core import context as _context
from .._core.flat_calls import call_plain, call_tree
from .._core.meta import ARRAY
from .._core.registry import on_forget
from .._jax import primitives as _primitives
from .._select.plan import Plan
from . import nnx as _nnx
from .cache import (
    is_array,
    lookup,
    store,
)
from .entries import Entry, entry_for, evaluate

__all__ = ["compile_entry", "generation", "lookup_compiled", "one_jit", "run_compiled"]


# root callable (held weakly) -> OrderedDict((only, ran, at) -> compiled evaluation)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_generation = 0  # counts the times the handlers changed (a pull keeps its compiled evaluation)


def generation() -> int:
    """How many times the handlers have changed: a pull keeps its compiled evaluation with the
    generation it was made in, and uses it only in that one."""
    return _generation


def lookup_compiled(root, key):
    """The compiled evaluation kept for `root` and `key` (`(only, ran, at)`), or None."""
    return lookup(root, key, _COMPILED)


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


def run_compiled(compiled, tree, args, kwargs) -> tuple | None:
    """`(out, intermediates)` from the compiled evaluation, or None where, for these arguments,
    the function is not one `jit` or they are not all arrays: then the call takes the path of
    any other (which raises any error that is the function's own).

    A call checks nothing that `jax.jit` does not. Its caches find the evaluation compiled only
    for arguments of the tree and types of arrays that traced it (the evaluation refuses anything
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


def compile_entry(root, call, only, ran, at) -> None:
    """Keep a compiled evaluation for `root` called with `only`, `ran` and the places `at`
    selects in the program (once its first eager call has found it to be one `jit`: errors in
    the first trace are raised from `pull`'s own)."""
    key = (only, ran, at)
    if lookup(root, key, _COMPILED) is None:
        plain = isinstance(call, functools.partial)
        store(root, key, jax.jit(_evaluation(weakref.ref(root), plain, only, ran, at)), _COMPILED)


def _evaluation(root_ref, plain: bool, only, ran, at) -> Callable:
    # `root` is held weakly, so that the cache entry this lives in does not keep it alive.
    def run(tree, *args, **kwargs):
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
            # (`at` holds places only: a pull that selects objects is not compiled so)
            entry, dynamic = entry_for(root, call, leaves, treedef, only, at, Plan(at))
        if not one_jit(entry):
            raise _NotCompiled
        out, inters = evaluate(entry, dynamic, ran)
        return out, _InOrder(tuple(inters), list(inters.values()))

    return run


def one_jit(entry: Entry) -> bool:
    """Whether `entry` is one `jit` equation, and returns arrays only."""
    eqns = entry.jaxpr.jaxpr.eqns
    return (
        len(eqns) == 1
        and eqns[0].primitive is _primitives.JIT_PRIMITIVE
        and not entry.ins
        and all(s is None for s in entry.out_static)
        and all(leaf is ARRAY for meta in entry.metas for leaf in meta.static_leaves)
    )

"""How a driver calls a function: the equinox filter convention (arrays traced, the rest
static), the callable itself flattened with its arguments (an `eqx.Module`'s arrays are traced),
and the array outputs made flat.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


def split_callable(fn: Callable) -> tuple[Any, Any, Callable]:
    """`(weak_root, tree, call)` such that `fn(*args, **kwargs)` is `call(tree, *args, **kwargs)`.

    The cache holds `weak_root` weakly; `tree` is flattened with the arguments, so the arrays of
    an `eqx.Module` (or of a bound method's object) are traced, not baked in.
    """
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(fn)):
        return type(fn), fn, call_tree
    if inspect.ismethod(fn):
        return fn.__func__, fn.__self__, fn.__func__
    return fn, None, functools.partial(call_plain, fn)


def call_plain(fn, _tree, *args, **kwargs):
    return fn(*args, **kwargs)


def call_tree(tree, *args, **kwargs):
    return tree(*args, **kwargs)


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

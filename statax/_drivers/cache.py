"""The traces a driver keeps, for a function the user wrapped in `jax.jit` (or
`eqx.filter_jit`) only: per function (held weakly) and per kind of argument (their types,
static leaves and tree structure), a few each.

Any other function is traced at every call: whatever it reads from outside its arguments (a
global, a closed-over array or model) is a constant of its trace, so a trace kept would answer
for the function as it was. A jitted function keeps its own first trace (`jax.jit`'s rule), and
a trace of it kept here gives what a call of it gives.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from .._core.meta import hashable
from .._core.registry import on_forget
from .._jax import tracing as _tracing

TRACED_PY_NUMBERS = (float, complex)
_MAX_ENTRIES_PER_FUNCTION = 64


# root callable (held weakly) -> OrderedDict(key -> _Entry), least recently used first.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_CACHE.clear)  # a new handler may see what the old ones could not


# ---- eager calls of a function that is all one `jit` ------------------------------------------
#
# Called on arrays, `pull(jax.jit(f))` runs through a `jax.jit` of its own evaluation, kept per
# function: its C++ dispatch checks the arguments and finds the compiled program, with none of
# the Python work of a call above. What it compiles is what an eager evaluation runs (the
# rewritten jaxpr is one `jit` equation). Functions that are not (`pull(f)` of a plain `f`
# runs op by op, as `f` would), and calls on anything but arrays, take the path above.

is_array = _tracing.ARRAY_TYPE.__instancecheck__  # a `jax.Array` (no tracer is one)


def traced_avals(leaves, treedef) -> tuple[list, None, tuple]:
    """`(traced, None, avals)`: `_trace`'s arguments after `call, leaves, treedef`, for `pull`
    of everything."""
    traced, dynamic, _ = arguments_key(leaves, treedef)
    return traced, None, tuple(map(jax.typeof, dynamic))


def follows_jit(root) -> bool:
    """Whether `root` (as `split_callable` gives it) is a function wrapped in `jax.jit` or
    `eqx.filter_jit`, whose calls follow `jax.jit`'s rule: its first trace is kept."""
    jitted, filter_jitted = _jit_types()
    return isinstance(root, jitted) or root is filter_jitted


@functools.cache
def _jit_types() -> tuple[type, type]:
    # (made on first use: building them at import would be work that `import statax` does)
    identity = lambda x: x  # noqa: E731
    return type(jax.jit(identity)), type(eqx.filter_jit(identity))


def cached(root, key, make: Callable, cache: weakref.WeakKeyDictionary = _CACHE):
    """The entry (a trace and what was made of it, with a `jaxpr`) kept for `root` and `key`,
    made by `make()` on a miss and kept unless its jaxpr closes over tracers (of a trace that
    ends): the one trace-and-cache pipeline of `pull` and `stateful`. A `root` that does not
    follow `jax.jit`'s rule is traced at every call (see above)."""
    if not follows_jit(root):
        return make()
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
    traced = traced_mask(leaves, treedef)
    dynamic = [leaf for leaf, t in zip(leaves, traced, strict=True) if t]
    key = (
        _tracing.trace_context(),
        treedef,
        tuple(None if t else hashable(leaf) for leaf, t in zip(leaves, traced, strict=True)),
        tuple(map(jax.typeof, dynamic)),
    )
    return traced, dynamic, key


def traced_mask(leaves: list, treedef) -> list[bool]:
    """Array leaves are traced; so is a Python float or complex passed directly as an argument.

    Python ints and bools stay static, as in `eqx.filter_jit`: they are sizes, flags and
    `static_argnums` far more often than data.
    """
    traced = [eqx.is_array(leaf) for leaf in leaves]
    if not any(isinstance(leaf, TRACED_PY_NUMBERS) for leaf in leaves):
        return traced
    _, args_def, kwargs_def = treedef.children()
    start = treedef.children()[0].num_leaves
    for child in (*args_def.children(), *kwargs_def.children()):
        if (
            child.num_leaves == 1
            and isinstance(leaves[start], TRACED_PY_NUMBERS)
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

"""`stateful`: named state threaded through any function.

`stateful(fn)(*args, state=...)` traces `fn` once per kind of argument and of state, then
threads the jaxpr (`_core.thread_state.run`, a hook on the one evaluator) with the state's
current values, and returns `(out, new_state)`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._core import context as _context
from .._core import flat_calls as _flat_calls
from .._core.errors import StateError
from .._core.meta import StateMeta, number_as_array
from .._core.state import Given, split_state
from .._core.thread_state import Log, Slot, state_names
from .._core.thread_state import run as _run
from .._core.tracebacks import boundary
from .._jax import jaxprs as _jaxprs
from . import cache as _cache
from . import naming as _naming

__all__ = ["stateful"]


class _Stateful(eqx.Module):
    fn: Callable
    output_unchanged: bool = eqx.field(static=True)

    @boundary
    def __call__(self, *args, state: dict | None = None, **kwargs):
        return _call(self.fn, self.output_unchanged, args, kwargs, state)


def stateful(fn: Callable, output_unchanged: bool = False) -> Callable:
    """Transform `fn` to read and write named state with `get_state` and `set_state`.

    Args:
        fn: any callable, as for `pull` (its array arguments are traced, its other arguments
            static; a Python float passed directly is traced).
        output_unchanged: also return the names that are only read, with the value they were
            read with (passed in, or `init()`).

    Returns:
        `g(*args, state=None, **kwargs) -> (out, new_state)`. `state` is a dict of values by
        name (any pytrees; array leaves and Python numbers traced, as `jax.jit` traces them,
        others passed through; per-example state returned from under an inner `vmap` may be
        passed back). `new_state` holds the
        final value of every name that `fn` sets, in the order first set. The same shapes do
        not trace `fn` again. It composes with `jit`, `grad` (`has_aux=True` outside), `vmap`,
        `pull` and `plant`, in either order.

    Raises:
        StateError: a name in `state` that `fn` never reads or sets; a value of the wrong
            kind; a name that a `cond` branch or a `while_loop` sets with no value before it.
    """
    if not callable(fn):
        raise TypeError(f"stx.stateful needs a callable, got {fn!r} of type {type(fn).__name__}.")
    return _Stateful(fn, bool(output_unchanged))


# ---- calling ------------------------------------------------------------------------------


class _Entry(NamedTuple):
    jaxpr: jex.ClosedJaxpr  # (dynamic args, given state leaves) -> (outs, new state leaves)
    out_treedef: Any
    out_static: tuple
    num_out: int
    metas: tuple[StateMeta, ...]  # of new_state, in order


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call(fn, output_unchanged, args, kwargs, state):
    if state is None:
        state = {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError(f"stateful's state= takes a dict of values by name, got {state!r}.")
    specs, state_leaves = [], []
    for name in sorted(state):
        # A Python number is traced, as `jax.jit` traces a Python number argument: weakly
        # typed, so that it takes the type of what it meets, in every construct.
        value = jax.tree_util.tree_map(number_as_array, state[name])
        meta, arrays = split_state(value, name, "state=")
        specs.append((name, meta, tuple(jax.typeof(x) for x in arrays)))
        state_leaves.extend(arrays)
    given = Given(tuple(specs))
    root, tree, call = _flat_calls.split_callable(fn)
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
    traced, dynamic, key = _cache.arguments_key(leaves, treedef)
    key = (output_unchanged, given, *key)
    entry = _cache.cached(
        root,
        key,
        lambda: _trace(call, leaves, treedef, traced, given, state_leaves, output_unchanged),
        _CACHE,
    )
    # Outputs that are inputs or literals come back as arrays, as from `jax.jit`.
    flat = jex.jaxpr_as_fun(entry.jaxpr)(*dynamic, *state_leaves)
    flat = [
        x if isinstance(x, jax.Array) else jnp.asarray(x, None if a.weak_type else a.dtype)
        for x, a in zip(flat, entry.jaxpr.out_avals, strict=True)
    ]
    out = _naming.unflatten_out(entry, flat[: entry.num_out])
    new_state, start = {}, entry.num_out
    for meta in entry.metas:
        new_state[meta.name] = meta.unflatten(flat[start : start + meta.num_values])
        start += meta.num_values
    return out, new_state


def _trace(call, leaves, treedef, traced, given: Given, state_leaves, output_unchanged) -> _Entry:
    out_info: list = []
    flat_fn = _flat_calls.flat_function(call, leaves, treedef, traced, out_info)
    dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]
    with _context.STATEFUL(given):  # (Python functions a primitive runs are traced in it too)
        closed = jax.make_jaxpr(flat_fn)(*dynamic)
        names = state_names(closed.jaxpr)
    unused = [n for n, _, _ in given.specs if n not in names.reads and n not in names.writes]
    if unused:
        used = sorted({*names.reads, *names.writes})
        raise StateError(
            f"State passed in that the function never reads or sets: {unused}. It uses "
            f"{used or 'no state'}. Remove the name from state=, or check its spelling."
        )
    metas: list[StateMeta] = []

    def threaded(*flat):
        args, rest = flat[: len(dynamic)], iter(flat[len(dynamic) :])
        env = {n: Slot(meta, tuple(next(rest) for _ in avals)) for n, meta, avals in given.specs}
        log = Log()
        outs = _run(closed.jaxpr, closed.consts, args, env, log)
        names_out = [n for n in log.set_order if n in env]
        if output_unchanged:
            for n in log.read_order:
                if n in names_out:
                    continue
                if n not in env and n not in log.top_defaults:
                    raise StateError(
                        f"output_unchanged=True cannot report the state {n!r}: it is only read, "
                        "first inside a loop or a branch, where its init() has no value outside. "
                        "Pass it in state=, or read it once outside the loop."
                    )
                names_out.append(n)
        slots = [env[n] if n in env else log.top_defaults[n] for n in names_out]
        metas[:] = [s.meta for s in slots]
        return [*outs, *(x for s in slots for x in s.leaves)]

    in_avals = [*map(jax.typeof, dynamic), *map(jax.typeof, state_leaves)]
    with _context.STATEFUL(given):
        new = _jaxprs.trace(threaded, in_avals, name="stateful")
    out_def, out_static = out_info[0]
    return _Entry(new, out_def, out_static, len(closed.jaxpr.outvars), tuple(metas))

"""`get_state` and `set_state`: named state, read and set anywhere in a function.

They bind two primitives, and only while `stateful` traces (outside one, `get_state` returns
its `init()` with a `StatefulWarning` and `set_state` returns its value). `stateful` threads
the traced jaxpr (`_core.thread_state`). Under `vmap` both primitives are batched with the
batch axis first: a value set under a `vmap` is per example, and a read under a `vmap` sees
each example's value (an unbatched value is broadcast).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from . import context as _context
from . import jax_rules as _jax_rules
from . import staging as _staging
from .derivatives import zero_tangent
from .errors import StateError, StatefulWarning
from .meta import ARRAY, StateMeta, kind_str, split
from .primitive import batch_first, caller_location

__all__ = ["get_state", "get_state_p", "set_state", "set_state_p"]

get_state_p = jex.Primitive("get_state")
get_state_p.multiple_results = True
set_state_p = jex.Primitive("set_state")
set_state_p.multiple_results = True


# ---- the user API --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Given:
    """The state a `stateful` call passes in: per name, its `StateMeta` (structure and
    non-array leaves) and the types of its array leaves. Hashable: part of the trace context."""

    specs: tuple[tuple[str, StateMeta, tuple], ...]
    # The kind of each name last set while tracing, in program order, for a `get_state` with
    # no `init` of a name not passed in. Not part of the key.
    set_kinds: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def get(self, name: str) -> tuple[StateMeta, tuple] | None:
        for n, meta, avals in self.specs:
            if n == name:
                return meta, avals
        return None


def split_state(value: Any, name: str, location: str) -> tuple[StateMeta, list]:
    treedef, static, arrays = split(value)
    return StateMeta(name, treedef, static, location), arrays


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"{what} needs a string name, got {name!r} of type {type(name).__name__} at "
            f'{caller_location()}. Pass e.g. name="running_mean".'
        )
    return _context.SCOPE.value + name


def kind_of(meta: StateMeta, avals: Sequence) -> str:
    shapes = iter(kind_str(a.shape, a.dtype) for a in avals)
    leaves = [
        next(shapes) if s is ARRAY else repr(getattr(s, "value", s)) for s in meta.static_leaves
    ]
    return str(jax.tree_util.tree_unflatten(meta.treedef, leaves))


def get_state(name: str, init: Callable[[], Any] | None = None) -> Any:
    """The current value of the state `name` inside `stateful`; `init()` where it has none.

    Args:
        name: the state's name (prefixed by the enclosing `statax.scope`s).
        init: a function of no arguments returning the initial value, any pytree. It may be
            left out for a name that is always passed in with `state=`.

    Returns:
        Within `stateful`: the value last set with `set_state` in program order (in a loop,
        by an earlier iteration), else the value passed in `state=`, else `init()`. Its array
        leaves are traced; its other leaves (Python numbers, strings) are returned as they
        are. Outside `stateful`: `init()`, with a `StatefulWarning`.

    Raises:
        StateError: a value passed in `state=` of another kind than `init()` returns, or no
            `init` for a name not passed in.
    """
    name = _check_name(name, "get_state")
    given = _context.STATEFUL.value
    location = caller_location()
    if given is None:
        warnings.warn(
            f"get_state({name!r}) at {location} ran outside stx.stateful: it returns init(), and "
            "set_state does nothing. Call the function through stx.stateful(fn) to thread state.",
            StatefulWarning,
            stacklevel=2,
        )
        if init is None:
            raise StateError(f"get_state({name!r}) at {location} has no init and no state.")
        return init()
    default = None if init is None else split_state(init(), name, location)
    spec = given.get(name)
    if spec is None and default is None:  # the kind it was last set to, if it was
        kind = given.set_kinds.get(name)
        if kind is not None:
            default = kind[0], [jnp.zeros(a.shape, a.dtype) for a in kind[1]]
    if spec is None:
        if default is None:
            raise StateError(
                f"get_state({name!r}) at {location} has no value: it was not passed in "
                "state=, has no init, and no set_state of it was traced before it. Pass "
                f"state={{{name!r}: value}} or init=lambda: value."
            )
        meta, operands = default
        avals = tuple(jax.typeof(x) for x in operands)
    else:
        (meta, avals), operands = spec, []
        if default is not None:
            default_avals = [jax.typeof(x) for x in default[1]]
            if _check_given(default[0], default_avals, meta, avals):
                # Per example, as `stateful` returned it from under a `vmap`: read as
                # `init()`'s kind, which a read under the `vmap` batches to the value's.
                meta, avals = default[0], tuple(default_avals)
        meta = dataclasses.replace(meta, location=location)
    outs = get_state_p.bind(*operands, meta=meta, avals=avals)
    return meta.unflatten(outs)


def _check_given(expected: StateMeta, expected_avals, given: StateMeta, given_avals) -> bool:
    """Check a value passed in against what `init()` returns; whether it is per example: its
    arrays have the same leading axes more (a `stateful` with an inner `vmap` returns such
    state), which a read under that `vmap` reads per example."""
    # A non-array leaf passed in where `init()` has an array is passed through as it is (a
    # Python number); arrays must agree in shape and dtype.
    ok = expected.treedef == given.treedef
    extra = set()
    if ok:
        exp, got = iter(expected_avals), iter(given_avals)
        for e, g in zip(expected.static_leaves, given.static_leaves, strict=True):
            if e is ARRAY and g is ARRAY:
                a, b = next(exp), next(got)
                k = len(b.shape) - len(a.shape)
                ok = ok and k >= 0 and b.shape[k:] == a.shape and a.dtype == b.dtype
                extra.add(b.shape[:k])
            elif e is ARRAY:
                next(exp)
            elif g is ARRAY:
                next(got)
        ok = ok and len(extra) <= 1  # one batch shape for every leaf
    if ok:
        return bool(extra) and extra != {()}
    if not ok:
        raise StateError(
            f"The state {given.name!r} passed in is {kind_of(given, given_avals)}, but "
            "get_state at "
            f"{expected.location} expects {kind_of(expected, expected_avals)} (what its init() "
            "returns). Pass a value of the same structure, shapes and dtypes."
        )


def set_state(value: Any, name: str) -> Any:
    """Set the state `name` to `value` inside `stateful`; does nothing outside one.

    Args:
        value: any pytree. Its array leaves are traced; its other leaves are kept as they are.
        name: the state's name (prefixed by the enclosing `statax.scope`s).

    Returns:
        `value`, unchanged.
    """
    name = _check_name(name, "set_state")
    given = _context.STATEFUL.value
    if given is None:
        return value
    meta, arrays = split_state(value, name, caller_location())
    given.set_kinds[name] = (meta, tuple(jax.typeof(x) for x in arrays))
    return meta.unflatten(set_state_p.bind(*arrays, meta=meta))


# ---- the primitives' rules ----------------------------------------------------------------


def _escaped(what: str, meta: StateMeta) -> StateError:
    return StateError(
        f"{what}({meta.name!r}) at {meta.location} ran where stx.stateful could not thread it: "
        "inside a primitive whose rules run Python code of their own and that has no handler "
        "saying what it runs (see 'Writing a handler' in the docs: `runs=`), or in a function "
        "traced inside stateful and run outside it. Move the call out of it."
    )


@get_state_p.def_impl
def _get_impl(*defaults, meta, avals):
    raise _escaped("get_state", meta)


@set_state_p.def_impl
def _set_impl(*xs, meta):
    raise _escaped("set_state", meta)


@get_state_p.def_effectful_abstract_eval
def _get_abstract(*defaults, meta, avals):
    return list(avals), {_context.STATE_EFFECT}


@set_state_p.def_effectful_abstract_eval
def _set_abstract(*avals, meta):
    return list(avals), {_context.STATE_EFFECT}


def _get_lowering(ctx, *xs, meta, avals):
    raise _escaped("get_state", meta)


def _set_lowering(ctx, *xs, meta):
    raise _escaped("set_state", meta)


_jax_rules.register_lowering(get_state_p, _get_lowering)
_jax_rules.register_lowering(set_state_p, _set_lowering)


def _get_jvp(primals, tangents, **params):
    # State read is a constant of the function being differentiated inside `stateful`.
    outs = get_state_p.bind(*primals, **params)
    return outs, [zero_tangent(x) for x in outs]


def _set_jvp(primals, tangents, **params):
    return set_state_p.bind(*primals, **params), list(tangents)


_jax_rules.register_jvp_rule(get_state_p, _get_jvp)
_jax_rules.register_jvp_rule(set_state_p, _set_jvp)
_jax_rules.register_transpose_rule(set_state_p, lambda cts, *args, **params: list(cts))


def _batched_meta(meta: StateMeta) -> StateMeta:
    return dataclasses.replace(meta, batch_ndim=meta.batch_ndim + 1)


def _get_batch(axis_size, vals, dims, *, meta, avals):
    # Every read under a vmap is per example: the state may hold one value per example (set
    # under this vmap), or one for all (broadcast when it is read).
    avals = tuple(a.update(shape=(axis_size, *a.shape)) for a in avals)
    outs = get_state_p.bind(
        *batch_first(axis_size, vals, dims), meta=_batched_meta(meta), avals=avals
    )
    return outs, [0] * len(outs)


def _set_batch(axis_size, vals, dims, *, meta):
    # The values handed on keep their batch axes; what is set has the batch axis first. An
    # unbatched value stays one value for all examples.
    if all(d is None for d in dims):
        set_state_p.bind(*vals, meta=meta)
    else:
        set_state_p.bind(*batch_first(axis_size, vals, dims), meta=_batched_meta(meta))
    return vals, dims


_jax_rules.register_batching_rule(get_state_p, _get_batch)
_jax_rules.register_batching_rule(set_state_p, _set_batch)


def _remat_partial_eval(saveable, unks_in, inst_in, eqn):
    # Under `jax.checkpoint`'s partial evaluation, a read or a write with known inputs happens
    # once, in the forward pass: the backward pass reuses what it read, and sets nothing again.
    return _jax_rules.remat_split(eqn, inst_in, unknown=any(unks_in))


_jax_rules.register_remat_partial_eval_rule(get_state_p, _remat_partial_eval)
# Under `grad` of a `scan`, reads and writes of state stay in the loop (not hoisted before it).
_staging.register_kept_in_loops(get_state_p)
_staging.register_kept_in_loops(set_state_p)
_jax_rules.register_remat_partial_eval_rule(set_state_p, _remat_partial_eval)

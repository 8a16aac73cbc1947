"""What statax knows of equinox's private machinery (equinox 0.13, `equinox.internal`).

equinox is a core dependency, and its loops, filter primitives and `noinline` carry marks in
ways no public API shows. Everything that reads equinox's private names is here, so that an
equinox release costs one module: JAX's own internals are in `_compat`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from . import _compat

__all__ = [
    "equinox_noinline",
    "impl_of",
    "is_bounded_step",
    "is_equinox_primitive",
    "loop_running",
    "select_if_vmap",
]


def impl_of(eqn: jex.JaxprEqn) -> Callable | None:
    """For an equinox `vprim`, the impl its lowering and derived batching rule use (lineax
    rebinds the public `impl` to one that refuses batching); else `None`."""
    return _vprim_impls().get(eqn.primitive)


def equinox_noinline() -> tuple[jex.Primitive, Callable]:
    """`(noinline_p, fn_of(eqn))` for `eqx.internal.noinline`: `fn_of(eqn)` rebuilds the
    Python function a `noinline` equation calls, as `f(*dynamic_inputs) -> flat outputs`, or
    gives `None` where the call is a JVP or transpose of another (whose marks count there).
    Written against equinox 0.13 (`equinox.internal._noinline`, `_primitive`)."""
    from equinox.internal import _noinline, _primitive

    def fn_of(eqn):
        index = eqn.invars[0]
        if not isinstance(index, jex.Literal):
            return None  # a batched index: several functions, none of them known here
        static, treedef = eqn.params["static"], eqn.params["treedef"]
        transforms = jax.tree_util.tree_unflatten(treedef, static)[2]
        if any(
            t is _noinline._jvp_transform or isinstance(t, _noinline._MetaTransposeTransform)
            for t in transforms
        ):
            return None  # a derivative's call: its marks are the primal call's, seen there

        def call(*dynamic):
            it = iter(dynamic)
            flat = [next(it) if x is _primitive._missing_dynamic else x for x in static]
            _, _, transforms, args = jax.tree_util.tree_unflatten(treedef, flat)
            fn = _noinline._index_to_fn[int(index.val)]
            for transform in transforms:
                fn = transform(fn)
            return jax.tree_util.tree_leaves(fn(args))

        return call

    return _noinline.noinline_p, fn_of


@functools.cache
def _vprim_impls() -> dict:
    """equinox's registry of vprims and their impls (one dict, filled as vprims are made)."""
    from equinox.internal import _primitive

    return _primitive._vprim_impl_registry


def is_equinox_primitive(eqn: jex.JaxprEqn) -> bool:
    """Whether `eqn` is of an equinox filter primitive or `vprim` (`equinox.internal`), such
    as lineax's `linear_solve`: its impl is Python, its lowering `mlir.lower_fun(impl)`, and
    its functions live in the `static` param (equinox 0.13, `equinox.internal._primitive`)."""
    flatten = eqn.params.get("flatten")
    if flatten is not None:
        from equinox.internal import _primitive

        return isinstance(flatten, _primitive.Flatten)
    return eqn.primitive in _vprim_impls()


def is_bounded_step(body: jex.ClosedJaxpr, init: Sequence[Any]) -> bool:
    """Whether a `scan` with this body and initial carry is a level of an
    `eqx.internal.while_loop(kind="bounded")`: nested scans of `cond(cond_fun(val), ...)`
    over equinox's loop carry `(step, pred, prev_pred, *state)` (see
    `loop_running`), whose `cond_fun` calls `unvmap_any`. Differentiated (`pull(grad(f))`),
    the loop is JAX's forward pass of it, whose dead-code elimination may drop `prev_pred`:
    `(step, pred)` is what the loop needs to know which steps ran, and what it checks."""
    return _loop_carry(init, prev=False) and _calls(body.jaxpr, "unvmap_any")


def _loop_carry(init: Sequence[Any], prev: bool = True) -> bool:
    """Whether `init` starts with equinox's `(step, pred, prev_pred)` (`prev=False`: with
    `(step, pred)`)."""
    if len(init) < 2 + prev:
        return False
    step, *flags = init[: 2 + prev]  # values or their types: both have a shape and a dtype
    flags_ok = all(a.shape == () and a.dtype == jnp.bool_ for a in flags)
    return flags_ok and step.shape == () and jnp.issubdtype(step.dtype, jnp.integer)


def _calls(jaxpr: jex.Jaxpr, name: str) -> bool:
    """Whether `jaxpr` binds the primitive called `name`, at any depth."""
    return any(eqn.primitive.name == name for eqn in _compat.equations(jaxpr))


def loop_running(cond_jaxpr: jex.ClosedJaxpr, init: Sequence[Any]) -> int | None:
    """For the `while` of an `eqx.internal.while_loop` (any kind but "bounded"), the index in
    its carry of equinox's per-example "still running" flag; else `None`.

    equinox rewrites a loop to carry `(step, pred, prev_pred, *state)` and to stop on
    `unvmap_any(pred)`, so that under `vmap` every example runs until all are done, and the
    body masks the state with `pred` itself (equinox 0.13, `equinox.internal._loop.common`)."""
    if _loop_carry(init) and _calls(cond_jaxpr.jaxpr, "unvmap_any"):
        return 1
    return None


def select_if_vmap(pred: Any, new: Any, old: Any) -> Any:
    """equinox's own masking of its loop state: `new` where the example is running, else `old`;
    a plain `new` when nothing is batched (then `pred` is true wherever the body runs), so an
    unbatched loop pays nothing (equinox 0.13, `equinox.internal._loop.common`)."""
    from equinox.internal._loop import common

    return common._select_if_vmap(pred, new, old, makes_false_steps=False)

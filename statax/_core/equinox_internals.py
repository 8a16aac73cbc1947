"""What statax knows of equinox's private machinery (equinox 0.13, `equinox.internal`).

equinox is a core dependency, and its loops, filter primitives and `noinline` carry marks in
ways no public API shows. Everything that reads equinox's private names is here, so that an
equinox release costs one module: JAX's own internals are in `_compat`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex

__all__ = ["equinox_noinline", "impl_of", "is_equinox_primitive", "select_if_vmap"]


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


def select_if_vmap(pred: Any, new: Any, old: Any) -> Any:
    """equinox's own masking of its loop state: `new` where the example is running, else `old`;
    a plain `new` when nothing is batched (then `pred` is true wherever the body runs), so an
    unbatched loop pays nothing (equinox 0.13, `equinox.internal._loop.common`)."""
    from equinox.internal._loop import common

    return common._select_if_vmap(pred, new, old, makes_false_steps=False)

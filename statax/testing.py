"""Helpers for testing statax handlers and checking that marks cost nothing.

`check_pull` runs a function under `pull` composed with `jit`, `vmap`, `grad` and equinox's
filtered transforms, in both orders, against a hand-written reference that returns the same
intermediates explicitly. `hlo_ops` gives the optimised HLO instructions of a jitted function,
without names and source metadata, to compare programs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._drivers.pull import pull

__all__ = ["assert_tree_allclose", "check_pull", "hlo_ops"]

_METADATA = re.compile(r", metadata=\{[^}]*\}")
_NAME = re.compile(r"%[\w.\-]+")


def hlo_ops(fn: Callable, *args: Any, optimized: bool = True) -> list[str]:
    """The instructions of `jax.jit(fn)`'s HLO, names and source metadata removed.

    Two functions that compile to the same program give equal lists; `len` counts the ops.
    """
    lowered = jax.jit(fn).lower(*args)
    text = lowered.compile().as_text() if optimized else lowered.as_text(dialect="hlo")
    ops = []
    for line in text.splitlines():
        line = line.strip()
        if " = " not in line or line.startswith(("HloModule", "ENTRY")):
            continue
        ops.append(_NAME.sub("%_", _METADATA.sub("", line)))
    return ops


def assert_tree_allclose(
    actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Same structure, same keys, values equal within tolerance (shapes and dtypes too)."""
    a_leaves, a_def = jax.tree_util.tree_flatten(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    if a_def != e_def:
        raise AssertionError(f"structures differ:\n  got      {a_def}\n  expected {e_def}")
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if eqx.is_array_like(e) and not isinstance(e, str):
            a_arr, e_arr = np.asarray(a), np.asarray(e)
            if a_arr.shape != e_arr.shape:
                raise AssertionError(f"shapes differ: {a_arr.shape} vs {e_arr.shape}")
            np.testing.assert_allclose(a_arr, e_arr, rtol=rtol, atol=atol)
        elif a != e:
            raise AssertionError(f"leaves differ: {a!r} vs {e!r}")


def _other(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return ~x
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x + 1
    return x * 0.5 + 0.25


def _stack(args):
    """A batch of two different copies of `args`, for `vmap` (booleans flipped, integers
    incremented, floats scaled and shifted)."""
    return jax.tree_util.tree_map(lambda x: jnp.stack([x, _other(x)]), args)


def plain(f: Callable) -> Callable:
    """No transformation: `check_pull`'s "plain"."""
    return f


# Each transformation `check_pull` knows, by its name: what it does to the reference ("same"
# output, "batched" over two examples, or a "derivative" of it) and the transformation itself.
_TRANSFORMS = {
    t.__name__: (kind, t)
    for kind, ts in (
        ("same", (plain, jax.jit, eqx.filter_jit)),
        ("batched", (jax.vmap, eqx.filter_vmap)),
        ("derivative", (jax.grad, jax.jacfwd, jax.jacrev, eqx.filter_grad)),
    )
    for t in ts
}
# The derivative of the reference for each derivative transformation (equinox's filter_grad
# differentiates the first argument, as jax.grad does).
_DERIVATIVES = {"filter_grad": jax.grad} | {
    t.__name__: t for t in (jax.grad, jax.jacfwd, jax.jacrev)
}


def check_pull(
    fn: Callable,
    reference: Callable,
    *args: Any,
    transforms: tuple[str, ...] = tuple(_TRANSFORMS),
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Check `pull(fn)` against `reference`, which returns `(out, intermediates)` by hand.

    For each transform `T` checks both `pull(T(fn))` and `T(pull(fn))` (with `has_aux=True`
    for the differentiating ones) against the reference under `T`. Differentiation takes
    the gradient of a scalar output with respect to the first argument; under an inner
    derivative the intermediates are the primal values.

    `transforms` names them, among "plain", "jit", "filter_jit", "vmap", "filter_vmap",
    "grad", "jacfwd", "jacrev" and "filter_grad" (the default: all of them).
    """
    unknown = sorted(set(transforms) - set(_TRANSFORMS))
    if unknown:
        raise ValueError(f"check_pull knows no transform {unknown}; it knows {list(_TRANSFORMS)}")

    def expect(name):
        kind, _ = _TRANSFORMS[name]
        if kind == "same":
            return reference(*args)
        if kind == "batched":
            return jax.vmap(reference)(*_stack(args))
        return _DERIVATIVES[name](reference, has_aux=True)(*args)

    def inputs(name):
        return _stack(args) if _TRANSFORMS[name][0] == "batched" else args

    def inner(name):
        return _TRANSFORMS[name][1]

    def outer(name):
        transform = _TRANSFORMS[name][1]
        if _TRANSFORMS[name][0] == "derivative":
            return lambda f: transform(f, has_aux=True)
        return transform

    for name in transforms:
        expected = expect(name)
        for order, got in (
            (f"pull({name}(f))", lambda: pull(inner(name)(fn))(*inputs(name))),
            (f"{name}(pull(f))", lambda: outer(name)(pull(fn))(*inputs(name))),
        ):
            try:
                assert_tree_allclose(got(), expected, rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(f"{order}: {e}") from None

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

from ._pull import pull

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


def check_pull(
    fn: Callable,
    reference: Callable,
    *args: Any,
    transforms: tuple[str, ...] = (
        "plain",
        "jit",
        "vmap",
        "grad",
        "jacfwd",
        "jacrev",
        "filter_jit",
        "filter_vmap",
        "filter_grad",
    ),
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Check `pull(fn)` against `reference`, which returns `(out, intermediates)` by hand.

    For each transform `T` checks both `pull(T(fn))` and `T(pull(fn))` (with `has_aux=True`
    for the differentiating ones) against the reference under `T`. Differentiation takes
    the gradient of a scalar output with respect to the first argument; under an inner
    derivative the intermediates are the primal values.
    """

    def expect(name):
        if name in ("plain", "jit", "filter_jit"):
            return reference(*args)
        if name in ("vmap", "filter_vmap"):
            return jax.vmap(reference)(*_stack(args))
        d = {"grad": jax.grad, "filter_grad": jax.grad, "jacfwd": jax.jacfwd, "jacrev": jax.jacrev}[
            name
        ]
        return d(reference, has_aux=True)(*args)

    def inputs(name):
        return _stack(args) if name in ("vmap", "filter_vmap") else args

    inner = {
        "plain": lambda f: f,
        "jit": jax.jit,
        "vmap": jax.vmap,
        "grad": jax.grad,
        "jacfwd": jax.jacfwd,
        "jacrev": jax.jacrev,
        "filter_jit": eqx.filter_jit,
        "filter_vmap": eqx.filter_vmap,
        "filter_grad": eqx.filter_grad,
    }
    outer = {
        "plain": lambda f: f,
        "jit": jax.jit,
        "vmap": jax.vmap,
        "grad": lambda f: jax.grad(f, has_aux=True),
        "jacfwd": lambda f: jax.jacfwd(f, has_aux=True),
        "jacrev": lambda f: jax.jacrev(f, has_aux=True),
        "filter_jit": eqx.filter_jit,
        "filter_vmap": eqx.filter_vmap,
        "filter_grad": lambda f: eqx.filter_grad(f, has_aux=True),
    }
    for name in transforms:
        expected = expect(name)
        for order, got in (
            (f"pull({name}(f))", lambda: pull(inner[name](fn))(*inputs(name))),
            (f"{name}(pull(f))", lambda: outer[name](pull(fn))(*inputs(name))),
        ):
            try:
                assert_tree_allclose(got(), expected, rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(f"{order}: {e}") from None

"""Which primitives run Python code of their own (an equinox filter primitive's functions, a
lineax operator's matvec), which no jaxpr shows: `pull` and `stateful` trace their impl to see
it. Written against JAX 0.8 -- 0.12 (`dispatch.apply_primitive`, the impl JAX gives a primitive
it compiles itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from jax._src import dispatch  # isort: skip


__all__ = ["run_impl", "runs_python"]


def runs_python(eqn: jex.JaxprEqn) -> bool:
    """Whether `eqn`'s primitive may run Python code from its params when it is evaluated or
    lowered: its impl is its own Python function (not JAX's `apply_primitive`, which compiles
    the primitive itself), and its params hold a callable that is not a jaxpr. Such code (an
    equinox filter primitive's rule, a lineax operator's matvec) holds marks that no jaxpr
    shows. A handler module that knows better says so (its record's `runs_python`,
    by name where JAX keeps the primitive private: `handlers/callbacks.py` does for host
    callbacks and JAX's PRNG primitives)."""
    impl = eqn.primitive.impl
    if impl is None:
        return False
    if isinstance(impl, functools.partial) and impl.func is dispatch.apply_primitive:
        return False
    return any(_holds_callable(v) for v in eqn.params.values())


# Callable objects in params that are not code (a `jit` equation's `ctx_mesh` is a `Mesh`,
# which is callable).
_NOT_CODE = (
    type,
    jex.Primitive,
    jex.Jaxpr,
    jex.ClosedJaxpr,
    jax.sharding.Mesh,
    jax.sharding.AbstractMesh,
)


def _holds_callable(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_callable(v) for v in value)
    return callable(value) and not isinstance(value, _NOT_CODE)


def run_impl(eqn: jex.JaxprEqn, args: Sequence[Any], impl: Callable | None = None) -> list:
    """Run `eqn`'s primitive's impl rule (or `impl`, one of its kind) on `args`, as its
    lowering does for a primitive whose lowering is `mlir.lower_fun(impl)`."""
    return list((impl or eqn.primitive.impl)(*args, **eqn.params))

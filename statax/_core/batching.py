"""The one owner of statax's batching rules for JAX's primitives.

A primitive's record (`registry.Rules`) says what statax adds to its batching: an exposer runs,
under `vmap`, in place of JAX's own batching rule where its jaxprs hold marks; a guard runs
before it is batched; a stacking loop is counted while it is batched. JAX's own rule is given
back when the record goes or needs none. Leans on `jax._src.core`'s
`mapped_aval` and `jax._src.interpreters.batching.batch_jaxpr2` (`batch_traced`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from jax._src import core  # isort: skip


from jax._src.interpreters import batching  # isort: skip


from .._jax import jaxprs as _jaxprs
from .._jax import tracing as _tracing
from .._jax.jaxprs import trace
from . import context as _context
from . import cotangents as _cotangents
from .marks import find_saves
from .registry import on_change, rules_of

__all__ = ["batch_traced"]


def batch_traced(fn: Callable, axis_data: Any, args: Sequence, dims: Sequence) -> tuple:
    """Inside a batching rule: `fn` traced per example and batched with JAX's own rules, applied
    to `args` (batched along `dims`); returns `(outs, out_dims)`."""
    in_avals = [
        core.mapped_aval(axis_data.size, d, jax.typeof(x)) if d is not None else jax.typeof(x)
        for x, d in zip(args, dims, strict=True)
    ]
    closed = trace(fn, in_avals, name="statax_batched")
    batched, out_dims = batching.batch_jaxpr2(closed, axis_data, tuple(dims))
    return jex.jaxpr_as_fun(batched)(*args), list(out_dims)


# JAX's own batching rule of each primitive whose record (`Rules.batches`) has statax's rule
# stand in for it: given back when the record goes, or no longer needs it.
_ORIGINAL: dict[jex.Primitive, Callable | None] = {}


def _install(primitive) -> None:
    """Install statax's batching rule for `primitive` where its record needs one (an exposer, a
    guard, a stacking loop), and give JAX's own back where it no longer does."""
    if not isinstance(primitive, jex.Primitive):
        return  # (a record kept by name: a primitive with no handler)
    if not rules_of(primitive).batches:
        if primitive in _ORIGINAL:
            _tracing.set_batching_rule(primitive, _ORIGINAL.pop(primitive))
        return
    if primitive in _ORIGINAL:
        return  # (the rule reads the record each time)
    original = _ORIGINAL[primitive] = _tracing.batching_rule(primitive)

    def rule(axis_data, args, dims, **params):
        rules = rules_of(primitive)
        if rules.batching_guard is not None:
            rules.batching_guard(axis_data, dims, params)
        exposer = rules.exposer
        if exposer is None or not _params_hold_marks(params):
            if not rules.stacking:
                return original(axis_data, args, dims, **params)
            with _cotangents.loop_batched():
                return original(axis_data, args, dims, **params)
        with _cotangents.kept():  # (their marks' cotangents are read where used)
            return batch_traced(lambda *a: exposer(*a, **params), axis_data, args, dims)

    _tracing.set_batching_rule(primitive, rule)


on_change(_install)


def _params_hold_marks(params: dict) -> bool:
    # Only while a `pull` traces: outside one, marks are plain identities, and JAX's own
    # batching rule is the cheapest.
    return bool(_context.PULLING.value) and any(
        find_saves(sub) for sub in _jaxprs.jaxprs_in_params(params)
    )

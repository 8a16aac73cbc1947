"""The one owner of statax's batching rules for JAX's primitives.

An exposer (`register_exposer`) runs, under `vmap`, in place of JAX's own batching rule for a
primitive whose jaxprs hold marks, and guards (`register_batching_guard`) run before it is
batched. JAX's own rule is given back when neither is left. Leans on `jax._src.core`'s
`mapped_aval` and `jax._src.interpreters.batching.batch_jaxpr2` (`batch_traced`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from jax._src import core  # isort: skip


from jax._src.interpreters import batching  # isort: skip


import dataclasses

from .._jax import jaxprs as _jaxprs
from .._jax import tracing as _tracing
from .._jax.jaxprs import trace
from . import context as _context
from . import cotangents as _cotangents
from .marks import find_saves
from .registry import Exposer, on_unregister

__all__ = ["batch_traced", "register_stacking"]


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


# The one owner of statax's batching rules for JAX's primitives: primitive -> _Batching. An
# exposer (`register_exposer`) and guards (`register_batching_guard`) share one rule, installed
# once and JAX's own given back when neither is left.
_BATCHING: dict[jex.Primitive, _Batching] = {}


# The loops that stack what their bodies mark (`register_stacking`).
_STACKING: set = set()


def register_stacking(primitive: jex.Primitive) -> None:
    """Declare `primitive` a loop that stacks its body's marks, one row per iteration (as
    `scan`): `_cotangents.loops_batched` counts it while JAX batches it."""
    _STACKING.add(primitive)
    batching_entry(primitive)


def register_batching_guard(primitive: jex.Primitive, guard: Callable) -> None:
    """Run `guard(axis_data, dims, params)` before `primitive` is batched (it raises where the
    batching would be wrong), whatever else batches it. Kept by `unregister_handler`."""
    batching_entry(primitive).guards.append(guard)


@dataclasses.dataclass
class _Batching:
    original: Callable | None  # JAX's own rule
    exposer: Exposer | None = None
    guards: list = dataclasses.field(default_factory=list)


def batching_entry(primitive: jex.Primitive) -> _Batching:
    entry = _BATCHING.get(primitive)
    if entry is None:
        entry = _BATCHING[primitive] = _Batching(_tracing.batching_rule(primitive))

        def rule(axis_data, args, dims, **params):
            for guard in entry.guards:
                guard(axis_data, dims, params)
            exposer = entry.exposer
            if exposer is None or not _params_hold_marks(params):
                if primitive not in _STACKING:
                    return entry.original(axis_data, args, dims, **params)
                with _cotangents.loop_batched():
                    return entry.original(axis_data, args, dims, **params)
            with _cotangents.kept():  # (their marks' cotangents are read where used)
                return batch_traced(lambda *a: exposer(*a, **params), axis_data, args, dims)

        _tracing.set_batching_rule(primitive, rule)
    return entry


def _settle_batching(primitive: jex.Primitive) -> None:
    """Give JAX its own batching rule back where statax has nothing left to add."""
    entry = _BATCHING[primitive]
    if entry.exposer is None and not entry.guards:
        _tracing.set_batching_rule(primitive, _BATCHING.pop(primitive).original)


def _params_hold_marks(params: dict) -> bool:
    # Only while a `pull` traces: outside one, marks are plain identities, and JAX's own
    # batching rule is the cheapest.
    return bool(_context.PULLING.value) and any(
        find_saves(sub) for sub in _jaxprs.jaxprs_in_params(params)
    )


def _unregistered(primitive: jex.Primitive) -> None:
    if primitive in _BATCHING:  # its exposer goes with its handler; JAX's rule comes back
        _BATCHING[primitive].exposer = None
        _settle_batching(primitive)


on_unregister(_unregistered)

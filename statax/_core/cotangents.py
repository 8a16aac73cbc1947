"""The backward pass at a mark: `pull(fn, cotangents=True)` and `plant` of a cotangent.

While a `pull(fn, cotangents=True)` traces, a mark that is differentiated (its JVP runs: a
`jax.grad`, `jax.vjp`, `value_and_grad` inside `fn`) passes its tangents through a *tap*,
`cotangent_tap_p`: the identity, and linear. Transposed, the tap marks the cotangent that flows
back through it, as a `save_inter` at that place in the backward pass would, so it is collected
where the backward pass runs: stacked per iteration in a `scan`'s transpose, per example under
`vmap`, once under `jax.checkpoint` (the tap is in the linear part, which is transposed once).
A planted cotangent is replaced there too, so the gradients upstream of it change exactly as
a `custom_vjp` identity that changed its cotangent would change them.

The forward mark and its tap share a number (`StateMeta.tap`), so that the cotangent is keyed
after the value: `"h_0"` and `"h_0.grad"`. Outside such a `pull`, or where nothing reads the
tap, there is no tap: a mark's JVP passes its tangents on untouched, as it always did.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
from collections.abc import Callable

import jax
from jax.extend import core as jex

from .._jax import tracing as _tracing
from . import context as _context
from . import jax_rules as _jax_rules
from .meta import StateMeta

__all__ = [
    "cotangent_tap_p",
    "keeping",
    "kept",
    "loop_batched",
    "loops_batched",
    "number",
    "on_transpose",
    "tap",
    "tapped",
    "taps",
]

cotangent_tap_p = jex.Primitive("cotangent_tap")
cotangent_tap_p.multiple_results = True

_NUMBERS = itertools.count(1)
_MARK: list[Callable] = []  # what marks a cotangent (`primitive._mark_cotangent`)


def on_transpose(mark: Callable[[StateMeta, list], list]) -> None:
    """Have the tap's transpose call `mark(meta, cotangents) -> cotangents` (the cotangents as
    planted, once collected)."""
    _MARK[:] = [mark]


def taps(meta: StateMeta, status: str, collecting: str) -> bool:
    """Whether a mark's JVP taps its tangents: inside a `pull(fn, cotangents=True)`, for a mark
    that is collected (not inert, not idle), occurrence by occurrence (not `reduce=`), and not
    tapped where its value is used already (`meta.tap`: see `kept`)."""
    return (
        _context.COTANGENTS.value
        and status == collecting
        and meta.reduce is None
        and meta.tap is None
    )


# Whether the walk keeps a tap where it takes a mark out (`kept`).
_KEEP: contextvars.ContextVar[bool] = contextvars.ContextVar("statax_keep_taps", default=False)


def kept():
    """Within, in a `pull(fn, cotangents=True)`, the walk that takes a mark out of a jaxpr
    leaves a tap in its place (`save_inter` with status `"tapping"`, numbered as the value it
    exposes): for the exposers that take marks out of a loop or a branch under `vmap`, before
    anything differentiates them. The value leaves the loop, but the cotangent flows back
    where the value is used, inside it, and is read there."""
    return _context.within(_KEEP, bool(_context.COTANGENTS.value))


def keeping() -> bool:
    """Whether the walk leaves taps where it takes marks out (see `kept`)."""
    return _KEEP.get()


# How many stacking loops (`Rules.stacking`) `vmap` is batching now, one inside
# another: for a tap left in a loop, how many loops inside the `vmap` stack its cotangent.
_LOOPS_BATCHED: contextvars.ContextVar[int] = contextvars.ContextVar(
    "statax_loops_batched", default=0
)


def loop_batched():
    """Within, one more stacking loop is being batched (statax's batching rule for it)."""
    return _context.within(_LOOPS_BATCHED, _LOOPS_BATCHED.get() + 1)


def loops_batched() -> int:
    """How many stacking loops `vmap` is batching now, one inside another: in a batching rule,
    how many loops inside the `vmap` enclose the equation batched."""
    return _LOOPS_BATCHED.get()


def tapped(meta: StateMeta, tangents: list) -> tuple[StateMeta, list]:
    """In a mark's JVP: `(forward meta, tangents out)`, the forward mark's meta numbered, and
    its tangents through a tap that marks their cotangent. Where a tangent is a symbolic zero
    or of an integer value (`float0`), the tangents pass untouched."""
    n = number()
    out = tap(meta, n, tangents)
    return (meta, out) if out is tangents else (dataclasses.replace(meta, tap=n), out)


def number() -> int:
    """A fresh number for a mark and its tap."""
    return next(_NUMBERS)


def tap(meta: StateMeta, n: int, tangents: list) -> list:
    """`tangents` through the tap numbered `n` of the mark `meta`. A mark's flag that it ran
    (`pull(fn, ran=True)`: a boolean after its values) is no value of it: it passes by."""
    if meta.flagged and tangents:
        values = tangents[:-1]
        out = tap(dataclasses.replace(meta, flagged=False), n, values)
        return tangents if out is values else [*out, tangents[-1]]
    if not tangents or any(_skipped(t) for t in tangents):
        return tangents
    site = tuple(tuple(t.shape[meta.batch_ndim :]) for t in tangents)
    grad = dataclasses.replace(meta, tap=n, grad=True, site=site)
    return cotangent_tap_p.bind(*tangents, meta=grad)


def _skipped(tangent) -> bool:
    if _tracing.is_symbolic_zero(tangent):
        return True
    return jax.dtypes.result_type(tangent) == jax.dtypes.float0


@cotangent_tap_p.def_impl
def _impl(*xs, meta):
    return list(xs)


@cotangent_tap_p.def_abstract_eval
def _abstract_eval(*avals, meta):
    return list(avals)


_jax_rules.register_lowering_identity(cotangent_tap_p, lambda params: False)


def _jvp(primals, tangents, *, meta):  # (a tangent of a tangent: passed on, not tapped again)
    return cotangent_tap_p.bind(*primals, meta=meta), list(tangents)


_jax_rules.register_jvp_rule(cotangent_tap_p, _jvp)


def _transpose(cts, *args, meta):
    cts = [_tracing.instantiate(ct, arg) for ct, arg in zip(cts, args, strict=True)]
    return list(_MARK[0](meta, cts))


_jax_rules.register_transpose_rule(cotangent_tap_p, _transpose)


def _batch(axis_size, vals, dims, *, meta):
    return cotangent_tap_p.bind(*vals, meta=meta), list(dims)


_jax_rules.register_batching_rule(cotangent_tap_p, _batch)

"""`save_inter_p`, the identity primitive that marks a value, and all of its rules.

Without `pull`, `save_inter_p` is the identity and costs nothing once compiled: it lowers to no
op, its JVP saves the primal and passes tangents through, it transposes to the identity, and
under `vmap` it hands its operands on untouched (the batch axis is moved to 0 only on the copy
that is saved). Three things keep a mark alive where JAX would otherwise lose or repeat it:

* while a `pull` traces it (`status="collecting"`) it carries `SaveEffect`, so that no dead-code
  elimination drops it, and `pull(grad(jit(f)))` still collects a value nobody reads;
* outside a `pull` (`status="idle"`) it has no effect and no outputs: staged into a jaxpr, it
  is an equation that reads the value and defines nothing (the program reads on from the value
  itself), which is the least a mark can cost in a trace, lowers to nothing, and stays in the
  jaxpr through partial evaluation, and through dead-code elimination wherever the program
  reads the value anyway, so that a later `pull` of the jaxpr (equinox's `noinline`, a jaxpr
  built ahead of time) collects it; it keeps alive nothing JAX would drop, since libraries
  look at what dead-code elimination keeps (Flax's `nn.scan` does);
* `jax.checkpoint`'s partial evaluation keeps it in the forward pass and turns the copy that
  rematerialisation replays in the backward pass into an inert one (`status="inert"`), so that
  each value is collected once, not once per recomputation (an idle mark, which defines
  nothing, is not replayed at all).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._jax import tracing as _tracing
from . import context as _context
from . import cotangents as _cotangents
from . import fastpaths as _fastpaths
from . import jax_rules as _jax_rules
from . import staging as _staging
from .meta import ARRAY, NUMBERS, StateMeta, number_as_array, split
from .reduce import MODES
from .tracebacks import place

__all__ = [
    "COLLECTING",
    "IDLE",
    "INERT",
    "INPUT",
    "TAPPING",
    "UNPULLED",
    "batch_first",
    "collected",
    "save_inter",
    "save_inter_p",
]

# A mark's `status` param, one of three:
COLLECTING = "collecting"  # bound while a `pull` traces: carries SaveEffect; collected
IDLE = "idle"  # bound outside a `pull`: no effect, costs nothing; collected by a later pull_jaxpr
UNPULLED = "unpulled"  # as IDLE, on the plain path (fast paths off): an identity with outputs
INERT = "inert"  # never collected (not selected by `only=`; replayed by remat; a rule's copy)
INPUT = "input"  # a value fed in from outside (`_exposers.take`): never collected
TAPPING = "tapping"  # left where a mark was taken out (`_cotangents.kept`): taps, never collected

T = TypeVar("T")

save_inter_p = jex.Primitive("save_inter")
save_inter_p.multiple_results = True

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # statax/


def _caller() -> tuple:
    """`(code, line)` of the first frame outside statax (`(None, 0)` if none)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return (None, 0) if frame is None else (frame.f_code, frame.f_lineno)


def caller_location() -> str:
    """`"file:line"` of the first frame outside statax."""
    return _location(*_caller())


def _location(code, line: int) -> str:
    return "<unknown>" if code is None else place(code.co_filename, line)


def save_inter(value: T, name: str | None = None, *, reduce: str | None = None) -> T:
    """Mark `value` so that `statax.pull` returns it; the identity otherwise.

    Args:
        value: any pytree. Its array leaves (JAX and NumPy arrays, tracers) are saved; its
            other leaves (strings, `None`, callables, Python numbers, static fields of an
            `eqx.Module`) are returned unchanged, by `save_inter` and by `pull`.
        name: the name of the intermediate, `"state"` if not given, prefixed by the enclosing
            `statax.scope`s (`"encoder/attn"`). `pull` keys each occurrence
            `f"{name}_{n}"`, `n` counting from 0 in program order.
        reduce: combine every occurrence of `name` (call sites, loop iterations, branches)
            into one entry keyed `name`: `"stack"` (along a new leading axis), `"mean"`,
            `"sum"`, `"min"`, `"max"` (elementwise), `"first"`, `"last"`, or `"collect"`
            (ravel and concatenate). In a `scan` or `while_loop` the elementwise modes keep a
            running value and store nothing per iteration. All occurrences of a name must use
            the same mode.

    Returns:
        `value`, unchanged.

    Raises:
        TypeError: if `name` is not a string.
        ValueError: if `reduce` is not one of the modes above.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     y = stx.save_inter(2 * x, name="y")
        ...     return y + 1
        >>> stx.pull(f)(jnp.float32(1.0))
        (Array(3., dtype=float32), {'y_0': Array(2., dtype=float32)})
    """
    if type(value) is _STAGED_TRACER and _fastpaths.on:
        # The common cases, as cheap as they can be (every call counts, in a trace): one array,
        # staged into a jaxpr, at a call site seen before; no pull, or a pull at this level
        # that takes every mark as it is. (Names bound here, not looked up in `_compat`.)
        frame = _getframe(1)
        try:
            params = _SITES.get((id(frame.f_code), frame.f_lasti, name, reduce, _SCOPE.value))
        except TypeError:  # an unhashable name or mode: said below
            params = None
        if params is not None:
            if not _PULLING.value:
                if _observe_staged(save_inter_p, value, params):
                    return value
            elif (
                _context.PLANTING.value is None
                and _context.SELECTION.value is None
                and not _context.RAN_MASKS.value
            ):
                collector = _COLLECTOR.get()
                if _claims(collector):
                    collector.add(params["meta"], [value])
                    return value
    given_name = name
    if name is None:
        name = "state"
    if not isinstance(name, str):
        raise TypeError(
            f"save_inter(value, name=...) needs a string name, got {name!r} of type "
            f'{type(name).__name__} at {caller_location()}. Pass e.g. name="activation".'
        )
    if reduce is not None and reduce not in MODES:
        raise ValueError(
            f"save_inter(..., reduce={reduce!r}) at {caller_location()}: reduce must be one of "
            f"{', '.join(map(repr, MODES))}, or None to keep occurrences apart."
        )
    scope = _SCOPE.value
    name = scope + name
    if isinstance(value, jax.Array):  # one array, without flattening
        frame = _getframe(1)
        code = frame.f_code
        inside = code.co_filename.startswith(_PACKAGE_DIR)  # then the site is further out
        params = array_params(name, _caller() if inside else (code, frame.f_lineno), reduce)
        if not inside and _fastpaths.on:  # for the fast path above, next time
            _remember(code, frame.f_lasti, given_name, reduce, scope, params)
        arrays = [value]
        meta = params["meta"]
    else:
        treedef, static, arrays = split(value)
        meta = StateMeta(name, treedef, static, caller_location(), reduce=reduce)
    return _mark(value, meta, arrays)


def mark_as(value: T, name: str, location: str, reduce: str | None = None) -> T:
    """`save_inter(value, name=name, reduce=reduce)` made by statax itself, for a place that
    `location` (`"file:line"`) names: a selection's mark (`_select`). No scope prefix."""
    treedef, static, arrays = split(value)
    return _mark(value, StateMeta(name, treedef, static, location, reduce=reduce), arrays)


def _mark(value: T, meta: StateMeta, arrays: list) -> T:
    """What `save_inter` does with `value`, once its meta is made."""
    name, reduce = meta.name, meta.reduce
    if not _context.PULLING.value:
        outs = stage_mark(arrays, meta, IDLE)  # (an identity, `UNPULLED`, with fast paths off)
        return value if outs is arrays else meta.unflatten(outs)
    planting = _context.PLANTING.value  # `plant(fn)`: decided here, where bound
    if planting is not None and meta.planted_as in planting.names:
        if any(type(leaf) in NUMBERS for leaf in meta.static_leaves):
            # `pull` returns a Python number as it is; planted, it is a weakly typed array
            # (as `jax.jit` takes a Python number argument), so that it can take a value in.
            value = jax.tree_util.tree_map(number_as_array, value)
            treedef, static, arrays = split(value)
            meta = StateMeta(name, treedef, static, meta.location, reduce=reduce)
        if arrays:
            arrays = planting.plant(meta, arrays, value)
            value = meta.unflatten(arrays)
    status = COLLECTING
    selection = _context.SELECTION.value  # `pull(fn, only=...)`: decided here, where bound
    if selection is not None and not selection(meta):
        status = INERT
    if status == COLLECTING and meta.reduce is None and _context.RAN_MASKS.value and not meta.grad:
        # `pull(fn, ran=True)`: a boolean beside the value, true here; where this does not
        # run (a branch not taken), the handlers' zeros make it false.
        flagged = dataclasses.replace(meta, flagged=True)
        outs = _bind([*arrays, jnp.ones((), bool)], flagged, status)[: len(arrays)]
        same = all(a is b for a, b in zip(outs, arrays, strict=True))
        return value if same else meta.unflatten(outs)
    outs = _bind(arrays, meta, status)
    return value if outs is arrays else meta.unflatten(outs)


def _claims(collector: Collector | None) -> bool:
    """Whether `collector` takes the marks made now (those at its pull's own level)."""
    return collector is not None and collector.trace is _tracing.current_trace()


def _bind(arrays: list, meta: StateMeta, status: str) -> list:
    """`save_inter_p.bind`, or, for a mark made at the level of the `pull` that traces it,
    `arrays` themselves, handed to its `Collector` if it collects them (no equation: the walk
    would only have taken it out again, or dropped it, unselected)."""
    collector = _COLLECTOR.get()
    if status in (COLLECTING, INERT) and _claims(collector):
        if status == COLLECTING:
            collector.add(meta, arrays)
        return arrays
    return stage_mark(arrays, meta, status)


def stage_mark(arrays: list, meta: StateMeta, status: str) -> list:
    """`save_inter_p.bind`, staged directly where it can be (see `_staging.stage`). An idle mark
    defines nothing: it only reads `arrays`, which it returns (see `_staging.observe`), so that a
    mark costs one equation and no other work."""
    if status == IDLE and not _fastpaths.on:
        status = UNPULLED  # the plain path: an identity
    params = {"meta": meta, "status": status}
    if status == IDLE:
        if not _staging.observe(save_inter_p, arrays, params):
            save_inter_p.bind(*arrays, **params)
        return arrays
    if not _fastpaths.on:
        return save_inter_p.bind(*arrays, **params)
    effects = SAVE_EFFECTS if status == COLLECTING else _context.NO_EFFECTS
    outs = _staging.stage(save_inter_p, arrays, params, effects)
    return save_inter_p.bind(*arrays, **params) if outs is None else outs


SAVE_EFFECTS = frozenset({_context.SAVE_EFFECT})


@functools.lru_cache(maxsize=4096)
def array_params(name: str, site: tuple, reduce: str | None) -> dict:
    """The params of an idle mark on one array at `site` (`_caller()`), made once per site and
    name (equations share them: JAX never edits an equation's params in place); a collected
    mark there takes their meta."""
    meta = StateMeta(name, LEAF, _ONE_ARRAY, _location(*site), reduce=reduce)
    return {"meta": meta, "status": IDLE}


# (id of the calling code, its instruction, name, reduce, scope) -> `array_params` there, for
# the fast path of `save_inter`, which only looks up what the slow path checked and made.
_SITES: dict[tuple, dict] = {}
_SITE_CODES: dict[int, object] = {}  # id -> code object: no id in `_SITES` is reused


def _remember(code, instruction: int, name, reduce, scope: str, params: dict) -> None:
    if len(_SITES) >= 4096:
        _SITES.clear()
        _SITE_CODES.clear()
    _SITE_CODES[id(code)] = code
    _SITES[(id(code), instruction, name, reduce, scope)] = params


_getframe = sys._getframe
_STAGED_TRACER, _SCOPE, _PULLING = _staging.STAGED_TRACER, _context.SCOPE, _context.PULLING
_observe_staged = _staging.observe_staged

LEAF = jax.tree_util.tree_structure(0)
_ONE_ARRAY = (ARRAY,)


class Collector:
    """The marks a `pull` collects at its own level, in the trace of the function it pulls:
    `save_inter` hands them over as they are made (`collecting`), rather than binding
    `save_inter_p`, so that they cost what returning them by hand costs. Marks anywhere else
    (inside a `jit`, a loop body, a `vmap`, a derivative) are bound, and found by the walk.

    Attributes:
        trace: the pull's trace (set once it runs); marks made in any other go unclaimed.
        marks: `(position, meta)` per mark, in order, `position` being how many equations the
            trace held when it was made, so that the walk can put it among the marks it finds.
        leaves: the marks' array leaves, flat, in order.
    """

    __slots__ = ("leaves", "marks", "trace")

    def __init__(self):
        self.trace = None
        self.marks: list[tuple[int, StateMeta]] = []
        self.leaves: list = []

    def add(self, meta: StateMeta, arrays: list) -> None:
        self.marks.append((_staging.trace_length(self.trace), meta))
        self.leaves.extend(arrays)


_COLLECTOR: contextvars.ContextVar[Collector | None] = contextvars.ContextVar(
    "statax_collector", default=None
)


@contextlib.contextmanager
def collecting(collector: Collector):
    """Within, marks made at `collector.trace`'s level go to `collector`."""
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


def batch_first(axis_size: int, vals, dims) -> list:
    """In a batching rule: `vals` with their batch axes moved to 0, unbatched ones broadcast."""
    return [
        jnp.broadcast_to(v, (axis_size, *jnp.shape(v))) if d is None else jnp.moveaxis(v, d, 0)
        for v, d in zip(vals, dims, strict=True)
    ]


def _idle(params: dict) -> bool:
    """Whether a mark is idle: it only reads (it has no outputs; any other mark's are its
    operands), and a later `pull` of the jaxpr collects it, so that partial evaluation keeps
    it, and dead-code elimination where what it reads is live."""
    return params["status"] == IDLE


def _outputs(values: list, status: str) -> list:
    """What a rule returns for a mark's outputs, `values`: none for an idle one."""
    return [] if status == IDLE else values


def collected(params: dict) -> bool:
    """Whether a `pull_jaxpr` collects the mark with these params (before `only=`)."""
    return params["status"] in (COLLECTING, IDLE, UNPULLED)


# ---- rules ---------------------------------------------------------------------------------


@save_inter_p.def_impl
def _impl(*xs, meta, status):
    return _outputs(list(xs), status)


@save_inter_p.def_effectful_abstract_eval
def _abstract_eval(*avals, meta, status):  # (as `stage_mark` stages it)
    effects = SAVE_EFFECTS if status == COLLECTING else _context.NO_EFFECTS
    return _outputs(list(avals), status), effects


_jax_rules.register_lowering_identity(save_inter_p, _idle)


def _jvp(primals, tangents, *, meta, status):
    # Save the primal only; the tangents pass through untouched (or, in a
    # `pull(fn, cotangents=True)`, through a tap that marks their cotangent).
    tangents = list(tangents)
    if status == TAPPING:  # (the value is collected elsewhere, under the same number)
        return list(primals), _cotangents.tap(meta, meta.tap, tangents)
    if _cotangents.taps(meta, status, COLLECTING):
        meta, tangents = _cotangents.tapped(meta, tangents)
    return _outputs(_bind(list(primals), meta, status), status), _outputs(tangents, status)


_jax_rules.register_jvp_rule(save_inter_p, _jvp)


def _linearize(nonzeros, *primals, meta, status):
    # As the JVP, without JAX's generic linearization (a trace of the JVP per mark).
    if status == TAPPING:
        tapped = all(nonzeros)
        return (
            list(primals),
            list(nonzeros),
            lambda *t: _cotangents.tap(meta, meta.tap, list(t)) if tapped else list(t),
        )
    values = nonzeros[:-1] if meta.flagged else nonzeros  # (a flag that it ran is no value)
    if _cotangents.taps(meta, status, COLLECTING) and values and all(values):
        number = _cotangents.number()
        outs = _bind(list(primals), dataclasses.replace(meta, tap=number), status)
        return outs, list(nonzeros), lambda *t: _cotangents.tap(meta, number, list(t))
    outs = _outputs(_bind(list(primals), meta, status), status)
    return (
        outs,
        _outputs(list(nonzeros), status),
        lambda *tangents: _outputs(list(tangents), status),
    )


_tracing.register_linearization_rule(save_inter_p, _linearize)


def _mark_cotangent(meta: StateMeta, cts: list) -> list:
    """A cotangent marked where a tap transposes (`_core.cotangents`): collected, and planted
    under its key (`"h_0.grad"`)."""
    return split(_mark(meta.unflatten(cts), meta, cts))[2]


_cotangents.on_transpose(_mark_cotangent)


def _transpose(cts, *args, **params):
    # Only reached when a tangent itself is marked (e.g. in a custom JVP rule): it is linear
    # and the identity, so cotangents pass through. Nothing is saved for them. An idle mark
    # has no outputs: its operands get no cotangent from it.
    return [None] * len(args) if _idle(params) else list(cts)


_jax_rules.register_transpose_rule(save_inter_p, _transpose)


def _batch(axis_size, vals, dims, **params):
    # The values handed on keep their batch axes, so marking changes nothing downstream. The
    # copy that is saved has the batch axis at 0; where only some leaves are batched, the others
    # are broadcast so that one value is batched as a whole. A mark on unbatched values stays
    # unbatched (as `jacfwd`'s primal is). A value fed in from outside (`INPUT`) is per example:
    # it comes in with the batch axis at 0 (a cotangent's, only where its mark's is batched).
    # An unpulled mark on the plain path is an identity: the values handed on are its outputs.
    meta, status = params["meta"], params["status"]
    if status == TAPPING:  # (batched outside the loop its mark was taken out of)
        if all(d is None for d in dims):
            return _bind(list(vals), meta, status), list(dims)
        # (Its cotangent is stacked by the loops `vmap` is batching now, inside the `vmap`, which
        # then move its batch axis in front of theirs: see `StateMeta.moves`.)
        moves = meta.moves or (0,) * meta.batch_ndim
        batched = dataclasses.replace(
            meta, batch_ndim=meta.batch_ndim + 1, moves=(_cotangents.loops_batched(), *moves)
        )
        return _bind(batch_first(axis_size, vals, dims), batched, status), [0] * len(vals)
    fed = status == INPUT
    if (not fed or meta.grad) and all(d is None for d in dims):
        outs = _bind(list(vals), meta, status)
        if fed:  # (a cotangent planted for all examples, as its mark gives one)
            return outs, list(dims)
        return (outs if status == UNPULLED else _outputs(vals, status)), _outputs(dims, status)
    moved = batch_first(axis_size, vals, dims)
    outs = _bind(moved, dataclasses.replace(meta, batch_ndim=meta.batch_ndim + 1), status)
    if fed or status == UNPULLED or _cotangents.taps(meta, status, COLLECTING):
        # (In a `pull(fn, cotangents=True)`, the values go on through the mark, so that their
        # tangents go through its tap, batch axis first.)
        return outs, [0] * len(outs)
    return _outputs(vals, status), _outputs(dims, status)


_jax_rules.register_batching_rule(save_inter_p, _batch)


def _remat_partial_eval(saveable, unks_in, inst_in, eqn):
    # `jax.checkpoint`'s partial evaluation of a mark. With known inputs, it runs in the forward
    # ("known") pass as it is; the copy that rematerialisation replays in the backward
    # ("staged") pass is inert, so that the value is collected once. With unknown inputs it is
    # staged whole.
    if any(unks_in):
        return _jax_rules.remat_split(eqn, inst_in, unknown=True)
    if eqn.params["status"] == INPUT:  # a value fed in: kept for the backward pass, not rerun
        return _jax_rules.remat_split(eqn, inst_in, unknown=False)
    if _staging.defines_nothing(eqn):  # an idle mark that only reads: nothing to replay
        return _jax_rules.remat_split(eqn, inst_in, unknown=False)
    params = dict(eqn.params, status=INERT)
    _, effects = save_inter_p.abstract_eval(*[x.aval for x in eqn.invars], **params)
    staged = eqn.replace(params=params, effects=effects)
    return _jax_rules.remat_split(eqn, inst_in, unknown=False, replay=staged)


_jax_rules.register_remat_partial_eval_rule(save_inter_p, _remat_partial_eval)


_staging.register_readers(save_inter_p, _idle)

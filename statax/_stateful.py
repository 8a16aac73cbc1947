"""`stateful`, `get_state` and `set_state`: named state threaded through any function.

`get_state` and `set_state` bind two primitives, and only while `stateful` traces (outside one,
`get_state` returns its `init()` with a `StatefulWarning` and `set_state` returns its value).
`stateful` traces the function once per kind of argument and of state, then *threads* the
jaxpr: it evaluates it in a new trace, equation by equation, with an environment of the
current value of each name. A `set_state` replaces the value; a `get_state` reads it (or, for
a name that has none yet, returns its own `init()`, an operand of the equation). Equations
whose inner jaxprs touch no state are bound as they are; the others go to a rule per primitive
that rebuilds them with public JAX (`lax.scan`, `lax.while_loop`, `lax.switch`,
`jax.checkpoint`, `jax.shard_map`) around a function that threads their inner jaxprs:

* calls (`jit`, `closed_call`, custom derivatives) run inline, in the same environment;
* in a loop, every name the body sets is part of the carry; the others are read as they are;
* in a `cond`, every name some branch sets leaves it, from whichever branch ran (the others
  pass their value on);
* `jax.checkpoint` is rebuilt around the threaded function, so a recomputation updates nothing;
* in a `shard_map`, a name set inside becomes per-shard state, one row per shard.

Under `vmap` both primitives are batched with the batch axis first: a value set under a
`vmap` is per example, and a read under a `vmap` sees each example's value (an unbatched
value is broadcast).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.sharding import PartitionSpec

from . import _compat, _pull
from ._errors import StateError, StatefulWarning
from ._interpreter import inert, zero_tangent
from ._meta import ARRAY, StateMeta, number_as_array, split
from ._primitive import _caller_location, batch_first
from ._tracebacks import boundary

__all__ = ["get_state", "get_state_p", "set_state", "set_state_p", "stateful"]

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


def _split(value: Any, name: str, location: str) -> tuple[StateMeta, list]:
    treedef, static, arrays = split(value)
    return StateMeta(name, treedef, static, location), arrays


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"{what} needs a string name, got {name!r} of type {type(name).__name__} at "
            f'{_caller_location()}. Pass e.g. name="running_mean".'
        )
    return _compat.SCOPE.value + name


def _kind(meta: StateMeta, avals: Sequence) -> str:
    shapes = iter(f"{a.dtype}{list(a.shape)}" for a in avals)
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
    given = _compat.STATEFUL.value
    location = _caller_location()
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
    default = None if init is None else _split(init(), name, location)
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
            f"The state {given.name!r} passed in is {_kind(given, given_avals)}, but get_state at "
            f"{expected.location} expects {_kind(expected, expected_avals)} (what its init() "
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
    given = _compat.STATEFUL.value
    if given is None:
        return value
    meta, arrays = _split(value, name, _caller_location())
    given.set_kinds[name] = (meta, tuple(jax.typeof(x) for x in arrays))
    return meta.unflatten(set_state_p.bind(*arrays, meta=meta))


class _Stateful(eqx.Module):
    fn: Callable
    output_unchanged: bool = eqx.field(static=True)

    @boundary
    def __call__(self, *args, state: dict | None = None, **kwargs):
        return _call(self.fn, self.output_unchanged, args, kwargs, state)


def stateful(fn: Callable, output_unchanged: bool = False) -> Callable:
    """Transform `fn` to read and write named state with `get_state` and `set_state`.

    Args:
        fn: any callable, as for `pull` (its array arguments are traced, its other arguments
            static; a Python float passed directly is traced).
        output_unchanged: also return the names that are only read, with the value they were
            read with (passed in, or `init()`).

    Returns:
        `g(*args, state=None, **kwargs) -> (out, new_state)`. `state` is a dict of values by
        name (any pytrees; array leaves and Python numbers traced, as `jax.jit` traces them,
        others passed through; per-example state returned from under an inner `vmap` may be
        passed back). `new_state` holds the
        final value of every name that `fn` sets, in the order first set. The same shapes do
        not trace `fn` again. It composes with `jit`, `grad` (`has_aux=True` outside), `vmap`,
        `pull` and `plant`, in either order.

    Raises:
        StateError: a name in `state` that `fn` never reads or sets; a value of the wrong
            kind; a name that a `cond` branch or a `while_loop` sets with no value before it.
    """
    if not callable(fn):
        raise TypeError(f"stx.stateful needs a callable, got {fn!r} of type {type(fn).__name__}.")
    return _Stateful(fn, bool(output_unchanged))


# ---- calling ------------------------------------------------------------------------------


class _Entry(NamedTuple):
    jaxpr: jex.ClosedJaxpr  # (dynamic args, given state leaves) -> (outs, new state leaves)
    out_treedef: Any
    out_static: tuple
    num_out: int
    metas: tuple[StateMeta, ...]  # of new_state, in order


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call(fn, output_unchanged, args, kwargs, state):
    if state is None:
        state = {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError(f"stateful's state= takes a dict of values by name, got {state!r}.")
    specs, state_leaves = [], []
    for name in sorted(state):
        # A Python number is traced, as `jax.jit` traces a Python number argument: weakly
        # typed, so that it takes the type of what it meets, in every construct.
        value = jax.tree_util.tree_map(number_as_array, state[name])
        meta, arrays = _split(value, name, "state=")
        specs.append((name, meta, tuple(jax.typeof(x) for x in arrays)))
        state_leaves.extend(arrays)
    given = Given(tuple(specs))
    root, tree, call = _pull._split_callable(fn)
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
    traced, dynamic, key = _pull.arguments_key(leaves, treedef)
    key = (output_unchanged, given, *key)
    entry = _pull.lookup(root, key, _CACHE)
    if entry is None:
        entry = _trace(call, leaves, treedef, traced, given, state_leaves, output_unchanged)
        if not any(isinstance(c, jax.core.Tracer) for c in entry.jaxpr.consts):
            _pull.store(root, key, entry, _CACHE)
    # Outputs that are inputs or literals come back as arrays, as from `jax.jit`.
    flat = jex.jaxpr_as_fun(entry.jaxpr)(*dynamic, *state_leaves)
    flat = [
        x if isinstance(x, jax.Array) else jnp.asarray(x, None if a.weak_type else a.dtype)
        for x, a in zip(flat, entry.jaxpr.out_avals, strict=True)
    ]
    out = _pull.unflatten_out(entry, flat[: entry.num_out])
    new_state, start = {}, entry.num_out
    for meta in entry.metas:
        new_state[meta.name] = meta.unflatten(flat[start : start + meta.num_values])
        start += meta.num_values
    return out, new_state


def _trace(call, leaves, treedef, traced, given: Given, state_leaves, output_unchanged) -> _Entry:
    out_info: list = []
    flat_fn = _pull.flat_function(call, leaves, treedef, traced, out_info)
    dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]
    with _compat.STATEFUL(given):
        closed = jax.make_jaxpr(flat_fn)(*dynamic)
    names = _names(closed.jaxpr)
    unused = [n for n, _, _ in given.specs if n not in names.reads and n not in names.writes]
    if unused:
        used = sorted({*names.reads, *names.writes})
        raise StateError(
            f"State passed in that the function never reads or sets: {unused}. It uses "
            f"{used or 'no state'}. Remove the name from state=, or check its spelling."
        )
    metas: list[StateMeta] = []

    def threaded(*flat):
        args, rest = flat[: len(dynamic)], iter(flat[len(dynamic) :])
        env = {n: _Slot(meta, tuple(next(rest) for _ in avals)) for n, meta, avals in given.specs}
        log = _Log()
        outs = _run(closed.jaxpr, closed.consts, args, env, log)
        names_out = [n for n in log.set_order if n in env]
        if output_unchanged:
            for n in log.read_order:
                if n in names_out:
                    continue
                if n not in env and n not in log.top_defaults:
                    raise StateError(
                        f"output_unchanged=True cannot report the state {n!r}: it is only read, "
                        "first inside a loop or a branch, where its init() has no value outside. "
                        "Pass it in state=, or read it once outside the loop."
                    )
                names_out.append(n)
        slots = [env[n] if n in env else log.top_defaults[n] for n in names_out]
        metas[:] = [s.meta for s in slots]
        return [*outs, *(x for s in slots for x in s.leaves)]

    in_avals = [*map(jax.typeof, dynamic), *map(jax.typeof, state_leaves)]
    with _compat.STATEFUL(given):
        new = _compat.trace(threaded, in_avals, name="stateful")
    out_def, out_static = out_info[0]
    return _Entry(new, out_def, out_static, len(closed.jaxpr.outvars), tuple(metas))


# ---- the threading interpreter --------------------------------------------------------------


class _Slot(NamedTuple):
    """The current value of a name: its structure, its array leaves, and the manual mesh axes
    they are split over, one row per shard (set in a `shard_map`), or `()`."""

    meta: StateMeta
    leaves: tuple
    shards: tuple = ()


class _Log:
    """What a threading run saw, in program order."""

    def __init__(self):
        self.set_order: list[str] = []
        self.read_order: list[str] = []
        self.top_defaults: dict[str, _Slot] = {}  # read with no value, at depth 0: init()
        self.defaults: dict[str, _Slot] = {}  # the same at any depth (for a loop's first pass)
        self.depth = 0

    def set(self, name):
        if name not in self.set_order:
            self.set_order.append(name)

    def read(self, name):
        if name not in self.read_order:
            self.read_order.append(name)


class _Names(NamedTuple):
    reads: frozenset
    writes: dict  # name -> (StateMeta, avals) of the most batched set_state of it


_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _names(jaxpr) -> _Names:
    """The state names a jaxpr (at any depth) reads and sets."""
    if _compat.wraps_jaxpr(jaxpr):
        jaxpr = jaxpr.jaxpr
    found = _NAMES.get(jaxpr)
    if found is None:
        reads, writes = set(), {}
        for eqn in jaxpr.eqns:
            if eqn.primitive is get_state_p:
                reads.add(eqn.params["meta"].name)
            elif eqn.primitive is set_state_p:
                meta = eqn.params["meta"]
                old = writes.get(meta.name)
                if old is None or meta.batch_ndim >= old[0].batch_ndim:
                    writes[meta.name] = (meta, tuple(x.aval for x in eqn.invars))
            else:
                for sub in _compat.jaxprs_in_params(eqn.params):
                    inner = _names(sub)
                    reads |= inner.reads
                    for n, w in inner.writes.items():
                        if n not in writes or w[0].batch_ndim >= writes[n][0].batch_ndim:
                            writes[n] = w
        found = _NAMES[jaxpr] = _Names(frozenset(reads), writes)
    return found


def _holds_state(eqn) -> bool:
    return any(
        (lambda n: n.reads or n.writes)(_names(sub)) for sub in _compat.jaxprs_in_params(eqn.params)
    )


def _run(jaxpr, consts, args, env: dict, log: _Log) -> list:
    """Evaluate `jaxpr` in the current trace, threading `env` (name -> `_Slot`) through it."""
    values: dict = {}

    def read(x):
        return x.val if isinstance(x, jex.Literal) else values[x]

    values.update(zip(jaxpr.constvars, consts, strict=True))
    values.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(x) for x in eqn.invars]
        prim = eqn.primitive
        if prim is get_state_p:
            outs = _get(eqn.params["meta"], eqn.params["avals"], invals, env, log)
        elif prim is set_state_p:
            meta = eqn.params["meta"]
            env[meta.name] = _Slot(meta, tuple(invals))
            log.set(meta.name)
            outs = invals
        elif prim.name in _compat.VARY_PRIMITIVES:  # its operand may vary where it did not
            outs = _compat.rebind_vary(eqn, invals)
        elif not _holds_state(eqn):
            outs = _compat.bind(prim, invals, eqn.params)
            outs = outs if prim.multiple_results else [outs]
        else:
            rule = _RULES.get(prim)
            if rule is None:
                inner = [_names(sub) for sub in _compat.jaxprs_in_params(eqn.params)]
                used = sorted({n for i in inner for n in (*i.reads, *i.writes)})
                raise StateError(
                    f"stx.stateful cannot thread state through the primitive `{prim}`, which "
                    f"reads or sets {used}. Move the get_state/set_state out of it, or pass the "
                    "value in and out of it by hand."
                )
            with _compat.user_context(eqn):
                outs = rule(eqn, invals, env, log)
        values.update(zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars]


def _get(meta: StateMeta, avals, defaults, env, log) -> list:
    log.read(meta.name)
    slot = env.get(meta.name)
    if slot is None:  # no value yet: this read's own init()
        default = _Slot(meta, tuple(defaults))
        log.defaults.setdefault(meta.name, default)
        if log.depth == 0:
            log.top_defaults.setdefault(meta.name, default)
        return list(defaults)
    return _conform(slot, meta, avals, "read by get_state")


def _conform(slot: _Slot, meta: StateMeta, avals, what: str) -> list:
    """`slot`'s leaves as values of `meta`'s kind and `avals`, an unbatched value broadcast to
    the batch axes of `avals`; a `StateError` where they are of another kind."""
    ok = slot.meta.treedef == meta.treedef and slot.meta.static_leaves == meta.static_leaves
    out = []
    for x, aval in zip(slot.leaves, avals, strict=False):
        shape = jnp.shape(x)
        batched = len(aval.shape) - len(shape)
        if x.dtype != aval.dtype or batched < 0 or tuple(aval.shape[batched:]) != shape:
            ok = False
            break
        out.append(jnp.broadcast_to(x, aval.shape) if batched else x)
    if not ok:
        held = _kind(slot.meta, [jax.typeof(x) for x in slot.leaves])
        hint = (
            " A value set under a vmap (or passed in from one) is per example: read it inside a "
            "vmap, or apply the vmap outside stateful, jax.vmap(stx.stateful(f))."
            if any(len(jnp.shape(x)) > len(a.shape) for x, a in zip(slot.leaves, avals))
            else ""
        )
        raise StateError(
            f"The state {meta.name!r} holds {held} (from {slot.meta.location}), but is {what} at "
            f"{meta.location} as {_kind(meta, avals)}. A state keeps its structure, shapes and "
            f"dtypes.{hint}"
        )
    return out


# ---- rules: one per higher-order primitive ---------------------------------------------------

_RULES: dict[jex.Primitive, Callable] = {}


def _closed(jaxpr) -> tuple:
    """`(open_jaxpr, consts)` of a closed or an open jaxpr."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _inline(eqn, invals, env, log):
    # Calls (jit, closed_call; custom derivatives' primal, which then runs and is
    # differentiated as written): in the same trace and environment.
    if eqn.primitive is _compat.JIT_PRIMITIVE:
        inner = _compat.jit_jaxpr(eqn.params)
    elif eqn.primitive in (jex.primitives.custom_jvp_call_p, jex.primitives.custom_vjp_call_p):
        inner = _compat.custom_primal(eqn.params)
    else:
        inner = _compat.call_jaxpr(eqn.params)
    return _run(*_closed(inner), invals, env, log)


def _threaded(jaxpr, names: Sequence[str], env: dict, log: _Log, touched: dict) -> Callable:
    """`f(args, state) -> (outs, new_state)`: `jaxpr` threaded in a new trace (a loop body, a
    branch, a checkpointed or per-shard function). `state` holds the leaves of `names`; the
    other names of `env` are read as they are. `new_state` holds the leaves of each name in
    `touched` (name -> `(meta, avals)`, what it is set to), as values of that kind."""
    open_jaxpr, consts = _closed(jaxpr)

    def f(args, state):
        inner = dict(env)
        for n in names:
            inner[n] = inner[n]._replace(leaves=tuple(state[n]))
        log.depth += 1
        try:
            outs = _run(open_jaxpr, consts, list(args), inner, log)
        finally:
            log.depth -= 1
        new = {
            n: tuple(_conform(inner[n], meta, avals, "set")) for n, (meta, avals) in touched.items()
        }
        return list(outs), new

    return f


def _update(env: dict, new: dict, touched: dict, log: _Log, shards: tuple = ()) -> None:
    for n, leaves in new.items():
        env[n] = _Slot(touched[n][0], tuple(leaves), shards)
        log.set(n)


def _carried(writes: dict, env: dict, log: _Log, probe: Callable | None, loop: str) -> dict:
    """The initial value of each name a loop sets: its value before the loop (broadcast to the
    batch axes it gets inside); else, for a name the body reads before it sets it, what the
    first iteration reads (`probe()` runs the body once, its marks inert, to find out); else
    zeros, overwritten before they are read. In a while_loop, which may run no iteration, a
    name with no value before it is an error."""
    first = probe() if probe is not None and any(n not in env for n in writes) else {}
    init = {}
    for n, (meta, avals) in writes.items():
        if n in env:
            init[n] = _Slot(meta, tuple(_conform(env[n], meta, avals, "carried")))
        elif n in first:
            init[n] = _Slot(meta, tuple(_conform(first[n], meta, avals, "carried")))
        elif loop == "scan":
            init[n] = _Slot(meta, tuple(jnp.zeros(a.shape, a.dtype) for a in avals))
        else:
            raise StateError(
                f"The state {n!r} is set inside a {loop} (at {meta.location}) and has no value "
                "before it: were the loop to run no iteration, it would have none after. Give it "
                "one before the loop (set_state, state=, or get_state with init=)."
            )
    return init


def _probe(jaxpr, args, env, log) -> Callable:
    def probe():
        trial = _Log()
        trial.depth = log.depth
        _run(*_closed(inert(jaxpr)), args, dict(env), trial)
        return trial.defaults

    return probe


def _scan(eqn, invals, env, log):
    parts = _compat.scan_parts(eqn.params)
    nc, ncar = parts.num_consts, parts.num_carry
    consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    writes = _names(parts.jaxpr).writes
    if parts.length == 0:  # no iteration sets anything
        writes = {}
    first = [x[-1 if parts.reverse else 0] for x in xs]
    init = _carried(
        writes, env, log, _probe(parts.jaxpr, [*consts, *carry, *first], env, log), "scan"
    )
    body = _threaded(parts.jaxpr, list(writes), {**env, **init}, log, writes)

    def step(c, x):
        outs, new = body([*consts, *c[0], *x], c[1])
        return (outs[:ncar], new), outs[ncar:]

    (carry_out, new), ys = jax.lax.scan(
        step,
        (list(carry), {n: s.leaves for n, s in init.items()}),
        list(xs),
        length=parts.length,
        reverse=parts.reverse,
        unroll=parts.unroll,
    )
    _update(env, new, writes, log)
    return [*carry_out, *ys]


def _while(eqn, invals, env, log):
    cond, body_jaxpr, cn, bn = _compat.while_parts(eqn.params)
    cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    for meta, _ in _names(cond).writes.values():
        raise StateError(
            f"set_state({meta.name!r}) at {meta.location} runs in a while_loop's cond_fun, "
            "which decides whether to go on and must not change state. Set it in body_fun."
        )
    writes = _names(body_jaxpr).writes
    probe = _probe(body_jaxpr, [*bconsts, *carry], env, log)
    init = _carried(writes, env, log, probe, "while_loop")
    inner_env = {**env, **init}
    body = _threaded(body_jaxpr, list(writes), inner_env, log, writes)
    test = _threaded(cond, list(writes), inner_env, log, {})

    def body_fn(c):
        return body([*bconsts, *c[0]], c[1])

    carry_out, new = jax.lax.while_loop(
        lambda c: test([*cconsts, *c[0]], c[1])[0][0],
        body_fn,
        (list(carry), {n: s.leaves for n, s in init.items()}),
    )
    _update(env, new, writes, log)
    return carry_out


def _cond(eqn, invals, env, log):
    index, ops = invals[0], list(invals[1:])
    branches = _compat.cond_branches(eqn.params)
    per_branch = [_names(b).writes for b in branches]
    writes: dict = {}
    for w in per_branch:
        for n, (meta, avals) in w.items():
            if n not in writes or meta.batch_ndim > writes[n][0].batch_ndim:
                writes[n] = (meta, avals)
    for n, (meta, _) in writes.items():
        if n not in env and not all(n in w for w in per_branch):
            raise StateError(
                f"The state {n!r} is set in some branches of a cond/switch (at {meta.location}) "
                "and has no value before it, so there would be none after it where another "
                "branch ran. Give it one before the cond (set_state, state=, or get_state with "
                "init=), or set it in every branch."
            )
    names = [n for n in writes if n in env]
    fns = [_threaded(b, names, env, log, writes) for b in branches]
    state = {n: env[n].leaves for n in names}
    outs, new = jax.lax.switch(index, [lambda o, s, f=f: f(o, s) for f in fns], ops, state)
    _update(env, new, writes, log)
    return outs


def _remat(eqn, invals, env, log):
    # Rebuilt around the threaded function: a recomputation in the backward pass recomputes
    # values, and sets nothing.
    jaxpr = _compat.call_jaxpr(eqn.params)
    info = _names(jaxpr)
    names = [n for n in env if n in info.reads or n in info.writes]
    body = _threaded(jaxpr, names, env, log, info.writes)
    outs, new = jax.checkpoint(
        body, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )(list(invals), {n: env[n].leaves for n in names})
    _update(env, new, info.writes, log)
    return outs


def _shard_map(eqn, invals, env, log):
    # State set inside is per shard: one row per shard, along a new leading axis, split over
    # the manual mesh axes; each shard reads its own row back in a later shard_map. Other
    # state comes in whole, the same on every shard.
    jaxpr, mesh, in_specs, out_specs, check_vma, manual = _compat.shard_map_parts(eqn.params)
    axes = tuple(a for a in mesh.axis_names if a in manual)
    info = _names(jaxpr)
    names = [n for n in env if n in info.reads or n in info.writes]
    split = {n: env[n].shards == axes for n in names}
    run = _threaded(jaxpr, names, env, log, info.writes)

    def body(args, state):
        state = {n: [x[0] if split[n] else x for x in v] for n, v in state.items()}
        outs, new = run(args, state)
        return outs, {n: [_compat.vary(x[None], axes) for x in v] for n, v in new.items()}

    def spec(split_: bool) -> PartitionSpec:
        return PartitionSpec(axes) if split_ else PartitionSpec()

    state = {n: list(env[n].leaves) for n in names}
    outs, new = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(list(in_specs), {n: [spec(split[n])] * len(v) for n, v in state.items()}),
        out_specs=(
            list(out_specs),
            {n: [spec(True)] * len(avals) for n, (_, avals) in info.writes.items()},
        ),
        check_vma=check_vma,
        axis_names=frozenset(manual),
    )(list(invals), state)
    _update(env, new, info.writes, log, shards=axes)
    return outs


for _prim in (
    _compat.JIT_PRIMITIVE,
    jex.primitives.closed_call_p,
    jex.primitives.call_p,
    jex.primitives.custom_jvp_call_p,
    jex.primitives.custom_vjp_call_p,
):
    _RULES[_prim] = _inline
_RULES[jex.primitives.scan_p] = _scan
_RULES[jex.primitives.while_p] = _while
_RULES[jex.primitives.cond_p] = _cond
_RULES[_compat.REMAT_PRIMITIVE] = _remat
_RULES[_compat.SHARD_MAP_PRIMITIVE] = _shard_map


# ---- the primitives' rules ----------------------------------------------------------------


def _escaped(what: str, meta: StateMeta) -> StateError:
    return StateError(
        f"{what}({meta.name!r}) at {meta.location} ran where stx.stateful could not thread it: "
        "inside a primitive whose rules run Python code of their own (an equinox noinline, a "
        "lineax operator), or in a function traced inside stateful and run outside it. Move the "
        "call out of it."
    )


@get_state_p.def_impl
def _get_impl(*defaults, meta, avals):
    raise _escaped("get_state", meta)


@set_state_p.def_impl
def _set_impl(*xs, meta):
    raise _escaped("set_state", meta)


@get_state_p.def_effectful_abstract_eval
def _get_abstract(*defaults, meta, avals):
    return list(avals), {_compat.STATE_EFFECT}


@set_state_p.def_effectful_abstract_eval
def _set_abstract(*avals, meta):
    return list(avals), {_compat.STATE_EFFECT}


def _get_lowering(ctx, *xs, meta, avals):
    raise _escaped("get_state", meta)


def _set_lowering(ctx, *xs, meta):
    raise _escaped("set_state", meta)


_compat.register_lowering(get_state_p, _get_lowering)
_compat.register_lowering(set_state_p, _set_lowering)


def _get_jvp(primals, tangents, **params):
    # State read is a constant of the function being differentiated inside `stateful`.
    outs = get_state_p.bind(*primals, **params)
    return outs, [zero_tangent(x) for x in outs]


def _set_jvp(primals, tangents, **params):
    return set_state_p.bind(*primals, **params), list(tangents)


_compat.register_jvp_rule(get_state_p, _get_jvp)
_compat.register_jvp_rule(set_state_p, _set_jvp)
_compat.register_transpose_rule(set_state_p, lambda cts, *args, **params: list(cts))


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


def _forbid_batched_predicate(prim, predicate_batched: Callable) -> None:
    # JAX batches a `cond` (or `while_loop`) whose predicate differs per example by running
    # every branch (every iteration) for every example and selecting: each branch's
    # `set_state` would run for every example. Inside `stateful` that is an error, not a
    # silently wrong state.
    original = _compat.batching_rule(prim)

    def rule(axis_data, args, dims, **params):
        if (
            _compat.STATEFUL.value is not None
            and predicate_batched(axis_data, params, dims)
            and any(_names(j).reads or _names(j).writes for j in _compat.jaxprs_in_params(params))
        ):
            raise StateError(
                f"A {prim} whose predicate differs per example of a vmap reads or sets state "
                "inside stx.stateful: JAX runs every branch for every example, so each would "
                "set it. Apply the vmap outside: jax.vmap(stx.stateful(f))."
            )
        return original(axis_data, args, dims, **params)

    _compat.set_batching_rule(prim, rule)


def _while_predicate_batched(axis_data, params, dims) -> bool:
    cond, body, cn, bn = _compat.while_parts(params)
    batched = [d is not None for d in dims]
    cconsts, bconsts, carry = batched[:cn], batched[cn : cn + bn], batched[cn + bn :]
    while True:  # the carries batched after any number of iterations
        out = _compat.batched_outputs(body, axis_data, [*bconsts, *carry])
        grown = [a or b for a, b in zip(carry, out, strict=True)]
        if grown == carry:
            break
        carry = grown
    return _compat.batched_outputs(cond, axis_data, [*cconsts, *carry])[0]


_forbid_batched_predicate(
    jex.primitives.cond_p, lambda axis_data, params, dims: dims[0] is not None
)
_forbid_batched_predicate(jex.primitives.while_p, _while_predicate_batched)
_compat.register_batching_rule(get_state_p, _get_batch)
_compat.register_batching_rule(set_state_p, _set_batch)


def _remat_partial_eval(saveable, unks_in, inst_in, eqn):
    # Under `jax.checkpoint`'s partial evaluation, a read or a write with known inputs happens
    # once, in the forward pass: the backward pass reuses what it read, and sets nothing again.
    n = len(eqn.outvars)
    if any(unks_in):
        residuals = [
            v
            for v, inst in zip(eqn.invars, inst_in, strict=True)
            if isinstance(v, jex.Var) and not inst
        ]
        return None, eqn, [True] * n, [True] * n, residuals
    return eqn, None, [False] * n, [False] * n, []


_compat.register_remat_partial_eval_rule(get_state_p, _remat_partial_eval)
_compat.register_remat_partial_eval_rule(set_state_p, _remat_partial_eval)

"""Threading named state through a jaxpr: `stateful`'s hook on the one evaluator.

`run` evaluates a jaxpr (`_core.evaluator.evaluate`) with an environment of the current value
of each name: a `set_state` replaces the value; a `get_state` reads it (or, for a name that has
none yet, returns its own `init()`, an operand of the equation). Equations whose functions
touch no state are bound as they are. For the others, the primitive's handler module says what
to do, beside what it does with marks (`register_handler`'s `thread_state`, a rule that
rebuilds the equation with public JAX around functions threaded here, given a `Threading`; or
`runs`, the Python functions a primitive runs, traced and threaded as a call); a primitive with
a handler and neither threads state on the handler's own contract (`_on_handler_contract`: in
as planted values, out as marks). The rules live in `statax/handlers/`: calls run inline; a
loop carries every name its body sets; a `cond` lets out, from the branch that ran, every name
some branch sets; `jax.checkpoint` is rebuilt around the threaded function, so a recomputation
sets nothing; a `shard_map` makes a name set inside per-shard state, one row per shard.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from .._jax import jaxprs as _jaxprs
from . import context as _context
from .errors import StateError
from .evaluator import bind_equation, equations, evaluate
from .exposers import inert, map_jaxprs, mark, split_leaves, take
from .meta import StateMeta
from .primitive import IDLE, stage_mark
from .registry import rules_for
from .state import get_state_p, kind_of, set_state_p

__all__ = ["Threading", "batched_state_guard", "run"]


# ---- the threading interpreter --------------------------------------------------------------


class Slot(NamedTuple):
    """The current value of a name: its structure, its array leaves, and the manual mesh axes
    they are split over, one row per shard (set in a `shard_map`), or `()`."""

    meta: StateMeta
    leaves: tuple
    shards: tuple = ()


class Log:
    """What a threading run saw, in program order."""

    def __init__(self):
        self.set_order: list[str] = []
        self.read_order: list[str] = []
        self.top_defaults: dict[str, Slot] = {}  # read with no value, at depth 0: init()
        self.defaults: dict[str, Slot] = {}  # the same at any depth (for a loop's first pass)
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


def state_names(jaxpr) -> _Names:
    """The state names a jaxpr (at any depth) reads and sets."""
    if _jaxprs.wraps_jaxpr(jaxpr):
        jaxpr = jaxpr.jaxpr
    found = _NAMES.get(jaxpr)
    if found is None:
        reads, writes = set(), {}

        def write(meta, avals):  # the most batched set of a name
            old = writes.get(meta.name)
            if old is None or meta.batch_ndim >= old[0].batch_ndim:
                writes[meta.name] = (meta, avals)

        for eqn in equations(jaxpr):  # (at any depth: jaxprs in params)
            if eqn.primitive is get_state_p:
                reads.add(eqn.params["meta"].name)
            elif eqn.primitive is set_state_p:
                write(eqn.params["meta"], tuple(x.aval for x in eqn.invars))
            elif (ran := _ran_jaxpr(eqn)) is not None:  # Python functions a primitive runs
                inner = state_names(ran)
                reads |= inner.reads
                for w in inner.writes.values():
                    write(*w)
        found = _NAMES[jaxpr] = _Names(frozenset(reads), writes)
    return found


def _holds_state(eqn) -> bool:
    return any((lambda n: n.reads or n.writes)(state_names(sub)) for sub in _inner(eqn))


def _inner(eqn) -> list:
    """The functions `eqn` runs: the jaxprs in its params, and, for a primitive whose functions
    are Python (see `register_handler`'s `runs`), what they trace to."""
    ran = _ran_jaxpr(eqn)
    return [*_jaxprs.jaxprs_in_params(eqn.params), *([] if ran is None else [ran])]


def _ran_jaxpr(eqn):
    """What a primitive whose functions are Python runs, traced (`runs`), or `None`."""
    runs = rules_for(eqn).runs
    return None if runs is None else _ran(eqn, runs)


# Equations whose Python functions were traced inside `stateful` (`runs`), and what that gave
# (bounded; the equation is held so that its id is not reused).
_RAN: OrderedDict = OrderedDict()


def _ran(eqn, runs: Callable):
    hit = _RAN.get(id(eqn))
    if hit is None or hit[0] is not eqn:
        hit = _RAN[id(eqn)] = (eqn, runs(eqn))
        if len(_RAN) > 256:
            _RAN.popitem(last=False)
    return hit[1]


def run(jaxpr, consts, args, env: dict, log: Log) -> list:
    """Evaluate `jaxpr` in the current trace, threading `env` (name -> `Slot`) through it."""

    def step(eqn, invals):
        prim = eqn.primitive
        if prim is get_state_p:
            return _get(eqn.params["meta"], eqn.params["avals"], invals, env, log)
        if prim is set_state_p:
            meta = eqn.params["meta"]
            env[meta.name] = Slot(meta, tuple(invals))
            log.set(meta.name)
            return invals
        rules = rules_for(eqn)
        if rules.rebinding is not None:  # its operands may have other types than when traced
            return rules.rebinding(eqn, invals)
        if not _holds_state(eqn):
            return bind_equation(eqn, invals)
        if rules.thread_state is not None:
            return rules.thread_state(eqn, invals, Threading(env, log))
        if rules.runs is not None:  # what it runs, threaded as a call
            return run(*_closed(_ran(eqn, rules.runs)), invals, env, log)
        if rules.handler is not None:
            return _on_handler_contract(eqn, invals, Threading(env, log), rules.handler)
        inner = [state_names(sub) for sub in _jaxprs.jaxprs_in_params(eqn.params)]
        used = sorted({n for i in inner for n in (*i.reads, *i.writes)})
        raise StateError(
            f"stx.stateful cannot thread state through the primitive `{prim}`, which "
            f"reads or sets {used}: it has no handler (see 'Writing a handler' in the "
            "docs). Move the get_state/set_state out of it, or pass the value in and "
            "out of it by hand."
        )

    return evaluate(jaxpr, consts, args, step)


def _get(meta: StateMeta, avals, defaults, env, log) -> list:
    log.read(meta.name)
    slot = env.get(meta.name)
    if slot is None:  # no value yet: this read's own init()
        default = Slot(meta, tuple(defaults))
        log.defaults.setdefault(meta.name, default)
        if log.depth == 0:
            log.top_defaults.setdefault(meta.name, default)
        return list(defaults)
    return _conform(slot, meta, avals, "read by get_state")


def _conform(slot: Slot, meta: StateMeta, avals, what: str) -> list:
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
        held = kind_of(slot.meta, [jax.typeof(x) for x in slot.leaves])
        hint = (
            " A value set under a vmap (or passed in from one) is per example: read it inside a "
            "vmap, or apply the vmap outside stateful, jax.vmap(stx.stateful(f))."
            if any(len(jnp.shape(x)) > len(a.shape) for x, a in zip(slot.leaves, avals))
            else ""
        )
        raise StateError(
            f"The state {meta.name!r} holds {held} (from {slot.meta.location}), but is {what} at "
            f"{meta.location} as {kind_of(meta, avals)}. A state keeps its structure, shapes and "
            f"dtypes.{hint}"
        )
    return out


_STATE_PREFIX = "\x00state:"  # marks that carry state through a handler: no user's name


def _state_meta(name: str, meta: StateMeta) -> StateMeta:
    return dataclasses.replace(meta, name=_STATE_PREFIX + name, reduce=None)


def _is_state(meta: StateMeta) -> bool:
    return meta.name.startswith(_STATE_PREFIX)


# ---- threading state through a higher-order primitive -----------------------------------------
#
# What a primitive does with state is its handler module's to say (`statax/handlers/`), beside
# what it does with marks: `register_handler(prim, ..., thread_state=rule)` registers
# `rule(eqn, invals, threading) -> outs`, which evaluates `eqn` on `invals` in the current trace
# and threads the state of `threading` (a `Threading`) through it. A primitive with a handler
# and no such rule threads state on the handler's own contract (`_on_handler_contract`).


class Threading:
    """A state rule's view of the state where its equation runs, and the ways to thread it
    through the primitive's functions (see `statax.extend.register_handler`)."""

    __slots__ = ("env", "log")

    def __init__(self, env: dict, log: Log):
        self.env, self.log = env, log

    def uses(self, jaxpr) -> _Names:
        """The names `jaxpr` reads (`.reads`) and sets (`.writes`: name -> `(meta, avals)`)."""
        return state_names(jaxpr)

    def present(self, *jaxprs) -> list[str]:
        """The names with a value now that any of `jaxprs` reads or sets."""
        used = [state_names(j) for j in jaxprs]
        return [n for n in self.env if any(n in u.reads or n in u.writes for u in used)]

    def run(self, jaxpr, args: Sequence) -> list:
        """`jaxpr` (closed or open) evaluated on `args` here, in the same state: a call."""
        return run(*_closed(jaxpr), list(args), self.env, self.log)

    def threaded(self, jaxpr, names: Sequence[str], touched: dict, start=None) -> Callable:
        """`f(args, state) -> (outs, new_state)`: `jaxpr` threaded in a new trace (a loop
        body, a branch, a checkpointed or per-shard function). `state` holds the leaves of
        `names` (name -> leaves); the other names are read as they are now, or as `start`
        (name -> `Slot`, from `carried`) has them. `new_state` holds the leaves of each name
        in `touched` (name -> `(meta, avals)`), as values of that kind."""
        env = {**self.env, **(start or {})}
        return _threaded(jaxpr, names, env, self.log, touched)

    def carried(
        self, writes: dict, jaxpr, args: Sequence, loop: str, *, may_run_none: bool
    ) -> dict:
        """The value each name a loop sets starts the loop with (name -> `Slot`; its
        `.leaves`): its value before the loop; else what the first iteration (`jaxpr` on
        `args`) reads; else zeros, for a loop that always runs; and a `StateError` naming
        `loop` for one that `may_run_none` (it would have no value after it)."""
        probe = None if jaxpr is None else _probe(jaxpr, list(args), self.env, self.log)
        return _carried(writes, self.env, self.log, probe, loop, may_run_none)

    def values(self, names: Sequence[str]) -> dict:
        """name -> the leaves it holds now."""
        return {n: list(self.env[n].leaves) for n in names}

    def batch_ndim(self, name: str) -> int:
        """How many leading axes of `name`'s value are a `vmap`'s (one value per example)."""
        return self.env[name].meta.batch_ndim

    def shards(self, name: str) -> tuple:
        """The manual mesh axes `name`'s value is split over (one row per shard), or `()`."""
        return self.env[name].shards

    def update(self, new: dict, touched: dict, shards: tuple = ()) -> None:
        """Set each name of `new` (name -> leaves) to that value, of `touched`'s kind."""
        _update(self.env, new, touched, self.log, shards)


def _closed(jaxpr) -> tuple:
    """`(open_jaxpr, consts)` of a closed or an open jaxpr."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _threaded(jaxpr, names: Sequence[str], env: dict, log: Log, touched: dict) -> Callable:
    open_jaxpr, consts = _closed(jaxpr)

    def f(args, state):
        inner = dict(env)
        for n in names:
            inner[n] = inner[n]._replace(leaves=tuple(state[n]))
        log.depth += 1
        try:
            outs = run(open_jaxpr, consts, list(args), inner, log)
        finally:
            log.depth -= 1
        new = {
            n: tuple(_conform(inner[n], meta, avals, "set")) for n, (meta, avals) in touched.items()
        }
        return list(outs), new

    return f


def _update(env: dict, new: dict, touched: dict, log: Log, shards: tuple = ()) -> None:
    for n, leaves in new.items():
        env[n] = Slot(touched[n][0], tuple(leaves), shards)
        log.set(n)


def _carried(
    writes: dict, env: dict, log: Log, probe: Callable | None, loop: str, may_run_none: bool
) -> dict:
    first = probe() if probe is not None and any(n not in env for n in writes) else {}
    init = {}
    for n, (meta, avals) in writes.items():
        if n in env:
            init[n] = Slot(meta, tuple(_conform(env[n], meta, avals, "carried")))
        elif n in first:
            init[n] = Slot(meta, tuple(_conform(first[n], meta, avals, "carried")))
        elif not may_run_none:
            init[n] = Slot(meta, tuple(jnp.zeros(a.shape, a.dtype) for a in avals))
        else:
            raise StateError(
                f"The state {n!r} is set inside a {loop} (at {meta.location}) and has no value "
                "before it: were the loop to run no iteration, it would have none after. Give it "
                "one before the loop (set_state, state=, or get_state with init=)."
            )
    return init


def _probe(jaxpr, args, env, log) -> Callable:
    """`probe()`: what a first iteration of the loop body `jaxpr` reads with no value yet (its
    `init()`s), name -> `Slot`. The trial iteration is traced apart, and only what those values
    need is evaluated here: the rest of it would stay in the program as dead code, where a
    selection (`at=`) would find its places a second time."""

    def probe():
        found: dict = {}

        def trial_run(*args):
            trial = Log()
            trial.depth = log.depth
            run(*_closed(inert(jaxpr)), args, dict(env), trial)
            found.update(trial.defaults)
            return [x for slot in found.values() for x in slot.leaves]

        closed = _jaxprs.trace(trial_run, [jax.typeof(a) for a in args], name="probe")
        if not found:
            return {}
        open_jaxpr, consts = _closed(closed)
        needed, _ = _jaxprs.dce(open_jaxpr, [True] * len(open_jaxpr.outvars), keep=True)
        leaves = iter(evaluate(needed, consts, args))
        return {
            n: slot._replace(leaves=tuple(next(leaves) for _ in slot.leaves))
            for n, slot in found.items()
        }

    return probe


def _on_handler_contract(eqn, invals, threading: Threading, handler) -> list:
    """Thread state through `eqn` with its `pull` handler, as values that come in and go out:
    each of its functions is threaded on its own (a read after a set in it sees the set), the
    values the names have where it starts come in as planted values do (`take`), and their
    values where it ends go out as marks do (`mark`). The handler rebuilds the equation to
    take and return them, as it does for `plant` and `pull`. Right for a primitive that calls
    each of its functions once (a call); a loop or a branch needs a rule of its own."""
    names = threading.present(*_jaxprs.jaxprs_in_params(eqn.params))
    ins = {n: threading.env[n] for n in names}
    in_metas = tuple(_state_meta(n, s.meta) for n, s in ins.items())

    def thread(jaxpr):
        closed = jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jex.ClosedJaxpr(jaxpr, ())
        writes = state_names(closed).writes

        def body(*args):
            avals = [jax.typeof(x) for s in ins.values() for x in s.leaves]
            leaves = iter(take(in_metas, avals))
            env = {
                n: s._replace(leaves=tuple(next(leaves) for _ in s.leaves)) for n, s in ins.items()
            }
            log = Log()
            log.depth = threading.log.depth + 1
            outs = run(closed.jaxpr, closed.consts, list(args), env, log)
            done = [n for n in log.set_order if n in writes]
            mark(
                [x for n in done for x in env[n].leaves],
                [_state_meta(n, env[n].meta) for n in done],
            )
            return outs

        new = _jaxprs.trace(body, closed.in_avals, name="stateful")
        return new if isinstance(jaxpr, jex.ClosedJaxpr) else new.jaxpr

    with _context.PULLING(True):
        rewrite = handler(eqn.replace(params=map_jaxprs(eqn.params, thread)))
    fed = []
    for meta in rewrite.ins:
        if not _is_state(meta):
            raise StateError(
                f"stx.stateful: {eqn.primitive} takes a planted value in, {meta.name!r}"
            )
        fed.extend(threading.env[meta.name[len(_STATE_PREFIX) :]].leaves)
    flat = _jaxprs.bind(rewrite.eqn.primitive, [*invals, *fed], rewrite.eqn.params)
    n = len(eqn.outvars)
    out_leaves = split_leaves(flat[n:], rewrite.outs)
    for meta, leaves in zip(rewrite.outs, out_leaves, strict=True):
        if _is_state(meta):
            name = meta.name[len(_STATE_PREFIX) :]
            threading.update({name: leaves}, {name: (dataclasses.replace(meta, name=name), None)})
        elif _context.PULLING.value:  # a user's mark, taken out by the handler: marked again
            mark(list(leaves), [meta])
        else:
            stage_mark(list(leaves), meta, IDLE)
    return list(flat[:n])


def batched_state_guard(predicate_batched: Callable, *, what: str, runs: str) -> Callable:
    """A primitive's `batching_guard` (see `statax.extend.Rules`) that refuses, inside
    `stx.stateful`, to batch an equation (a `what`) whose jaxprs read or set state where
    `predicate_batched(axis_data, params, dims)`: JAX then runs `runs` ("every branch") for
    every example and selects, so each would set the state. A `StateError` says so, not a
    silently wrong state."""

    def guard(axis_data, dims, params):
        if _context.STATEFUL.value is None or not any(
            state_names(j).reads or state_names(j).writes for j in _jaxprs.jaxprs_in_params(params)
        ):
            return
        if predicate_batched(axis_data, params, dims):
            raise StateError(
                f"A {what} whose predicate differs per example of a vmap reads or sets state "
                f"inside stx.stateful: JAX runs {runs} for every example, so each would set "
                "it. Apply the vmap outside: jax.vmap(stx.stateful(f))."
            )

    return guard

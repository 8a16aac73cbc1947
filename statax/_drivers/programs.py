"""Compiled programs that answer for the function as it is now: what a sweep, a recorder and
an in-graph summary compile (`Programs`).

A `jax.jit` of a function keeps its first trace: whatever the function reads from outside its
arguments (a global array, a model's weights it closes over, an NNX module's state) is baked in
as it was then. `Programs` traces at every call instead, so every call sees the function as it
is now, and keeps compiled programs by what they compute (`structure.program_key`), with the
trace's constants passed in as arguments: a call whose trace is the one seen before (whatever
the constants' values) runs the program compiled for it, and one whose trace differs (another
shape, another branch taken in Python) compiles its own.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jex

from .._core import fastpaths as _fastpaths
from .._core.flat_calls import flat_function
from .._core.structure import constants_key, program_key, static_key
from .._jax import jaxprs as _jaxprs
from .._jax import tracing as _tracing

__all__ = ["Programs", "Traced", "kind_of", "made_of", "shapes_of", "trace_now"]


class Programs:
    """Compiled programs kept by what they compute: `programs(fn, *args, **kwargs)` is
    `fn(*args, **kwargs)`, traced now (array leaves of the arguments traced, the rest static, as
    `eqx.filter_jit`) and run by the program compiled for a trace of the same structure, with
    this trace's constants (the most recent `keep` programs are kept). `programs.lower(fn,
    *args, **kwargs)` lowers the program that call would run.

    What is not in the key cannot change what a call computes: a static argument or a closed-
    over value that changes the trace changes its structure or its constants."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._programs: collections.OrderedDict = collections.OrderedDict()
        # The last call's `Traced` per kind of arguments, for the early start (`__call__`).
        self._last: collections.OrderedDict = collections.OrderedDict()

    def __call__(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)`, traced now. The fast path starts the program the last call
        of this kind of arguments ran, with its constants, before tracing (the device runs it
        while the host traces), and keeps its result only where the trace is that call's:
        the same program and the very same constants, so the result is the one the trace's
        own program would give. Otherwise (or where the program has effects: a callback
        runs once) it runs the trace's program after tracing, as the plain path does."""
        kind = kind_of(args, kwargs)
        guess = self._last.pop(kind, None) if _fastpaths.on else None
        early = None
        if guess is not None and guess.startable():
            early = guess.run(args, kwargs)  # (dispatched: it runs while the host traces)
        now = self.traced(fn, *args, **kwargs)
        self._last[kind] = now
        while len(self._last) > self.keep:
            self._last.popitem(last=False)
        if early is not None and now.same_as(guess):
            return now.unflatten(early)
        return now(*args, **kwargs)

    def lower(self, fn: Callable, *args, **kwargs):
        return self.traced(fn, *args, **kwargs).lower(*args, **kwargs)

    def traced(self, fn: Callable, *args, rewrite: Callable | None = None, **kwargs) -> Traced:
        """`fn` traced now for arguments like these, and its compiled program: a `Traced`, to
        call on arguments of the same structure, types and static leaves (the chunks of one
        sweep) without tracing again. `rewrite`, a function of a closed jaxpr that computes
        the same, is applied to the trace before it is compiled (`sinking.sink`)."""
        jaxpr, consts, traced, out_info = trace_now(fn, args, kwargs)
        key = (made_of(jaxpr, ()), rewrite)  # (the constants are passed in: not in the key)
        jitted = self._programs.pop(key, None)
        if jitted is None:
            closed = _jaxprs.constants_as_inputs(jaxpr)
            jitted = jax.jit(jex.jaxpr_as_fun(closed if rewrite is None else rewrite(closed)))
        self._programs[key] = jitted
        while len(self._programs) > self.keep:
            self._programs.popitem(last=False)
        effects = bool(jaxpr.effects)
        return Traced(jitted, list(consts), traced, *out_info, effects=effects)


def trace_now(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """`(jaxpr, consts, traced, (out_def, out_static))`: `fn(*args, **kwargs)` traced now, its
    array leaves traced (`traced`: which), its output's structure and non-array leaves."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    traced = tuple(eqx.is_array(x) for x in leaves)
    dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]
    out_info: list = []
    call = lambda _, *a, **k: fn(*a, **k)  # noqa: E731
    full_def = jax.tree_util.tree_structure((None, args, kwargs))
    flat_fn = flat_function(call, leaves, full_def, traced, out_info)
    avals = list(map(jax.typeof, dynamic))
    jaxpr, consts = _jaxprs.trace_open(flat_fn, avals, "statax", fn)
    return jaxpr, consts, traced, out_info[0]


def made_of(jaxpr, consts) -> tuple:
    """What a trace computes, its constants included (the very arrays): equal for two traces
    of a function that read the same things, so that what was made of one serves the other."""
    return (_tracing.trace_context(), program_key(jaxpr), constants_key(consts))


def shapes_of(jaxpr, out_info) -> Any:
    """A trace's output as `jax.ShapeDtypeStruct`s (its non-array leaves as they are)."""
    out_def, out_static = out_info
    avals = iter(v.aval for v in jaxpr.outvars)
    leaves = [_shape(next(avals)) if s is None else s[0] for s in out_static]
    return jax.tree_util.tree_unflatten(out_def, leaves)


def _shape(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def kind_of(args, kwargs):
    """What a call's arguments are, short of their values: their tree, which leaves are arrays
    and of what type, and the others (hashable, else by identity)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    return (
        treedef,
        tuple(jax.typeof(x) if eqx.is_array(x) else static_key(x) for x in leaves),
    )


class Traced:
    """A function traced for some arguments, and the program compiled for its trace: called
    on arguments of the same structure, types and static leaves, it runs the program."""

    def __init__(
        self, jitted, consts: list, traced: tuple, out_def, out_static: tuple, effects=False
    ):
        self._jitted, self._consts, self._traced = jitted, consts, traced
        self._out_def, self._out_static = out_def, out_static
        self.effects = effects  # whether the program has effects (a callback)

    def _inputs(self, args, kwargs) -> list:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        return [*self._consts, *(x for x, t in zip(leaves, self._traced, strict=True) if t)]

    def startable(self) -> bool:
        """Whether its program may start before the trace says it is the one: it has no
        effects (a callback would run twice), and its constants all still hold their buffers
        (a training step may have donated a model's old weights: Keras's `fit`)."""
        return not self.effects and not any(getattr(c, "is_deleted", bool)() for c in self._consts)

    def run(self, args, kwargs) -> list:
        """The program's flat outputs for these arguments."""
        return self._jitted(*self._inputs(args, kwargs))

    def unflatten(self, flat):
        it = iter(flat)
        leaves = [next(it) if s is None else s[0] for s in self._out_static]
        return jax.tree_util.tree_unflatten(self._out_def, leaves)

    def same_as(self, other: Traced) -> bool:
        """Whether `other` computes what this does: the same program, on the same constants
        (the very same arrays: a JAX array does not change)."""
        return (
            self._jitted is other._jitted
            and self._traced == other._traced
            and len(self._consts) == len(other._consts)
            and all(a is b for a, b in zip(self._consts, other._consts, strict=True))
        )

    def __call__(self, *args, **kwargs):
        return self.unflatten(self.run(args, kwargs))

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._inputs(args, kwargs))

"""Compiled programs that answer for the function as it is now (`Program`): what a sweep, a
recorder and an in-graph summary compile (`Programs`).

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

import equinox as eqx
import jax
from jax.extend import core as jex

from .._core.flat_calls import flat_function
from .._core.structure import program_key
from .._jax import jaxprs as _jaxprs
from .._jax import tracing as _tracing

__all__ = ["Programs", "Traced"]


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

    def __call__(self, fn: Callable, *args, **kwargs):
        return self.traced(fn, *args, **kwargs)(*args, **kwargs)

    def lower(self, fn: Callable, *args, **kwargs):
        return self.traced(fn, *args, **kwargs).lower(*args, **kwargs)

    def traced(self, fn: Callable, *args, **kwargs) -> Traced:
        """`fn` traced now for arguments like these, and its compiled program: a `Traced`, to
        call on arguments of the same structure, types and static leaves (the chunks of one
        sweep) without tracing again."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        traced = tuple(eqx.is_array(x) for x in leaves)
        dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]
        out_info: list = []
        call = lambda _, *a, **k: fn(*a, **k)  # noqa: E731
        full_def = jax.tree_util.tree_structure((None, args, kwargs))
        flat_fn = flat_function(call, leaves, full_def, traced, out_info)
        avals = list(map(jax.typeof, dynamic))
        jaxpr, consts = _jaxprs.trace_open(flat_fn, avals, "statax", fn)
        key = (_tracing.trace_context(), program_key(jaxpr))
        jitted = self._programs.pop(key, None)
        if jitted is None:
            jitted = jax.jit(jex.jaxpr_as_fun(_jaxprs.constants_as_inputs(jaxpr)))
        self._programs[key] = jitted
        while len(self._programs) > self.keep:
            self._programs.popitem(last=False)
        return Traced(jitted, list(consts), traced, *out_info[0])

    def __len__(self) -> int:
        return len(self._programs)


class Traced:
    """A function traced for some arguments, and the program compiled for its trace: called
    on arguments of the same structure, types and static leaves, it runs the program."""

    def __init__(self, jitted, consts: list, traced: tuple, out_def, out_static: tuple):
        self._jitted, self._consts, self._traced = jitted, consts, traced
        self._out_def, self._out_static = out_def, out_static

    def _inputs(self, args, kwargs) -> list:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        return [*self._consts, *(x for x, t in zip(leaves, self._traced, strict=True) if t)]

    def __call__(self, *args, **kwargs):
        it = iter(self._jitted(*self._inputs(args, kwargs)))
        leaves = [next(it) if s is None else s[0] for s in self._out_static]
        return jax.tree_util.tree_unflatten(self._out_def, leaves)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._inputs(args, kwargs))

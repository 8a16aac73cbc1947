"""What a traced program computes, as a key: two traces of a function have equal keys exactly
where one compiled program runs both, given each trace's own constants as arguments.

The key is the jaxpr's structure: its equations in order (primitive, which values they read,
the types they make, their params and context), its literals by value, and the types of its
constants. A jaxpr nested in a param (a `jit`'s, a branch's) is keyed the same way, and its own
constants (baked into a compiled program) by identity. A param that holds a function is keyed by
identity too, except the params that a primitive's record declares as its derivative rules
(`Rules.derivative_params`): a compiled program that statax runs on arrays never differentiates
them, and a custom derivative makes a new rule object at every trace.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from jax.extend import core as jex

from .registry import rules_for

__all__ = ["constants_key", "program_key", "static_key"]


class _Same:
    """A key part equal only to the same object (held, so that its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj


def program_key(jaxpr: Any) -> tuple:
    """The key of a traced program (an open jaxpr with `constvars`): its constants are by
    type only, as they are passed to the compiled program."""
    return _open_key(jaxpr, {})


def constants_key(consts) -> tuple:
    """A trace's constants by identity (held): equal only for the very same arrays."""
    return tuple(map(_Same, consts))


def static_key(value: Any) -> Any:
    """A static value as a key part: itself where it hashes (containers and arrays by value),
    else by identity (held)."""
    return _value_key(value, {})


def _open_key(jaxpr: Any, memo: dict) -> tuple:
    ids: dict = {}
    parts: list = [
        tuple(v.aval for v in jaxpr.constvars),
        tuple(v.aval for v in jaxpr.invars),
    ]
    for v in (*jaxpr.constvars, *jaxpr.invars):
        ids[v] = len(ids)

    def ref(v):
        return _literal(v) if isinstance(v, jex.Literal) else ids[v]

    for eqn in jaxpr.eqns:
        parts.append(
            (
                eqn.primitive,
                tuple(map(ref, eqn.invars)),
                tuple(v.aval for v in eqn.outvars),
                _params_key(eqn, memo),
                eqn.ctx,
            )
        )
        for v in eqn.outvars:
            ids[v] = len(ids)
    parts.append(tuple(map(ref, jaxpr.outvars)))
    return tuple(parts)


def _literal(v) -> tuple:
    value = np.asarray(v.val)
    return ("literal", v.aval, value.dtype.str, value.tobytes())


def _params_key(eqn, memo: dict) -> tuple:
    skip = rules_for(eqn).derivative_params
    return tuple(
        (name, "rule" if name in skip else _value_key(value, memo))
        for name, value in eqn.params.items()
    )


def _value_key(value: Any, memo: dict) -> Any:
    if hasattr(value, "eqns"):  # a jaxpr (a closed one since JAX 0.11)
        return _nested_key(value, memo)
    if isinstance(value, jex.ClosedJaxpr):  # JAX < 0.11: around an open one
        return (_nested_key(value.jaxpr, memo), tuple(map(_Same, value.consts)))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(x, memo) for x in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _value_key(x, memo)) for k, x in value.items()))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    try:
        hash(value)
    except TypeError:
        return _Same(value)
    return value


# A nested jaxpr's key, kept while it lives: a `jax.jit`'s jaxpr (and statax's rewrite of it) is
# the same object at every trace, so a program that calls a jitted model is keyed at the cost
# of its own equations. (A jaxpr is immutable.)
_NESTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _nested_key(jaxpr: Any, memo: dict) -> tuple:
    key = memo.get(id(jaxpr))
    if key is None:
        try:
            key = _NESTED.get(jaxpr)
        except TypeError:  # (not weakly referenceable)
            key = None
    if key is None:
        consts = tuple(map(_Same, getattr(jaxpr, "consts", ())))  # baked into the program
        key = (_open_key(jaxpr, memo), consts)
        try:
            _NESTED[jaxpr] = key
        except TypeError:
            pass
    memo[id(jaxpr)] = key
    return key

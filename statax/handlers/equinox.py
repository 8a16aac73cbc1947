"""Handler for `eqx.internal.noinline`.

`noinline` keeps the function it calls out of its params (equinox compiles it separately), so
`pull` cannot see its marks in a jaxpr. This handler rebuilds the function from the equation,
traces it to look for marks, and where there are some, replaces the equation by a call of the
pulled function: while pulled, the function is inlined; unpulled programs keep `noinline`.

The other equinox constructs need no handler of their own: `eqx.filter_jit` is a `jit`,
`eqx.filter_checkpoint` a `checkpoint`, and `eqx.internal.while_loop` is built from `while`
(`kind="lax"`), custom derivatives around a `while` (`"checkpointed"`) or `scan`s of `cond`s
(`"bounded"`); see the semantics table in the docs.
"""

from __future__ import annotations

import weakref

from .. import _compat
from .._interpreter import call_equation, find_saves, pull_jaxpr, register_handler

_noinline_p, _fn_of = _compat.equinox_noinline()
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced(eqn):
    fn = _fn_of(eqn)
    if fn is None:
        return None
    return _compat.trace(fn, [x.aval for x in eqn.invars], name="noinline")


def _find(eqn):
    closed = _traced(eqn)
    return () if closed is None else find_saves(closed)


def _noinline_handler(eqn):
    closed, metas = pull_jaxpr(_traced(eqn))
    return call_equation(eqn, closed), metas


register_handler(_noinline_p, _noinline_handler, find_saves=_find)

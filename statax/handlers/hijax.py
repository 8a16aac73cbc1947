"""Handler for JAX's "hijax" primitives (JAX 0.11+; `lax.custom_root` is one).

A hijax primitive is one `call_hi_primitive` equation whose params hold a Python object with
its own rules, and the jaxprs it was built from. `pull` looks for marks in those jaxprs. As for
custom derivatives, the equation is kept, so its own rules keep governing derivatives and
batching; beside it, its forward computation (the object's `expand`) runs pulled on the same
inputs behind `stop_gradient` and provides the intermediates.
"""

from __future__ import annotations

import jax

from .. import _compat
from .._interpreter import find_saves, handler_from_exposer, pulled_beside, register_handler


def _find(eqn):
    return tuple(m for jaxpr in _compat.hi_jaxprs(eqn.params) for m in find_saves(jaxpr))


def _hi_exposer(*args, **params):
    outs = _compat.bind(_compat.HI_PRIMITIVE, args, params)
    expanded = _compat.trace(_compat.hi_expand(params), [jax.typeof(x) for x in args], "expand")
    return outs, *pulled_beside(expanded, args)


if _compat.HI_PRIMITIVE is not None:  # JAX 0.11+
    register_handler(_compat.HI_PRIMITIVE, handler_from_exposer(_hi_exposer), find_saves=_find)

"""Handler for JAX's "hijax" primitives (JAX 0.11+; `lax.custom_root` is one).

A hijax primitive is one `call_hi_primitive` equation whose params hold a Python object with
its own rules, and the jaxprs it was built from. `pull` looks for marks in those jaxprs. As for
custom derivatives (`pulled_with_rule`), its forward computation (the object's `expand`) runs
pulled, once, and provides the outputs and the intermediates; derivatives delegate to the
equation itself, so its own rules keep governing them. Under `stateful`, a hijax primitive
whose functions read or set state runs its expansion threaded, as a call: it is then
differentiated as written (its rules do not describe what it does to the state), as a custom
derivative is.
"""

from __future__ import annotations

import jax

from statax.extend import (
    HI_PRIMITIVE,
    bind,
    find_saves,
    handler_from_exposer,
    params,
    pulled_with_rule,
    register_handler,
    trace,
)


def _find(eqn):
    return tuple(m for jaxpr in params.hi_jaxprs(eqn.params) for m in find_saves(jaxpr))


def _hi_exposer(*args, **eqn_params):
    def original(*args):
        return tuple(bind(HI_PRIMITIVE, args, eqn_params))

    expanded = trace(params.hi_expand(eqn_params), [jax.typeof(x) for x in args], "expand")
    return pulled_with_rule(original, expanded, args)


def _expansion(eqn):
    # What the equation runs: its expansion, traced, for `stateful` to thread.
    return trace(params.hi_expand(eqn.params), [x.aval for x in eqn.invars], "expand")


if HI_PRIMITIVE is not None:  # JAX 0.11+
    register_handler(
        HI_PRIMITIVE, handler_from_exposer(_hi_exposer), find_saves=_find, runs=_expansion
    )

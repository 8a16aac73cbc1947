"""Handlers for `custom_jvp_call` and `custom_vjp_call` (`jax.custom_jvp`, `jax.custom_vjp`,
and what is built from them: equinox's checkpointed while loop, diffrax's adjoints,
optimistix's implicit derivatives).

Reads `call_jaxpr`, the primal function. The equation is rebound as a custom-derivative function
of statax's whose primal is the *pulled* primal: it returns the original outputs followed by
the intermediates, computed once (a loop inside runs once, as unpulled). Its rule delegates to
the original equation (its marks inert), so the custom rule keeps governing derivatives; the
intermediates get zero tangents (they are the primal's values, as under `grad`). Only when the
result is differentiated does the pulled primal also run, beside the original rule, behind
`stop_gradient`, to provide them. A value planted inside changes the function, so its rule no
longer describes it: it then runs and is differentiated as written.

Under `pull(grad(f))` JAX has already replaced the equation by what it runs: the primal
function for `custom_jvp` (if the JVP rule calls it), `fwd` and `bwd` for `custom_vjp`; their
marks are collected where they run.
"""

from __future__ import annotations

from jax.extend.core.primitives import custom_jvp_call_p, custom_vjp_call_p

from ..extend import bind, handler_from_exposer, inert, params, pulled_with_rule, register_handler


def _exposer(primitive, rule):
    def exposer(*args, **eqn_params):
        # The equation as it was, its marks inert (an enclosing `pull` must not see them again).
        primal = params.custom_primal(eqn_params)
        kept = params.custom_params(eqn_params, inert(primal))

        def original(*args):
            return tuple(bind(primitive, args, kept))

        return pulled_with_rule(original, primal, args, rule=rule)

    return exposer


register_handler(custom_jvp_call_p, handler_from_exposer(_exposer(custom_jvp_call_p, "jvp")))
# A custom_vjp function has no JVP to call: the rewritten one is a custom_vjp too.
register_handler(custom_vjp_call_p, handler_from_exposer(_exposer(custom_vjp_call_p, "vjp")))

"""Handlers for the call primitives: `closed_call` and `call` (`jax.named_call` in older JAX, and
the `closed_call`s that other handlers build), `checkpoint` (`jax.checkpoint` / `jax.remat`,
with or without a policy, and `eqx.filter_checkpoint`) and `jit` (`jax.jit`, `eqx.filter_jit`,
nested jits).

Each reads its function (`call_jaxpr` or `jaxpr`, closed or open) and pulls it; the
intermediates leave as extra outputs of the call, and planted values come in as extra inputs.

* `jit`: the new outputs and inputs get unspecified sharding and layout (the compiler chooses)
  and are not donated, so `static_argnums`, `donate_argnums` and in/out shardings of the user's
  jit are untouched.
* `checkpoint`: under differentiation, JAX's partial evaluation keeps each mark in the forward
  pass and makes the copy that the backward pass replays inert, so every value is collected
  once.

Under `stateful`, a call runs its function in the same state; a `checkpoint` is rebuilt around
the threaded function, so that a recomputation in the backward pass sets nothing again.
"""

from __future__ import annotations

import jax
from jax.extend.core.primitives import call_p, closed_call_p

from statax.extend import (
    JIT_PRIMITIVE,
    REMAT_PRIMITIVE,
    extend_equation,
    params,
    pull_jaxpr,
    pull_open_jaxpr,
    register_handler,
    wraps_jaxpr,
)


def _call_handler(eqn):  # `call` and `checkpoint` keep an open jaxpr, `closed_call` a closed one
    jaxpr = params.call_jaxpr(eqn.params)
    inner = (pull_jaxpr if wraps_jaxpr(jaxpr) else pull_open_jaxpr)(jaxpr)
    return extend_equation(eqn, inner, **params.call_params(eqn.params, inner.jaxpr))


def _jit_handler(eqn):
    inner = pull_jaxpr(params.jit_jaxpr(eqn.params))
    return extend_equation(eqn, inner, **params.jit_params(eqn.params, inner.jaxpr))


def _call_state(eqn, invals, threading):
    return threading.run(params.call_jaxpr(eqn.params), invals)


def _jit_state(eqn, invals, threading):
    return threading.run(params.jit_jaxpr(eqn.params), invals)


def _remat_state(eqn, invals, threading):
    jaxpr = params.call_jaxpr(eqn.params)
    writes, names = threading.uses(jaxpr).writes, threading.present(jaxpr)
    body = threading.threaded(jaxpr, names, writes)
    options = params.checkpoint_options(eqn.params)
    outs, new = jax.checkpoint(body, **options)(list(invals), threading.values(names))
    threading.update(new, writes)
    return outs


# A call runs its jaxpr and nothing else: selections reach into it, and it runs no Python.
_CALL = {"selectable": True, "runs_python": False}
# (`call_p` is `closed_call_p` since JAX 0.12: one primitive, one record.)
for _call in dict.fromkeys((closed_call_p, call_p)):
    register_handler(_call, _call_handler, thread_state=_call_state, **_CALL)
register_handler(REMAT_PRIMITIVE, _call_handler, thread_state=_remat_state, **_CALL)
register_handler(JIT_PRIMITIVE, _jit_handler, thread_state=_jit_state, **_CALL)

"""Handlers for `scan` (`lax.scan`, `lax.map`, `fori_loop` with a static trip count) and
`while` (`lax.while_loop`, `fori_loop` with a dynamic trip count).

`scan` reads `jaxpr`: the pulled body returns its intermediates as extra `ys`, so they leave
stacked along a new leading axis, in the same order as the scan's `ys` (also with
`reverse=True` and any `unroll`).

`while` reads `cond_jaxpr` and `body_jaxpr`. The loop is rewritten to carry, beside its own
state, the predicate, the last values of the body's intermediates (zeros before the first
iteration, so zeros if the body never ran) and those of `cond_fun`'s (its last evaluation,
the one that ended the loop). The predicate is computed once per iteration, at the end of the
body, and the new `cond_fun` only reads it.

Under `vmap`, both leave the loop before JAX batches it and are marked again outside: a scan's
intermediates come back with the batch axis first, then the scan axis; a while loop's with each
example's own last iteration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend.core.primitives import scan_p, while_p

from .._interpreter import pull_jaxpr, register_exposer


def _scan_exposer(*args, jaxpr, **params):
    body, metas = pull_jaxpr(jaxpr)
    flat = scan_p.bind(*args, jaxpr=body, **params)
    num_out = len(jaxpr.out_avals)
    return flat[:num_out], flat[num_out:], metas


register_exposer(scan_p, _scan_exposer)


def _while_exposer(*args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    cond_consts = args[:cond_nconsts]
    body_consts = args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    cond_fn, cond_metas = pull_jaxpr(cond_jaxpr)
    body_fn, body_metas = pull_jaxpr(body_jaxpr)
    n = len(init)

    def evaluate_cond(carry):
        pred, *leaves = jex.jaxpr_as_fun(cond_fn)(*cond_consts, *carry)
        return pred, leaves

    def body(state):
        carry, _, _, _ = state
        flat = jex.jaxpr_as_fun(body_fn)(*body_consts, *carry)
        new_carry, body_leaves = list(flat[:n]), list(flat[n:])
        pred, cond_leaves = evaluate_cond(new_carry)
        return new_carry, pred, body_leaves, cond_leaves

    pred, cond_leaves = evaluate_cond(init)
    body_leaves = [jnp.zeros(a.shape, a.dtype) for a in body_fn.out_avals[n:]]
    carry, _, body_leaves, cond_leaves = jax.lax.while_loop(
        lambda state: state[1], body, (list(init), pred, body_leaves, cond_leaves)
    )
    return carry, [*cond_leaves, *body_leaves], (*cond_metas, *body_metas)


register_exposer(while_p, _while_exposer)

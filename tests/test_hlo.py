"""Unpulled, `save_inter` is free: the optimised HLO equals the unmarked function's."""

import jax
import jax.numpy as jnp

import statax as stx
from statax.testing import hlo_ops


def marked(x, w):
    h = stx.save_inter(jnp.tanh(x @ w), name="h")
    stx.save_inter((h * 3, "tag"), name="dead")
    h = jax.jit(lambda a: stx.save_inter(a + 1, name="inner"))(h)
    z = jax.vmap(lambda r: stx.save_inter(r * 2, name="v"), in_axes=1, out_axes=1)(h)
    return jnp.sum(jnp.sin(z))


def plain(x, w):
    h = jnp.tanh(x @ w)
    h = jax.jit(lambda a: a + 1)(h)
    z = jax.vmap(lambda r: r * 2, in_axes=1, out_axes=1)(h)
    return jnp.sum(jnp.sin(z))


ARGS = (jnp.ones((8, 4)), jnp.ones((4, 4)))


def test_hlo_of_marked_function_equals_unmarked():
    assert hlo_ops(marked, *ARGS) == hlo_ops(plain, *ARGS)


def test_hlo_of_marked_gradient_equals_unmarked():
    assert hlo_ops(jax.grad(marked), *ARGS) == hlo_ops(jax.grad(plain), *ARGS)


def test_hlo_of_marked_checkpointed_gradient_equals_unmarked():
    assert hlo_ops(jax.grad(jax.checkpoint(marked)), *ARGS) == hlo_ops(
        jax.grad(jax.checkpoint(plain)), *ARGS
    )


def test_hlo_ops_sees_a_difference():
    assert hlo_ops(marked, *ARGS) != hlo_ops(lambda x, w: plain(x, w) + 1, *ARGS)

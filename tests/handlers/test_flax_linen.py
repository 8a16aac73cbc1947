"""Marks inside Flax Linen's own transforms, checked against the same values computed by hand."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import statax as stx
from statax.testing import assert_tree_allclose


class Cell(nn.Module):
    @nn.compact
    def __call__(self, h, x):
        h = jnp.tanh(nn.Dense(3)(h) + x)
        return stx.save_inter(h, name="h"), h


class Scanned(nn.Module):
    """An RNN as Flax writes one: the cell's parameters broadcast over the steps."""

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(
            Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=0, out_axes=0
        )
        return scan()(jnp.zeros(3), xs)


XS = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
PARAMS = Scanned().init(jax.random.PRNGKey(0), XS)


def by_hand(params, xs):
    """Every step's `h`, the scan written out."""
    dense = params["params"]["ScanCell_0"]["Dense_0"]

    def step(h, x):
        h = jnp.tanh(h @ dense["kernel"] + dense["bias"] + x)
        return h, h

    return jax.lax.scan(step, jnp.zeros(3), xs)[1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nn_scan_with_broadcast_params(jit):
    # Flax traces the body a second time to find the broadcast outputs, and refuses them if
    # they depend on the carry: a collecting mark must not make them (flax >= 0.12.9).
    apply = stx.pull(Scanned().apply)
    (_, ys), inters = (jax.jit(apply) if jit else apply)(PARAMS, XS)
    assert_tree_allclose(inters, {"h_0": by_hand(PARAMS, XS)}, rtol=1e-6)
    assert_tree_allclose(ys, by_hand(PARAMS, XS), rtol=1e-6)


def test_nn_scan_init_and_grad():
    (_, params), inters = stx.pull(
        lambda xs: Scanned().init_with_output(jax.random.PRNGKey(0), xs)
    )(XS)
    assert_tree_allclose(params, PARAMS)
    assert_tree_allclose(inters, {"h_0": by_hand(PARAMS, XS)}, rtol=1e-6)
    loss = lambda params: jnp.sum(Scanned().apply(params, XS)[1] ** 2)  # noqa: E731
    truth = jax.grad(lambda params: jnp.sum(by_hand(params, XS) ** 2))(PARAMS)
    grads, inters = stx.pull(jax.grad(loss))(PARAMS)
    assert_tree_allclose(grads, truth, rtol=1e-5)
    assert_tree_allclose(inters, {"h_0": by_hand(PARAMS, XS)}, rtol=1e-6)

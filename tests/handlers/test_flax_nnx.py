"""Flax NNX under `pull`: NNX's reference semantics kept (state updates reach the caller's
objects, as under `nnx.jit`), checked against the same code run unpulled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import statax as stx
from statax.testing import assert_tree_allclose


class Model(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        h = stx.save_inter(self.lin(x), name="h")
        h = self.drop(jax.nn.relu(self.bn(h)))
        return self.out(h)


def make():
    model = Model(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


X = jax.random.normal(jax.random.PRNGKey(2), (16, 4))
Y = jnp.sum(X, axis=1, keepdims=True)


def states_equal(a, b):
    def data(x):  # RNG keys compared by their bits
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    leaves = [jax.tree_util.tree_leaves(jax.tree_util.tree_map(data, nnx.state(m))) for m in (a, b)]
    assert len(leaves[0]) == len(leaves[1])
    for u, v in zip(*leaves, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["module", "method", "function"])
def test_module_call_updates_the_callers_module(how):
    pulled, plain = make()[0], make()[0]
    for _ in range(3):
        h = plain.lin(X)  # what the mark will hold, before the call updates anything
        expected = plain(X)
        if how == "module":
            out, inters = stx.pull(pulled)(X)
        elif how == "method":
            out, inters = stx.pull(pulled.__call__)(X)
        else:
            out, inters = stx.pull(lambda m, x: m(x))(pulled, X)
        np.testing.assert_allclose(out, expected, rtol=1e-6)  # a new dropout mask each call
        assert_tree_allclose(inters, {"h_0": h}, rtol=1e-6)
        states_equal(pulled, plain)  # BatchNorm statistics and RNG counters moved alike
    assert float(jnp.abs(nnx.state(plain, nnx.BatchStat)["bn"]["mean"][...]).sum()) > 0


@nnx.jit
def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_training_loop_with_an_nnx_jit_step_and_an_optimizer():
    (model, optimizer), (plain_model, plain_optimizer) = make(), make()
    pulled_step = stx.pull(train_step)
    for _ in range(4):
        truth = train_step(plain_model, plain_optimizer, X, Y)
        loss, inters = pulled_step(model, optimizer, X, Y)
        np.testing.assert_allclose(loss, truth, rtol=1e-6)
        assert set(inters) == {"h_0"} and inters["h_0"].shape == (16, 8)
        states_equal(model, plain_model)
        states_equal(optimizer, plain_optimizer)
    assert int(optimizer.step[...]) == 4

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core.primitives import closed_call_p

import statax as stx
from statax import _compat
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.4, -0.9, 1.3])


def block(x):
    h = stx.save_inter(jnp.tanh(x * 3), name="h")
    stx.save_inter(h * 0, name="dead")
    return jnp.sum(jnp.sin(h))


def block_ref(x):
    h = jnp.tanh(x * 3)
    return jnp.sum(jnp.sin(h)), {"h_0": h, "dead_0": h * 0}


POLICIES = [None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable]


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_collects_once_in_every_composition(policy):
    check_pull(jax.checkpoint(block, policy=policy), block_ref, X)


def test_checkpoint_of_grad_of_checkpoint():
    f = jax.checkpoint(jax.grad(jax.checkpoint(block)))
    assert_tree_allclose(stx.pull(jax.grad(lambda x: jnp.sum(f(x))))(X)[1], block_ref(X)[1])


def test_closed_call():
    inner = jax.make_jaxpr(lambda x: [stx.save_inter(x + 1, name="in_call")])(X)

    def f(x):
        # Bound as `eval_jaxpr` binds it: closed_call takes its function as a `subfun`.
        (y,) = _compat.bind(closed_call_p, [x], {"call_jaxpr": inner})
        return jnp.sum(y)

    assert_tree_allclose(stx.pull(f)(X), (jnp.sum(X + 1), {"in_call_0": X + 1}))
    assert_tree_allclose(stx.pull(jax.jit(f))(X), (jnp.sum(X + 1), {"in_call_0": X + 1}))


def test_named_call():
    def f(x):
        return jax.named_call(lambda y: stx.save_inter(y * 2, name="named"), name="scope")(x)

    assert_tree_allclose(stx.pull(f)(X), (X * 2, {"named_0": X * 2}))

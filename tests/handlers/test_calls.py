"""The call handlers (`statax/handlers/calls.py`): `jit`, `checkpoint`, `closed_call`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core.primitives import closed_call_p
from jax.sharding import NamedSharding, PartitionSpec

import statax as stx
from statax._jax import jaxprs as _compat
from statax.testing import assert_tree_allclose, check_pull


@jax.jit
def inner(x):
    return stx.save_inter(jnp.cos(x), name="inner") * 2


def nested(x):
    y = jax.jit(lambda z: inner(z) + stx.save_inter(z * 3, name="mid"))(x)
    return jnp.sum(stx.save_inter(y, name="outer"))


def nested_ref(x):
    y = jnp.cos(x) * 2 + x * 3
    return jnp.sum(y), {"inner_0": jnp.cos(x), "mid_0": x * 3, "outer_0": y}


X = jnp.array([0.5, 1.5, -2.0])


def test_nested_jits_in_every_composition():
    check_pull(nested, nested_ref, X)


def test_same_jitted_function_called_twice_gives_two_entries():
    def f(x):
        return inner(inner(x))

    _, inters = stx.pull(f)(X)
    assert_tree_allclose(inters, {"inner_0": jnp.cos(X), "inner_1": jnp.cos(2 * jnp.cos(X))})


def test_static_argnums():
    @functools.partial(jax.jit, static_argnums=1)
    def f(x, power):
        return stx.save_inter(x**power, name=f"pow{power}")

    assert_tree_allclose(stx.pull(f)(X, 2), (X**2, {"pow2_0": X**2}))
    assert_tree_allclose(stx.pull(f)(X, 3), (X**3, {"pow3_0": X**3}))


def test_donate_argnums():
    @functools.partial(jax.jit, donate_argnums=0)
    def f(x):
        stx.save_inter(x + 1, name="plus")
        return x * 2

    out, inters = stx.pull(f)(jnp.arange(4.0))
    assert_tree_allclose((out, inters), (jnp.arange(4.0) * 2, {"plus_0": jnp.arange(4.0) + 1}))


def test_in_and_out_shardings_are_kept():
    mesh = jax.make_mesh((4,), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))

    @functools.partial(jax.jit, in_shardings=sharding, out_shardings=sharding)
    def f(x):
        stx.save_inter(x * 2, name="h")
        return x + 1

    x = jax.device_put(jnp.arange(8.0), sharding)
    out, inters = stx.pull(f)(x)
    assert out.sharding == sharding
    assert_tree_allclose((out, inters), (x + 1, {"h_0": x * 2}))


def test_filter_jit_with_static_fields():
    @eqx.filter_jit
    def f(x, act):
        return stx.save_inter(act(x), name="act")

    assert_tree_allclose(stx.pull(f)(X, jax.nn.relu), (jax.nn.relu(X), {"act_0": jax.nn.relu(X)}))


def test_jitted_outputs_and_intermediates_are_device_arrays():
    out, inters = stx.pull(inner)(X)
    assert isinstance(inters["inner_0"], jax.Array)
    np.testing.assert_allclose(out, 2 * np.cos(X), rtol=1e-6)


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

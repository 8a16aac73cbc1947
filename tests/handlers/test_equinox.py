import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import pytest

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.4, -0.9, 1.3])


def test_filter_checkpoint():
    def f(x):
        return jnp.sum(eqx.filter_checkpoint(lambda y: stx.save_inter(jnp.sin(y), name="s"))(x))

    check_pull(f, lambda x: (jnp.sum(jnp.sin(x)), {"s_0": jnp.sin(x)}), X)


def body(c):
    return stx.save_inter(c * 1.5 + 0.1, name="b")


def cond(c):
    return c < 2.0


def loop_ref(x):
    c, last, steps = x, 0.0, []
    while c < 2.0:
        c = c * 1.5 + 0.1
        last = c
        steps.append(c)
    return c, last, steps


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
@pytest.mark.parametrize("x", [0.5, 3.0])  # 3.0: the body never runs
def test_equinox_while_loop_gives_last_iteration(kind, x):
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=16, kind=kind)

    c, last, _ = loop_ref(x)
    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        assert_tree_allclose(g(x), (c, {"b_0": last}))
    if kind == "checkpointed":
        grad, inters = jax.grad(stx.pull(f), has_aux=True)(x)
        assert_tree_allclose(inters, {"b_0": last})


def test_equinox_bounded_while_loop_gives_one_value_per_step():
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=16, kind="bounded")

    # A bounded loop is a scan of 16 steps, each a cond: a value per step, zeros where the
    # step did not run.
    c, _, steps = loop_ref(0.5)
    per_step = jnp.zeros(16).at[: len(steps)].set(jnp.array(steps))
    assert_tree_allclose(stx.pull(f)(0.5), (c, {"b_0": per_step}))
    assert_tree_allclose(stx.pull(jax.grad(f))(0.5)[1], {"b_0": per_step})


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_equinox_while_loop_under_vmap_orders_agree(kind):
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=8, kind=kind)

    xs = jnp.array([0.5, 1.9, 3.0])
    assert_tree_allclose(stx.pull(jax.vmap(f))(xs), jax.vmap(stx.pull(f))(xs))


def test_noinline():
    def g(x):
        return stx.save_inter(x * 3, name="n") + 1

    def f(x):
        return jnp.sum(eqxi.noinline(g)(x) * 2)

    def ref(x):
        return jnp.sum((x * 3 + 1) * 2), {"n_0": x * 3}

    check_pull(f, ref, X, transforms=("plain", "jit", "vmap", "grad"))
    # Unpulled, the call stays a noinline.
    assert any(e.primitive.name == "noinline" for e in jax.make_jaxpr(f)(X).eqns)

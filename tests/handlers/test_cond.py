import jax
import jax.numpy as jnp
import pytest
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.3, -1.2, 2.0])


def branch_a(x):
    h = stx.save_inter(jnp.sin(x), name="h")
    stx.save_inter(x * 2, name="only_a")
    return jnp.sum(h * x)


def branch_b(x):
    h = stx.save_inter(jnp.cos(x), name="h")
    stx.save_inter(x**2, name="h")
    return jnp.sum(h)


def f(x, p):
    return lax.cond(p, branch_a, branch_b, x)


def ref(x, p):
    zeros = jnp.zeros_like(x)
    a = (jnp.sum(jnp.sin(x) * x), {"h_0": jnp.sin(x), "only_a_0": x * 2, "h_1": zeros})
    b = (jnp.sum(jnp.cos(x)), {"h_0": jnp.cos(x), "only_a_0": zeros, "h_1": x**2})
    return jax.tree_util.tree_map(lambda u, v: jnp.where(p, u, v), a, b)


@pytest.mark.parametrize("p", [True, False])
def test_cond_returns_the_branch_that_ran_with_zeros_for_missing_slots(p):
    check_pull(f, ref, X, jnp.asarray(p))


def test_cond_slots_in_order_of_first_appearance_by_branch_index():
    # lax.cond's branch 0 is false_fun: its slots come first, then branch_a's new one.
    _, inters = stx.pull(f)(X, True)
    assert list(inters) == ["h_0", "h_1", "only_a_0"]


def test_cond_with_batched_predicate_gives_each_example_its_branch():
    ps = jnp.array([True, False, True, False])
    xs = jnp.arange(12.0).reshape(4, 3) / 7
    expected = jax.vmap(ref)(xs, ps)
    assert_tree_allclose(stx.pull(jax.vmap(f))(xs, ps), expected)
    assert_tree_allclose(jax.vmap(stx.pull(f))(xs, ps), expected)
    assert_tree_allclose(stx.pull(jax.jit(jax.vmap(f)))(xs, ps), expected)


def test_switch():
    def g(x, i):
        return lax.switch(i, [lambda x, k=k: stx.save_inter(x + k, name="k") for k in range(3)], x)

    def g_ref(x, i):
        return x + jnp.clip(i, 0, 2), {"k_0": x + jnp.clip(i, 0, 2)}

    for i in range(3):
        check_pull(g, g_ref, X, jnp.int32(i), transforms=("plain", "jit", "vmap", "jacfwd"))


def test_cond_with_unused_output_under_grad_keeps_its_marks():
    def g(x):
        lax.cond(x > 0, lambda y: stx.save_inter(y * 3, name="c"), lambda y: y, x)
        return x * x

    assert_tree_allclose(stx.pull(jax.grad(g))(2.0), (4.0, {"c_0": 6.0}))


def test_branches_saving_different_shapes_is_an_error_naming_both_sites():
    def g(x):
        return lax.cond(
            x[0] > 0,
            lambda y: stx.save_inter(y, name="v")[0],
            lambda y: stx.save_inter(y[:2], name="v")[0],
            x,
        )

    with pytest.raises(
        stx.BranchMismatchError, match=r"(?s)'v'.*test_cond.py:\d+.*test_cond.py:\d+"
    ):
        stx.pull(g)(X)


def test_branches_saving_different_structures_is_an_error():
    def g(x):
        return lax.cond(
            x[0] > 0,
            lambda y: stx.save_inter((y, y), name="v")[0],
            lambda y: stx.save_inter([y, y], name="v")[0],
            x,
        )

    with pytest.raises(stx.BranchMismatchError, match="different names"):
        stx.pull(g)(X)


@pytest.mark.fast_paths
def test_cond_without_marks_is_left_alone():
    def g(x):
        return stx.save_inter(lax.cond(x > 0, jnp.sin, jnp.cos, x), name="after")

    def by_hand(x):
        y = lax.cond(x > 0, jnp.sin, jnp.cos, x)
        return y, {"after_0": y}

    # Traced, `pull(g)` stages exactly what returning the mark by hand does.
    assert str(jax.make_jaxpr(stx.pull(g))(1.0)) == str(jax.make_jaxpr(by_hand)(1.0))
    assert_tree_allclose(stx.pull(g)(1.0), (jnp.sin(1.0), {"after_0": jnp.sin(1.0)}))

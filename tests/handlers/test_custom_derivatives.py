import jax
import jax.numpy as jnp
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.4, -0.9, 1.3])


@jax.custom_jvp
def soft(x):
    return jnp.sum(jnp.sin(stx.save_inter(x * 2, name="primal")))


@soft.defjvp
def _soft_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Deliberately not the derivative of soft: 100 * sum(t).
    return soft(x), 100.0 * jnp.sum(t)


def soft_ref(x):
    return jnp.sum(jnp.sin(x * 2)), {"primal_0": x * 2}


def test_custom_jvp_values_and_custom_rule():
    check_pull(soft, soft_ref, X, transforms=("plain", "jit", "vmap", "filter_jit"))
    for g in (stx.pull(jax.grad(soft)), jax.grad(stx.pull(soft), has_aux=True)):
        grad, inters = g(X)
        assert_tree_allclose(grad, jnp.full(3, 100.0))  # the custom rule, not autodiff
        assert_tree_allclose(inters, {"primal_0": X * 2})


@jax.custom_vjp
def clip_grad(x):
    return jnp.sum(stx.save_inter(jnp.tanh(x), name="primal"))


def _fwd(x):
    y = jnp.tanh(x)
    stx.save_inter(y * 10, name="fwd")
    return jnp.sum(y), x


def _bwd(x, g):
    stx.save_inter(g * 3, name="bwd")
    return (jnp.full_like(x, 7.0) * g,)  # deliberately not autodiff


clip_grad.defvjp(_fwd, _bwd)


def test_custom_vjp_values_of_primal_fwd_and_bwd():
    out, inters = stx.pull(clip_grad)(X)
    assert_tree_allclose(inters, {"primal_0": jnp.tanh(X)})
    assert_tree_allclose(stx.pull(jax.jit(clip_grad))(X)[1], {"primal_0": jnp.tanh(X)})
    # Under an inner grad: what JAX runs, fwd and bwd.
    grad, inters = stx.pull(jax.grad(clip_grad))(X)
    assert_tree_allclose(grad, jnp.full(3, 7.0))
    assert_tree_allclose(inters, {"fwd_0": jnp.tanh(X) * 10, "bwd_0": 3.0})
    # Outer grad: the custom rule still governs; the primal's values come out.
    grad, inters = jax.grad(stx.pull(clip_grad), has_aux=True)(X)
    assert_tree_allclose(grad, jnp.full(3, 7.0))
    assert_tree_allclose(inters, {"primal_0": jnp.tanh(X)})


def test_custom_vjp_under_vmap_both_orders():
    xs = jnp.stack([X, X * 2])
    expected = {"primal_0": jnp.tanh(xs)}
    assert_tree_allclose(stx.pull(jax.vmap(clip_grad))(xs)[1], expected)
    assert_tree_allclose(jax.vmap(stx.pull(clip_grad))(xs)[1], expected)


def test_nested_pull_does_not_collect_custom_derivative_marks_twice():
    def outer(x):
        y, inters = stx.pull(soft)(x)
        return y + inters["primal_0"].sum()

    assert stx.pull(outer)(X)[1] == {}


def test_custom_root():
    def f(x):
        def solve(g, y0):
            return stx.save_inter(y0 * 0 + x, name="root")

        return lax.custom_root(lambda y: y - x, x, solve, lambda g, y: y)

    assert_tree_allclose(stx.pull(f)(X), (X, {"root_0": X}))
    assert_tree_allclose(stx.pull(jax.jit(f))(X), (X, {"root_0": X}))

"""The `custom_linear_solve` handler (`statax/handlers/solves.py`) against hand-written
solves: the forward solve's marks (and its matvec's) are collected once, and derivatives are
the equation's own (its implicit rule), in both orders."""

import jax
import jax.numpy as jnp
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.4, -0.9, 1.3])
A = jnp.array([[3.0, 1.0, 0.0], [1.0, 4.0, 1.0], [0.0, 1.0, 5.0]])


def test_custom_linear_solve_collects_the_solve():
    def f(b):
        def solve(matvec, b):
            return stx.save_inter(b / 2, name="solve")

        return jnp.sum(lax.custom_linear_solve(lambda x: 2 * x, b, solve, symmetric=True))

    def ref(b):
        return jnp.sum(b / 2), {"solve_0": b / 2}

    check_pull(f, ref, X, transforms=("plain", "jit", "vmap", "filter_jit"))
    grad, inters = jax.grad(stx.pull(f), has_aux=True)(X)
    assert_tree_allclose((grad, inters), (jnp.full(3, 0.5), {"solve_0": X / 2}))
    # Under an inner grad the transposed solve runs too, and is collected where it runs.
    grad, inters = stx.pull(jax.grad(f))(X)
    assert_tree_allclose((grad, inters["solve_0"]), (jnp.full(3, 0.5), X / 2))


def _jacobi(matvec, b, steps=60):
    """A solve that calls matvec, marking each residual: the marks of `matvec` and `solve`."""
    diag = jnp.diag(A)

    def step(x, _):
        r = stx.save_inter(b - matvec(x), name="residual")
        return x + r / diag, None

    return lax.scan(step, jnp.zeros_like(b), None, length=steps)[0]


def _jacobi_by_hand(b, steps=60):
    diag = jnp.diag(A)

    def step(x, _):
        r = b - A @ x
        return x + r / diag, r

    return lax.scan(step, jnp.zeros_like(b), None, length=steps)


def test_a_solve_that_calls_matvec():
    def f(b):
        matvec = lambda x: stx.save_inter(A @ x, name="Ax")  # noqa: E731
        return lax.custom_linear_solve(matvec, b, _jacobi, symmetric=True)

    def ref(b):
        x, residuals = _jacobi_by_hand(b)
        # Each iteration's matvec, then its residual; a scan stacks both.
        xs = lax.scan(lambda x, _: (x + (b - A @ x) / jnp.diag(A), x), jnp.zeros_like(b), None, 60)
        return x, {"Ax_0": xs[1] @ A.T, "residual_0": residuals}

    check_pull(f, ref, X, transforms=("plain", "jit", "vmap"))
    # The solve converged: its output is A^-1 b, and so is the derivative the rule gives.
    out, _ = stx.pull(f)(X)
    assert_tree_allclose(out, jnp.linalg.solve(A, X), rtol=1e-4)
    for grad in (
        jax.grad(lambda b: stx.pull(f)(b)[0].sum())(X),
        jax.grad(lambda b: f(b).sum())(X),
    ):
        assert_tree_allclose(grad, jnp.linalg.solve(A.T, jnp.ones(3)), rtol=1e-4)

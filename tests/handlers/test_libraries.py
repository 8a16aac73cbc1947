"""Marks in user code that real libraries call: lineax, diffrax, optimistix.

Each test checks what `pull` returns against what the library itself does (its outputs, its
statistics, the operator it was given), and that pulling changes neither outputs nor
derivatives nor the number of loops in the compiled program.
"""

import re

import diffrax
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose

A = jnp.array([[4.0, 1, 0], [1, 3, 0.5], [0, 0.5, 2]])
B = jnp.array([1.0, 2, 3])


def count_ops(fn, *args, op: str) -> int:
    """How many `op` instructions the compiled (optimised) program of `fn` has: for loops,
    which XLA never merges or duplicates."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(rf" {op}\(", text))


def count_eqns(fn, *args, primitive: str) -> int:
    """How many `primitive` equations the program of `fn` has, at any depth: what statax hands
    to XLA (whose fusion may copy a cheap elementwise op into several fusions)."""
    return len(re.findall(rf"= {primitive}\b", str(jax.make_jaxpr(fn)(*args))))


# ---- lineax: an equinox filter primitive, whose matvec is Python code in its params -------------


def lineax_solve(a, b, solver, closed_over):
    """`a @ x = b` through a `FunctionLinearOperator` whose matvec is marked. With
    `closed_over`, the matvec closes over the constant `A` rather than the argument `a`."""
    matrix = A if closed_over else a

    def matvec(x):
        stx.save_inter(x, name="x")
        return stx.save_inter(matrix @ x, name="Ax")

    struct = jax.ShapeDtypeStruct((3,), jnp.float32)
    op = lx.FunctionLinearOperator(matvec, struct, tags=lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, solver=solver).value


SOLVERS = {"CG": lx.CG(rtol=1e-6, atol=1e-6), "LU": lx.LU()}


@pytest.mark.parametrize("closed_over", [True, False], ids=["constant", "traced"])
@pytest.mark.parametrize("solver", SOLVERS, ids=str)
def test_lineax_matvec_marks_come_back(solver, closed_over):
    def f(a, b):
        return lineax_solve(a, b, SOLVERS[solver], closed_over)

    expected = jnp.linalg.solve(A, B)
    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        x, inters = g(A, B)
        np.testing.assert_allclose(x, expected, rtol=1e-5)
        # Every matvec the solver ran is there, each the product of A and what lineax passed.
        keys = sorted(inters)
        n = len(keys) // 2
        assert n >= 1 and keys == sorted(
            [f"x_{i}" for i in range(n)] + [f"Ax_{i}" for i in range(n)]
        )
        for i in range(n):
            xi = inters[f"x_{i}"]
            np.testing.assert_allclose(inters[f"Ax_{i}"], xi @ A.T, rtol=1e-5, atol=1e-6)
    if solver == "LU":  # LU materialises the operator: A times the identity, once
        np.testing.assert_allclose(inters["x_0"], jnp.eye(3))
        np.testing.assert_allclose(inters["Ax_0"], A.T)
    # The solve is the library's: same derivatives (lineax's implicit rule), in both orders.
    loss = lambda a, b: jnp.sum(f(a, b) ** 2)  # noqa: E731
    truth = jax.grad(loss, argnums=(0, 1))(A, B)
    outside, _ = jax.grad(
        lambda a, b: (jnp.sum(stx.pull(f)(a, b)[0] ** 2), None), argnums=(0, 1), has_aux=True
    )(A, B)
    inside, _ = stx.pull(jax.grad(loss, argnums=(0, 1)))(A, B)
    assert_tree_allclose(outside, truth, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(inside, truth, rtol=1e-4, atol=1e-5)
    # vmap in both orders agrees.
    bs = jnp.stack([B, 2 * B])
    one = jax.vmap(stx.pull(f), in_axes=(None, 0))(A, bs)
    other = stx.pull(jax.vmap(f, in_axes=(None, 0)))(A, bs)
    np.testing.assert_allclose(one[0], other[0], rtol=1e-5)
    for key, value in other[1].items():
        np.testing.assert_allclose(
            one[1][key], jnp.broadcast_to(value, one[1][key].shape), atol=1e-5
        )
    # And the compiled program has as many loops as the unpulled one.
    assert count_ops(stx.pull(f), A, B, op="while") == count_ops(f, A, B, op="while")


# ---- custom derivatives: the pulled program does the work of the unpulled one -------------------


def test_custom_vjp_around_a_loop_runs_it_once():
    @jax.custom_vjp
    def loop(x):
        def body(c):
            return stx.save_inter(jnp.sin(c[0]), name="s"), c[1] + 1

        return lax.while_loop(lambda c: c[1] < 10, body, (x, 0))[0]

    loop.defvjp(lambda x: (loop(x), x), lambda x, g: (g * jnp.cos(x),))
    x = jnp.array([0.3, 1.0])
    last = x
    for _ in range(10):
        last = jnp.sin(last)
    out, inters = stx.pull(loop)(x)
    assert_tree_allclose((out, inters), (last, {"s_0": last}))
    assert count_ops(stx.pull(loop), x, op="while") == count_ops(loop, x, op="while") == 1
    # The custom rule still governs derivatives.
    g, _ = jax.grad(lambda x: (jnp.sum(stx.pull(loop)(x)[0]), None), has_aux=True)(x)
    np.testing.assert_allclose(g, jnp.cos(x))


def vector_field(t, y, k):
    stx.save_inter(jnp.ones((), jnp.int32), name="evals", reduce="sum")
    return stx.save_inter(-k * jnp.sin(y), name="vf")


def diffrax_solve(y0, k, adjoint=None):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
        args=k,
        adjoint=adjoint or diffrax.RecursiveCheckpointAdjoint(),
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
    )
    return sol.ys[-1], sol.stats["num_steps"]


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(diffrax.RecursiveCheckpointAdjoint(), marks=pytest.mark.exhaustive),
        pytest.param(diffrax.BacksolveAdjoint(), marks=pytest.mark.exhaustive),
    ],
    ids=lambda a: type(a).__name__,
)
def test_diffrax_vector_field(adjoint):
    y0, k = jnp.array([1.0, 2.0]), 3.0
    solve = lambda y0, k: diffrax_solve(y0, k, adjoint)  # noqa: E731
    (y1, steps), inters = stx.pull(solve)(y0, k)
    truth_y1, truth_steps = solve(y0, k)
    np.testing.assert_allclose(y1, truth_y1, rtol=1e-5)  # XLA may fuse differently
    assert int(steps) == int(truth_steps)
    assert set(inters) == {"evals", "vf_0"}
    # Tsit5 is FSAL: one evaluation to start, then six per step; the last is at (t1, y1).
    assert int(inters["evals"]) == 1 + 6 * int(steps)
    np.testing.assert_allclose(inters["vf_0"], -k * jnp.sin(y1), rtol=1e-5)
    # As many loops and vector-field evaluations in the compiled program as unpulled.
    assert count_ops(stx.pull(solve), y0, k, op="while") == count_ops(solve, y0, k, op="while")
    assert count_eqns(stx.pull(solve), y0, k, primitive="sin") == 1
    assert count_eqns(solve, y0, k, primitive="sin") == 1
    # Derivatives are diffrax's (its adjoint's), in both orders.
    loss = lambda y0, k: jnp.sum(solve(y0, k)[0])  # noqa: E731
    truth = jax.grad(loss, argnums=(0, 1))(y0, k)
    outside, _ = jax.grad(
        lambda y0, k: (jnp.sum(stx.pull(solve)(y0, k)[0][0]), None), argnums=(0, 1), has_aux=True
    )(y0, k)
    assert_tree_allclose(outside, truth, rtol=1e-5)
    assert_tree_allclose(stx.pull(jax.grad(loss, argnums=(0, 1)))(y0, k)[0], truth, rtol=1e-5)


def residual(y, a):
    return stx.save_inter(jnp.tanh(y) - a, name="r")


def newton(a):
    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(residual, solver, jnp.zeros_like(a), args=a).value


def test_optimistix_residual():
    a = jnp.linspace(-0.5, 0.5, 8)
    y, inters = stx.pull(newton)(a)
    np.testing.assert_allclose(y, jnp.arctanh(a), rtol=1e-5, atol=1e-6)
    # r_0: the residual at the last Newton iterate evaluated. optimistix's implicit-function
    # JVP rule evaluates the residual again, but runs only where `newton` is differentiated:
    # undifferentiated, the pull has no key for it.
    assert set(inters) == {"r_0"}
    assert set(stx.pull(jax.jit(newton))(a)[1]) == set(jax.jit(stx.pull(newton))(a)[1]) == {"r_0"}
    assert float(jnp.max(jnp.abs(inters["r_0"]))) < 1e-4
    # As many residual evaluations compiled as unpulled: the rule's marks are not computed
    # where the rule does not run (its program is traced, for their types, and compiled away).
    assert count_ops(stx.pull(newton), a, op="tanh") == count_ops(newton, a, op="tanh")
    assert count_ops(stx.pull(newton), a, op="while") == count_ops(newton, a, op="while")
    g, inters = jax.grad(
        lambda a: (lambda out, inters: (jnp.sum(out), inters))(*stx.pull(newton)(a)), has_aux=True
    )(a)
    np.testing.assert_allclose(g, 1 / (1 - a**2), rtol=1e-4)
    # Differentiated, the rule runs: its marks are the residual at the root, in every order.
    assert set(inters) == {"r_0", "r_1", "r_2"}
    for key in ("r_1", "r_2"):
        np.testing.assert_allclose(inters[key], jnp.tanh(y) - a, atol=1e-6)
    (_, jvp_inters), _ = jax.jvp(stx.pull(newton), (a,), (jnp.ones_like(a),))
    _, inside = stx.pull(lambda a: jax.jvp(newton, (a,), (jnp.ones_like(a),)))(a)
    assert set(jvp_inters) == set(inside) == {"r_0", "r_1", "r_2"}
    assert_tree_allclose(jvp_inters, inside, atol=1e-6)


def quadratic(y, a):
    return stx.save_inter(jnp.sum((y - a) ** 2), name="f")


def fixed_point(y, a):
    return stx.save_inter(0.5 * (y + a), name="g")


def least_squares(y, a):
    return stx.save_inter(y - a, name="res")


OPTIMISTIX = {
    "BFGS": lambda a: optx.minimise(quadratic, optx.BFGS(rtol=1e-6, atol=1e-6), a * 0, args=a),
    "NCG": lambda a: optx.minimise(
        quadratic, optx.NonlinearCG(rtol=1e-6, atol=1e-6), a * 0, args=a
    ),
    "GaussNewton": lambda a: optx.least_squares(
        least_squares, optx.GaussNewton(rtol=1e-6, atol=1e-6), a * 0, args=a
    ),
    "FixedPoint": lambda a: optx.fixed_point(
        fixed_point, optx.FixedPointIteration(rtol=1e-6, atol=1e-6), a * 0, args=a
    ),
}


@pytest.mark.parametrize("solve", OPTIMISTIX.values(), ids=OPTIMISTIX)
def test_optimistix_solvers_key_their_implicit_rule_only_where_it_runs(solve):
    a = jnp.linspace(-0.5, 0.5, 4)
    run = lambda a: solve(a).value  # noqa: E731
    y, inters = stx.pull(run)(a)
    np.testing.assert_allclose(y, a, atol=1e-4)
    (name,) = {key.rsplit("_", 1)[0] for key in inters}
    assert list(inters) == [f"{name}_0"]  # the last evaluation; the rule did not run
    _, differentiated = jax.grad(
        lambda a: (lambda out, inters: (jnp.sum(out), inters))(*stx.pull(run)(a)), has_aux=True
    )(a)
    assert len(differentiated) > 1 and set(inters) < set(differentiated)
    by_hand = {"f": quadratic, "g": fixed_point, "res": least_squares}[name](y, a)
    for key in sorted(differentiated)[1:]:  # the rule evaluates the function at the solution
        np.testing.assert_allclose(differentiated[key], by_hand, atol=1e-4)


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(diffrax.RecursiveCheckpointAdjoint(), marks=pytest.mark.exhaustive),
        pytest.param(diffrax.BacksolveAdjoint(), marks=pytest.mark.exhaustive),
        diffrax.DirectAdjoint(),  # a bounded while loop inside equinox
    ],
    ids=lambda a: type(a).__name__,
)
def test_diffrax_under_vmap_is_per_example_and_the_same_for_every_adjoint(adjoint):
    # Two examples that end at different times, with a constant step: each takes its own
    # number of steps, and so makes its own number of vector-field evaluations (Tsit5 is FSAL:
    # one to start, then six per step), although vmap runs both until both are done.
    y0, k, t1s = jnp.array([1.0, 2.0]), 3.0, jnp.array([0.3, 2.0])

    def solve(t1, adjoint):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field), diffrax.Tsit5(), 0.0, t1, 0.1, y0, args=k,
            adjoint=adjoint, saveat=diffrax.SaveAt(t1=True),
        )  # fmt: skip
        return sol.ys[-1], sol.stats["num_steps"]

    f = lambda t1: solve(t1, adjoint)  # noqa: E731
    truth_y1, truth_steps = jax.vmap(f)(t1s)
    np.testing.assert_array_equal(truth_steps, [3, 20])
    for g in (stx.pull(jax.vmap(f)), jax.vmap(stx.pull(f))):
        (y1, steps), inters = g(t1s)
        np.testing.assert_allclose(y1, truth_y1, rtol=1e-5)
        np.testing.assert_array_equal(inters["evals"], [1 + 6 * 3, 1 + 6 * 20])
        assert inters["vf_0"].shape == (2, 2)  # (batch, *y's shape), for every adjoint
        np.testing.assert_allclose(inters["vf_0"], -k * jnp.sin(y1), rtol=1e-5)


@pytest.mark.parametrize("solver", [diffrax.Heun(), diffrax.Tsit5()], ids=type)
def test_diffrax_adaptive_steps_under_vmap_count_each_examples_own_work(solver):
    # An adaptive step size: each example takes its own number of steps, accepted and
    # rejected, as diffrax's own statistics say. Heun evaluates the vector field twice per step,
    # so each example's count is exactly that, alone and under vmap in both orders. Tsit5 is
    # FSAL: under vmap diffrax re-evaluates the first stage of every example wherever one
    # example needs it (a batch-wide `unvmap_any`), so an example may count more than alone:
    # what the batched program computed for it (see the semantics page).
    def run(k):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field), solver, 0.0, 2.0, 0.1, jnp.array([1.0, 2.0]),
            args=k, saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
        )  # fmt: skip
        return sol.stats["num_steps"], sol.stats["num_rejected_steps"]

    ks = jnp.array([0.5, 40.0])
    alone = [stx.pull(run)(k) for k in ks]
    assert int(alone[1][0][1]) > 0  # the stiff example has rejected steps
    for g in (stx.pull(jax.vmap(run)), jax.vmap(stx.pull(run))):
        (steps, _), inters = g(ks)
        assert int(steps[0]) < int(steps[1])
        if isinstance(solver, diffrax.Heun):
            np.testing.assert_array_equal(inters["evals"], 2 * steps)
            np.testing.assert_array_equal(inters["evals"], [a[1]["evals"] for a in alone])
        else:  # one evaluation to start, six per step, and the batch-wide re-evaluations
            assert np.all(inters["evals"] >= 1 + 6 * steps)
            assert np.all(inters["evals"] - (1 + 6 * steps) <= steps)


def event_condition(t, y, args, **kwargs):
    return stx.save_inter(y[0] - 0.5, name="ev")


def solve_to_event(y0):
    root_finder = optx.Newton(rtol=1e-6, atol=1e-6)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: -y), diffrax.Tsit5(), 0.0, 5.0, 0.1, y0,
        event=diffrax.Event(event_condition, root_finder=root_finder),
    )  # fmt: skip
    return sol.ts[-1], sol.ys[-1]


@pytest.mark.exhaustive
def test_diffrax_event_keys_its_root_finders_rule_only_where_it_runs():
    y0 = jnp.array([1.0, 2.0])
    (t, y), inters = stx.pull(solve_to_event)(y0)
    np.testing.assert_allclose(t, jnp.log(2.0), rtol=1e-5)
    assert set(inters) == {"ev_0", "ev_1", "ev_2"}  # what the solve and its root finder ran
    _, differentiated = jax.grad(
        lambda y0: (lambda out, inters: (out[0], inters))(*stx.pull(solve_to_event)(y0)),
        has_aux=True,
    )(y0)
    assert set(differentiated) == {"ev_0", "ev_1", "ev_2", "ev_3", "ev_4"}
    for key in ("ev_3", "ev_4"):  # the implicit rule, at the event: the condition is zero
        np.testing.assert_allclose(differentiated[key], 0.0, atol=1e-5)


@pytest.mark.exhaustive
def test_a_bounded_loop_is_a_while_loop_in_every_order():
    # diffrax's DirectAdjoint runs a "bounded" equinox loop: nested scans of conds, whose
    # forward pass under `grad` has lost a carry to dead-code elimination. It is still a while
    # loop: the last vector-field evaluation, of y's shape, whatever the order.
    def loss(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=3.0,
            adjoint=diffrax.DirectAdjoint(), saveat=diffrax.SaveAt(t1=True), max_steps=16,
        )  # fmt: skip
        return jnp.sum(sol.ys)

    y0 = jnp.array([1.0, 2.0])
    _, plain = stx.pull(loss)(y0)
    grad, inside = stx.pull(jax.grad(loss))(y0)
    outside_grad, outside = jax.grad(stx.pull(loss), has_aux=True)(y0)
    assert {k: v.shape for k, v in inside.items()} == {"evals": (), "vf_0": (2,)}
    assert_tree_allclose(inside, plain, rtol=1e-5)
    assert_tree_allclose(outside, plain, rtol=1e-5)
    assert_tree_allclose(grad, jax.grad(loss)(y0), rtol=1e-5)
    assert_tree_allclose(outside_grad, grad, rtol=1e-5)

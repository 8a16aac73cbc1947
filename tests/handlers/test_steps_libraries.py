"""Every step of a solver (`pull(fn, steps=...)`): diffrax's steps and stages, optimistix's
Newton iterates and equinox's while loops, against the iterations run by hand and what the
libraries report themselves."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

import statax as stx


def vector_field(t, y, k):
    return stx.save_inter(-k * jnp.sin(y), name="vf")


def solve(y0, k, solver=None, controller=None, dt0=0.1, t1=1.0):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field), solver or diffrax.Tsit5(), 0.0, t1, dt0, y0, args=k,
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=controller or diffrax.PIDController(rtol=1e-5, atol=1e-5),
    )  # fmt: skip
    return sol.ys[-1], sol.stats["num_steps"]


def test_diffrax_euler_every_step_as_by_hand():
    y0, k = jnp.array([1.0, 2.0]), 3.0
    fixed = lambda y0, k: solve(y0, k, diffrax.Euler(), diffrax.ConstantStepSize())  # noqa: E731
    (y1, steps), inters = stx.pull(fixed, steps=16, ran=True)(y0, k)
    y, rows = np.asarray(y0), []
    for _ in range(10):  # t from 0 to 1 by 0.1
        rows.append(-k * np.sin(y))
        y = y + 0.1 * rows[-1]
    assert int(steps) == 10
    np.testing.assert_allclose(y1, y, rtol=1e-5)
    np.testing.assert_allclose(inters["vf_0"][:10], rows, rtol=1e-5)
    np.testing.assert_array_equal(inters["vf_0.ran"], np.arange(16) < 10)
    np.testing.assert_array_equal(inters["vf_0"][10:], 0.0)


def test_diffrax_adaptive_steps_then_stages_as_two_axes():
    y0, k = jnp.array([1.0, 2.0]), 3.0
    (y1, steps), inters = stx.pull(solve, steps=(16, 8), ran=True)(y0, k)
    ran = np.asarray(inters["vf_0.ran"])
    assert inters["vf_0"].shape == (16, 8, 2)
    # One row per step diffrax counts (accepted and rejected), each with Tsit5's stages: the
    # first step also evaluates the first stage (FSAL), the others reuse the step before's.
    assert ran.any(1).sum() == int(steps) == int(solve(y0, k)[1])
    np.testing.assert_array_equal(ran.sum(1)[: int(steps)], [7] + [6] * (int(steps) - 1))
    # The last stage of the last step is the vector field at the solution.
    last = inters["vf_0"][int(steps) - 1, 5]
    np.testing.assert_allclose(last, -k * jnp.sin(y1), rtol=1e-5)
    # One value per step: the stages' last.
    _, per_step = stx.pull(solve, steps=(16, None))(y0, k)
    np.testing.assert_allclose(per_step["vf_0"], inters["vf_0"][:, -1] * 0 + _last_stage(inters))
    # Under vmap, each example its own count, as diffrax's own statistics say.
    ks = jnp.array([0.5, 40.0])
    for f in (jax.vmap(stx.pull(solve, steps=(64, 8), ran=True), (None, 0)),):
        (_, counts), batched = f(y0, ks)
        np.testing.assert_array_equal(np.asarray(batched["vf_0.ran"]).any(2).sum(1), counts)
        assert int(counts[0]) < int(counts[1])


def _last_stage(inters):
    """Each step's last stage that ran (zeros where no step ran)."""
    ran = np.asarray(inters["vf_0.ran"])
    last = np.maximum(ran.sum(1) - 1, 0)
    values = np.asarray(inters["vf_0"])[np.arange(len(ran)), last]
    return np.where(ran.any(1)[:, None], values, 0.0)


def residual(y, a):
    return stx.save_inter(jnp.tanh(y) - a, name="r")


def newton(a):
    sol = optx.root_find(residual, optx.Newton(rtol=1e-6, atol=1e-6), jnp.zeros_like(a), args=a)
    return sol.value, sol.stats["num_steps"]


@pytest.mark.parametrize("jit", [False, True])
def test_optimistix_every_newton_iterate_as_by_hand(jit):
    a = jnp.linspace(-0.5, 0.5, 4)
    f = jax.jit(newton) if jit else newton
    (y, n), inters = stx.pull(f, steps=16, ran=True)(a)
    y_hand, rows = np.zeros(4, np.float32), []
    for _ in range(int(n)):
        rows.append(np.tanh(y_hand) - np.asarray(a))
        y_hand = y_hand - rows[-1] / (1 - np.tanh(y_hand) ** 2)
    np.testing.assert_allclose(y, y_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inters["r_0"][: int(n)], rows, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(inters["r_0.ran"], np.arange(16) < int(n))


def _equinox_loop(x, kind, base=16):
    def body(c):
        i, v = c
        return i + 1, stx.save_inter(jnp.sin(v) + v, name="v")

    options = {"base": base} if kind == "bounded" else {}
    return eqx.internal.while_loop(
        lambda c: c[0] < jnp.sum(x > 0) + 1, body, (0, x), max_steps=8, kind=kind, **options
    )[1]


def _by_hand(x, zeroed=None):
    """The loop in Python; `zeroed`: the iteration whose value is replaced by zeros."""
    rows, v = np.zeros((8, *x.shape), np.float32), np.asarray(x)
    for i in range(int(np.sum(np.asarray(x) > 0)) + 1):
        v = np.sin(v) + v if i != zeroed else np.zeros_like(v)
        rows[i] = v
    return v, rows


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded", "bounded, base 2"])
def test_equinox_while_loops_eagerly_jitted_vmapped_and_differentiated(kind):
    # ("bounded": nested scans of conds inside equinox; base 2: three levels for 8 steps)
    x = jnp.array([0.5, -1.0, 2.0])
    base = 2 if kind.endswith("base 2") else 16
    kind = kind.split(",")[0]
    f = lambda x: _equinox_loop(x, kind, base)  # noqa: E731
    for pulled in (stx.pull(f, steps=8), jax.jit(stx.pull(f, steps=8))):
        out, inters = pulled(x)
        want_out, rows = _by_hand(x)
        np.testing.assert_allclose(out, want_out, rtol=1e-6)
        np.testing.assert_allclose(inters["v_0"], rows, rtol=1e-6)
    # Planted back, rows reproduce the run; a hook given equinox's step edits one iteration.
    np.testing.assert_allclose(stx.plant(f, steps=8)(inters, x), out, rtol=1e-6)
    edit = lambda v, step: jnp.where(step == 1, 0.0, v)  # noqa: E731
    np.testing.assert_allclose(stx.plant(f)({"v": edit}, x), _by_hand(x, 1)[0], rtol=1e-6)
    xs = jnp.array([[0.5, -1.0, 2.0], [-0.5, -1.0, -2.0]])
    _, batched = jax.vmap(stx.pull(f, steps=8, ran=True))(xs)
    np.testing.assert_allclose(batched["v_0"], [_by_hand(x)[1] for x in xs], rtol=1e-6)
    np.testing.assert_array_equal(batched["v_0.ran"].sum(1), [3, 1])
    if kind != "lax":  # (reverse mode through equinox's checkpointed and bounded loops)
        loss = lambda x: jnp.sum(f(x))  # noqa: E731
        g, inters = stx.pull(jax.grad(loss), steps=8)(x)
        np.testing.assert_allclose(g, jax.grad(loss)(x), rtol=1e-6)
        np.testing.assert_allclose(inters["v_0"], _by_hand(x)[1], rtol=1e-6)


def test_equinox_bounded_loops_past_the_bound_raise():
    x = jnp.array([0.5, -1.0, 2.0])  # three iterations
    with pytest.raises(Exception, match="kind 'bounded'.* ran more iterations than the 2 rows"):
        stx.pull(lambda x: _equinox_loop(x, "bounded", 2), steps=2)(x)
    out, inters = stx.pull(lambda x: _equinox_loop(x, "bounded"))(x)  # (no steps: the last)
    np.testing.assert_allclose(inters["v_0"], _by_hand(x)[0], rtol=1e-6)

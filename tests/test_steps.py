"""Every iteration of a `while_loop` (`pull(fn, steps=N)`), against the loops run by hand."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

N = 5  # the bound the tests keep


def _loop(x, steps_taken):
    """`x` doubled and shifted while its count is below `steps_taken` (traced), with marks in
    `cond_fun` and `body_fun`."""

    def cond(c):
        stx.save_inter(c[1], name="c")
        return c[0] < steps_taken

    def body(c):
        i, v = c
        return i + 1, stx.save_inter(v * 2.0 + 1.0, name="v")

    return jax.lax.while_loop(cond, body, (0, x))[1]


def _by_hand(x, trips):
    """What `_loop` keeps, in rows: `c` before each iteration and after the last (`N + 1`
    rows), `v` after each (`N` rows), zeros past the last, and which rows ran."""
    c, v = np.zeros((N + 1, *np.shape(x)), np.float32), np.zeros((N, *np.shape(x)), np.float32)
    value = np.asarray(x, np.float32)
    c[0] = value
    for i in range(trips):
        value = value * 2 + 1
        v[i], c[i + 1] = value, value
    return value, {
        "c_0": c,
        "c_0.ran": np.arange(N + 1) <= trips,
        "v_0": v,
        "v_0.ran": np.arange(N) < trips,
    }


def _same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("trips", [0, 1, 3, N])
@pytest.mark.parametrize("jit", [False, True])
def test_every_iteration_in_rows_with_ran_masks(trips, jit):
    f = jax.jit(_loop) if jit else _loop
    out, inters = stx.pull(f, steps=N, ran=True)(jnp.float32(1.5), trips)
    want_out, want = _by_hand(1.5, trips)
    np.testing.assert_allclose(out, want_out)
    _same(inters, want)
    # Without `steps=`: the last iteration, as before (zeros where none ran).
    _, last = stx.pull(f)(jnp.float32(1.5), trips)
    assert sorted(last) == ["c_0", "v_0"]
    np.testing.assert_allclose(last["c_0"], want["c_0"][trips])
    np.testing.assert_allclose(last["v_0"], want["v_0"][trips - 1] if trips else 0.0)


def test_each_example_has_its_own_count_under_vmap():
    xs, trips = jnp.array([1.0, -2.0, 0.5]), jnp.array([2, 0, 4])
    for pulled in (
        jax.vmap(stx.pull(_loop, steps=N, ran=True)),
        stx.pull(jax.vmap(_loop), steps=N, ran=True),
    ):
        out, inters = pulled(xs, trips)
        rows = [_by_hand(float(x), int(t)) for x, t in zip(xs, trips, strict=True)]
        np.testing.assert_allclose(out, [r[0] for r in rows])
        _same(inters, {k: np.stack([r[1][k] for r in rows]) for k in rows[0][1]})


def test_a_loop_past_the_bound_raises_and_truncates_nothing():
    with pytest.raises(Exception, match=r"steps=5\): the while_loop .* ran more iterations"):
        stx.pull(_loop, steps=N)(jnp.float32(1.0), 7)
    with pytest.raises(Exception, match="pass a larger steps="):
        jax.block_until_ready(jax.jit(stx.pull(_loop, steps=N))(jnp.float32(1.0), 7))
    with pytest.raises(TypeError, match="positive int"):
        stx.pull(_loop, steps=0)


def test_nested_loops_give_one_axis_each():
    def f(x):
        def outer(c):
            i, v = c
            v = jax.lax.while_loop(
                lambda d: d[0] < i + 1,
                lambda d: (d[0] + 1, stx.save_inter(d[1] + 1.0, name="inner")),
                (0, v),
            )[1]
            return i + 1, stx.save_inter(v * 2.0, name="outer")

        return jax.lax.while_loop(lambda c: c[0] < 3, outer, (0, x))[1]

    out, inters = stx.pull(f, steps=4)(jnp.float32(0.0))
    inner, outer, v = np.zeros((4, 4), np.float32), np.zeros(4, np.float32), 0.0
    for i in range(3):
        for j in range(i + 1):
            v += 1.0
            inner[i, j] = v
        v *= 2.0
        outer[i] = v
    np.testing.assert_allclose(out, v)
    _same(inters, {"inner_0": inner, "outer_0": outer})


def test_running_reductions_keep_one_value_and_stack_is_refused():
    def f(x, reduce):
        def body(c):
            stx.save_inter(c[1], name="r", reduce=reduce)
            return c[0] + 1, c[1] * 2.0

        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    _, inters = stx.pull(f, steps=N)(jnp.float32(1.0), "sum")
    np.testing.assert_allclose(inters["r"], 1.0 + 2.0 + 4.0)
    with pytest.raises(stx.ReduceMismatchError):
        stx.pull(f, steps=N)(jnp.float32(1.0), "stack")


def test_planting_what_pull_returned_reproduces_the_run():
    x = jnp.float32(0.25)
    _, inters = stx.pull(_loop, steps=N)(x, 3)
    np.testing.assert_allclose(stx.plant(_loop, steps=N)(inters, x, 3), _loop(x, 3))
    # A row goes to its iteration: every row planted, every iteration takes its own.
    rows = inters["v_0"].at[1].set(100.0)
    out = stx.plant(_loop, steps=N)({"v_0": rows}, x, 3)
    np.testing.assert_allclose(out, rows[2])
    # A one-step edit: a hook given the step changes iteration 1 alone, the next ones recompute.
    edit = lambda v, step: jnp.where(step == 1, 100.0, v)  # noqa: E731
    for planted in (stx.plant(_loop), stx.plant(_loop, steps=N), eqx.filter_jit(stx.plant(_loop))):
        np.testing.assert_allclose(planted({"v_0": edit}, x, 3), 201.0)


def test_a_hook_is_given_the_innermost_loops_step():
    def f(x):
        def body(c, _):
            return c + stx.save_inter(jnp.ones(2), name="s").sum(), None

        y = jax.lax.scan(body, x, None, length=3)[0]
        w = jax.lax.while_loop(
            lambda c: c[0] < 4,
            lambda c: (c[0] + 1, c[1] + stx.save_inter(1.0 * c[0], name="w")),
            (0, y),
        )[1]
        return w + stx.save_inter(x, name="out")

    def hook(v, step):
        return v * 0 + step

    x = jnp.float32(0.0)
    # scan rows 0, 1, 2 (twice each); while steps 0..3; no loop: 0.
    want = 2 * (0 + 1 + 2) + (0 + 1 + 2 + 3) + 0
    for planted in (stx.plant(f), eqx.filter_jit(stx.plant(f)), stx.plant(f, steps=4)):
        np.testing.assert_allclose(planted({"s": hook, "w": hook, "out": hook}, x), want)
    batched = jax.vmap(lambda x: stx.plant(f)({"s": hook, "w": hook}, x))(jnp.zeros(2))
    np.testing.assert_allclose(batched, [want, want])


def test_a_hook_runs_only_where_it_is_planted():
    calls = []

    def g(x):
        a = stx.save_inter(x[:2] * 1.0, name="h")  # h_0: shape (2,)
        b = stx.save_inter(x * 2.0, name="h")  # h_1: shape (3,)
        return a.sum() + b.sum()

    def hook(v):
        jax.debug.callback(lambda: calls.append(1))
        return v + jnp.arange(3.0)  # fits h_1 only

    x = jnp.ones(3)
    out = stx.plant(g)({"h_1": hook}, x)
    jax.effects_barrier()
    np.testing.assert_allclose(out, 2.0 + 6.0 + 3.0)
    assert calls == [1]  # once: at h_1, not at h_0
    with pytest.raises(stx.PlantError, match="for 'h_0'.*broadcast|for 'h_0'.*shape"):
        stx.plant(g)({"h_0": hook}, x)


def test_summaries_see_the_rows_and_vmap_makes_them_per_step():
    _, whole = stx.pull(_loop, steps=N, summarize=stx.stats)(jnp.float32(1.5), 3)
    _, rows = stx.pull(_loop, steps=N, summarize=jax.vmap(stx.stats))(jnp.float32(1.5), 3)
    v = _by_hand(1.5, 3)[1]["v_0"]
    np.testing.assert_allclose(whole["v_0"]["mean"], v.mean(), rtol=1e-6)  # (padding included)
    np.testing.assert_allclose(rows["v_0"]["mean"], v, rtol=1e-6)  # one per row
    np.testing.assert_allclose(rows["c_0"]["max"], _by_hand(1.5, 3)[1]["c_0"], rtol=1e-6)

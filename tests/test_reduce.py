"""`save_inter(..., reduce=mode)` against hand-computed values, in every construct."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose

X = jnp.array([0.5, -1.0, 2.0])
VALUES = [X * 1, X * -2, X * 3]  # three occurrences


def by_hand(mode, values):
    stacked = jnp.stack(values)
    return {
        "stack": stacked,
        "mean": jnp.mean(stacked, 0),
        "sum": jnp.sum(stacked, 0),
        "min": jnp.min(stacked, 0),
        "max": jnp.max(stacked, 0),
        "first": values[0],
        "last": values[-1],
        "collect": jnp.concatenate([jnp.ravel(v) for v in values]),
    }[mode]


MODES = ["stack", "mean", "sum", "min", "max", "first", "last", "collect"]


def straight(mode):
    def f(x):
        for k in (1, -2, 3):
            stx.save_inter(x * k, name="v", reduce=mode)
        return jnp.sum(x)

    return f


def scanned(mode):
    def f(x):
        def body(c, k):
            stx.save_inter(x * k, name="v", reduce=mode)
            return c, None

        lax.scan(body, 0.0, jnp.array([1.0, -2.0, 3.0]))
        return jnp.sum(x)

    return f


def while_loop(mode):
    def f(x):
        def body(s):
            (i,) = s
            stx.save_inter(x * jnp.array([1.0, -2.0, 3.0])[i], name="v", reduce=mode)
            return (i + 1,)

        lax.while_loop(lambda s: s[0] < 3, body, (0,))
        return jnp.sum(x)

    return f


def split_over_branches(mode):
    # Occurrence 1 before the cond, occurrence 2 in the branch that runs, 3 after it.
    def f(x):
        stx.save_inter(x, name="v", reduce=mode)
        lax.cond(
            jnp.sum(x) > 0,
            lambda: stx.save_inter(x * -2, name="v", reduce=mode),
            lambda: stx.save_inter(x * 100, name="v", reduce=mode),
        )
        stx.save_inter(x * 3, name="v", reduce=mode)
        return jnp.sum(x)

    return f


CONSTRUCTS = {
    "straight": straight,
    "scan": scanned,
    "while": while_loop,
    "cond": split_over_branches,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_reduce_against_hand_computed_values(construct, mode):
    if construct == "while" and mode in ("stack", "collect"):
        with pytest.raises(stx.ReduceMismatchError, match="while_loop"):
            stx.pull(CONSTRUCTS[construct](mode))(X)
        return
    f = CONSTRUCTS[construct](mode)
    expected = {"v": by_hand(mode, VALUES)}
    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        assert_tree_allclose(g(X)[1], expected)
    # Under grad (forward mode for while, which JAX cannot reverse), the primal values; under
    # vmap, per example, in both orders.
    d = jax.jacfwd if construct == "while" else jax.grad
    assert_tree_allclose(stx.pull(d(f))(X)[1], expected)
    assert_tree_allclose(d(stx.pull(f), has_aux=True)(X)[1], expected)
    xs = jnp.stack([X, X * 2])
    batched = {"v": jax.vmap(lambda x: by_hand(mode, [x * 1, x * -2, x * 3]))(xs)}
    assert_tree_allclose(stx.pull(jax.vmap(f))(xs)[1], batched)
    assert_tree_allclose(jax.vmap(stx.pull(f))(xs)[1], batched)


def test_cond_branch_not_taken_contributes_nothing():
    def f(x, p):
        lax.cond(p, lambda: stx.save_inter(x, name="m", reduce="mean"), lambda: x)
        stx.save_inter(x * 3, name="m", reduce="mean")
        return x

    assert_tree_allclose(stx.pull(f)(2.0, True)[1], {"m": 4.0})  # (2 + 6) / 2
    assert_tree_allclose(stx.pull(f)(2.0, False)[1], {"m": 6.0})  # 6 / 1
    ps = jnp.array([True, False])
    assert_tree_allclose(
        stx.pull(jax.vmap(f))(jnp.array([2.0, 2.0]), ps)[1], {"m": jnp.array([4.0, 6.0])}
    )


def test_a_name_that_never_ran_gives_zeros():
    def f(x):
        lax.while_loop(lambda c: c < 0, lambda c: stx.save_inter(c, name="m", reduce="mean"), x)
        return x

    assert_tree_allclose(stx.pull(f)(1.0)[1], {"m": 0.0})


def test_two_modes_for_one_name_is_an_error_naming_both():
    def f(x):
        stx.save_inter(x, name="loss", reduce="mean")
        lax.scan(lambda c, _: (stx.save_inter(c, name="loss", reduce="sum"), None), x, None, 2)
        return x

    with pytest.raises(
        stx.ReduceMismatchError,
        match=r"(?s)'mean' at .*test_reduce.py:\d+.*'sum' at .*test_reduce.py",
    ):
        stx.pull(f)(1.0)


def _reduced_beside_unreduced(x):
    stx.save_inter(x, name="h")
    stx.save_inter(x, name="h", reduce="last")
    return x


def _reduced_name_equal_to_a_generated_key(x):
    stx.save_inter(x, name="y")
    stx.save_inter(x, name="y_0", reduce="mean")
    return x


@pytest.mark.parametrize(
    "f, error, match",
    [
        (_reduced_beside_unreduced, stx.ReduceMismatchError, "reduce=None"),
        (_reduced_name_equal_to_a_generated_key, stx.KeyCollisionError, "'y_0'"),
    ],
)
def test_names_that_cannot_share_an_entry_are_errors(f, error, match):
    with pytest.raises(error, match=match):
        stx.pull(f)(1.0)


def test_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError, match="reduce must be one of"):
        stx.save_inter(1.0, name="x", reduce="median")


def _scan_memory(length, mode):
    def f(x):
        def body(c, _):
            c = jnp.tanh(c @ jnp.eye(64) + 1.0)
            stx.save_inter(c, name="h", reduce=mode)
            return c, None

        return jnp.sum(lax.scan(body, x, None, length=length)[0])

    compiled = jax.jit(stx.pull(f)).lower(jnp.ones((32, 64))).compile()
    memory = compiled.memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


@pytest.mark.parametrize("mode", ["mean", "sum", "min", "max", "first", "last"])
def test_running_reductions_in_scan_use_memory_independent_of_length(mode):
    assert _scan_memory(10, mode) == _scan_memory(1000, mode)


def test_stacking_in_scan_grows_with_length():
    assert _scan_memory(1000, "stack") > 10 * _scan_memory(10, "stack")


def test_scan_reverse_first_and_last_follow_execution_order():
    def f(x):
        def body(c, k):
            stx.save_inter(k, name="first", reduce="first")
            stx.save_inter(k, name="last", reduce="last")
            stx.save_inter(k, name="stack", reduce="stack")
            return c, None

        lax.scan(body, x, jnp.arange(3.0), reverse=True)
        return x

    inters = stx.pull(f)(0.0)[1]
    assert float(inters["first"]) == 2.0 and float(inters["last"]) == 0.0
    np.testing.assert_allclose(inters["stack"], [0.0, 1.0, 2.0])  # in the order of ys

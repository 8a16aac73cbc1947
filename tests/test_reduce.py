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


def _stack_and_collect_in_cond(x, p):
    """`x * 1` always, `x * 2` in the branch taken when `p`, `x * 3` always; per occurrence a
    pytree of two leaves, so masks follow the value's structure."""

    def save(v, mode):
        return stx.save_inter({"a": v, "b": jnp.stack([v, -v])}, name=mode, reduce=mode)

    for mode in ("stack", "collect"):
        save(x * 1, mode)
        lax.cond(p, lambda v: save(v * 2, mode)["a"], lambda v: v, x)
        save(x * 3, mode)
    return x


def _stack_and_collect_by_hand(x, p):
    rows = [x * 1, jnp.where(p, x * 2, 0.0), x * 3]
    ran = jnp.array([True, p, True])
    a, b = jnp.stack(rows), jnp.stack([jnp.stack([r, -r]) for r in rows])
    return {
        "stack": {"a": a, "b": b},
        "stack.ran": {"a": ran, "b": ran},
        "collect": {"a": a.reshape(-1), "b": b.reshape(-1)},
        "collect.ran": {"a": ran, "b": jnp.repeat(ran, 2)},
    }


@pytest.mark.parametrize("p", [True, False])
def test_stack_and_collect_zero_rows_of_branches_not_taken_and_say_so(p):
    x = jnp.float32(1.5)
    expected = _stack_and_collect_by_hand(x, p)
    for f in (_stack_and_collect_in_cond, jax.jit(_stack_and_collect_in_cond)):
        assert_tree_allclose(stx.pull(f, ran=True)(x, p)[1], expected)
    assert_tree_allclose(  # under jit, with a traced predicate
        jax.jit(stx.pull(_stack_and_collect_in_cond, ran=True))(x, jnp.bool_(p))[1], expected
    )
    # Without ran=True, the values alone, as before.
    only_values = {k: v for k, v in expected.items() if not k.endswith(".ran")}
    assert_tree_allclose(stx.pull(_stack_and_collect_in_cond)(x, p)[1], only_values)
    # Under an inner grad, the primal values and the same masks.
    grad_f = jax.grad(lambda x, p: _stack_and_collect_in_cond(x, p) ** 2)
    assert_tree_allclose(stx.pull(grad_f, ran=True)(x, p)[1], expected)


def test_stack_and_collect_masks_per_example_under_vmap_both_orders():
    xs, ps = jnp.array([1.5, -2.0]), jnp.array([True, False])
    expected = jax.vmap(_stack_and_collect_by_hand)(xs, ps)
    f = _stack_and_collect_in_cond
    assert_tree_allclose(stx.pull(jax.vmap(f), ran=True)(xs, ps)[1], expected)
    assert_tree_allclose(jax.vmap(stx.pull(f, ran=True))(xs, ps)[1], expected)


def test_stack_masks_in_a_scan_of_conds():
    def f(xs):
        def body(c, x):
            lax.cond(x > 0, lambda: stx.save_inter(x, name="pos", reduce="stack"), lambda: x)
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    xs = jnp.array([1.0, -2.0, 3.0])
    _, inters = stx.pull(f, ran=True)(xs)
    assert_tree_allclose(
        inters, {"pos": jnp.array([1.0, 0.0, 3.0]), "pos.ran": jnp.array([True, False, True])}
    )


def test_a_mask_key_that_a_user_name_takes_is_a_collision():
    def f(x):
        stx.save_inter(x, name="s", reduce="stack")
        stx.save_inter(x, name="s.ran", reduce="sum")
        return x

    assert set(stx.pull(f)(1.0)[1]) == {"s", "s.ran"}
    with pytest.raises(stx.KeyCollisionError, match="s.ran"):
        stx.pull(f, ran=True)(1.0)


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


def test_a_new_mode_is_one_table_entry(monkeypatch):
    # A product mode, added as one `Mode`: straight-line code, scan, while, cond and shard_map
    # need no other change.
    from statax._core import reduce as _reduce

    prod = _reduce.Mode(
        "prod",
        running=True,
        pick=lambda x, m, y, n: jnp.where(m == 0, y, jnp.where(n == 0, x, x * y)),
        across=lambda v, n, axes: jnp.exp(lax.psum(jnp.log(v), axes)),
        finish=lambda v, n: jnp.where(n > 0, v, 0),
    )
    monkeypatch.setitem(_reduce.MODES, "prod", prod)
    v = jnp.array([2.0, 3.0])

    def f(x, p):
        stx.save_inter(x, name="p", reduce="prod")
        lax.scan(lambda c, _: (stx.save_inter(c, name="p", reduce="prod") * 2, None), x, None, 3)
        lax.while_loop(
            lambda c: c[0] < 2,
            lambda c: (c[0] + 1, stx.save_inter(c[1], name="p", reduce="prod")),
            (0, x),
        )
        lax.cond(p, lambda: stx.save_inter(x, name="p", reduce="prod"), lambda: x)
        return x

    # x * (x * 2x * 4x) * (x * x) * [x if p]
    for p, power, factor in ((True, 7, 8.0), (False, 6, 8.0)):
        _, inters = stx.pull(jax.jit(f))(v, p)
        assert list(inters) == ["p"]
        assert_tree_allclose(inters["p"], v**power * factor)

    # Across the 4 shards of a shard_map: the product of every shard's value.
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("s",))
    local = jax.shard_map(
        lambda x: stx.save_inter(x * 1.0, name="p", reduce="prod"),
        mesh=mesh,
        in_specs=P("s"),
        out_specs=P("s"),
    )
    xs = jnp.array([1.0, 2.0, 3.0, 4.0])
    _, inters = stx.pull(jax.jit(local))(xs)
    assert_tree_allclose(inters["p"], jnp.array([24.0]), rtol=1e-5)

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.3, -0.7, 1.1])
XS = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


def scan_f(x, reverse=False, unroll=1):
    def body(c, y):
        h = stx.save_inter(jnp.tanh(c * y), name="h")
        stx.save_inter(jnp.sum(h), name="s")
        return c + h, c * 2

    c, ys = lax.scan(body, x, XS, reverse=reverse, unroll=unroll)
    return jnp.sum(c) + jnp.sum(ys)


def scan_ref(x, reverse=False, unroll=1):
    c, hs, ss, ys = x, [], [], []
    order = range(len(XS))[::-1] if reverse else range(len(XS))
    for i in order:
        h = jnp.tanh(c * XS[i])
        hs.append(h)
        ss.append(jnp.sum(h))
        ys.append(c * 2)
        c = c + h
    if reverse:
        hs, ss, ys = hs[::-1], ss[::-1], ys[::-1]
    return jnp.sum(c) + jnp.sum(jnp.stack(ys)), {"h_0": jnp.stack(hs), "s_0": jnp.stack(ss)}


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
def test_scan_stacks_like_ys(reverse, unroll):
    f = functools.partial(scan_f, reverse=reverse, unroll=unroll)
    ref = functools.partial(scan_ref, reverse=reverse, unroll=unroll)
    check_pull(f, ref, X)


def test_scan_under_vmap_puts_batch_axis_first_then_scan_axis():
    _, inters = stx.pull(jax.vmap(scan_f))(jnp.stack([X, X + 1]))
    assert inters["h_0"].shape == (2, 4, 3)
    assert_tree_allclose(inters, jax.vmap(scan_ref)(jnp.stack([X, X + 1]))[1])


def test_map_and_static_fori_loop():
    def f(x):
        ys = lax.map(lambda r: stx.save_inter(r * 2, name="m"), x)
        return lax.fori_loop(0, 3, lambda i, c: c + stx.save_inter(c * i, name="i"), jnp.sum(ys))

    def ref(x):
        c, cs = jnp.sum(x * 2), []
        for i in range(3):
            cs.append(c * i)
            c = c + c * i
        return c, {"m_0": x * 2, "i_0": jnp.stack(cs)}

    check_pull(f, ref, X)


def while_f(x, limit):
    def cond(c):
        stx.save_inter(c[0], name="in_cond")
        return c[0] < limit

    def body(c):
        return stx.save_inter(c * 1.5 + 0.1, name="body")

    return jnp.sum(lax.while_loop(cond, body, x))


def while_ref(x, limit):
    c, last = x, jnp.zeros_like(x)
    while c[0] < limit:
        c = c * 1.5 + 0.1
        last = c
    return jnp.sum(c), {"in_cond_0": c[0], "body_0": last}


@pytest.mark.parametrize("limit", [2.0, 0.1])  # 0.1: the body never runs
def test_while_gives_last_iteration_and_last_cond_evaluation(limit):
    x = jnp.array([0.5, 1.0])
    assert_tree_allclose(stx.pull(while_f)(x, limit), while_ref(x, limit))
    assert_tree_allclose(stx.pull(jax.jit(while_f))(x, limit), while_ref(x, limit))
    assert_tree_allclose(jax.jit(stx.pull(while_f))(x, limit), while_ref(x, limit))


def test_while_under_vmap_gives_each_example_its_last_iteration():
    xs = jnp.array([[0.5, 1.0], [1.9, 0.0], [3.0, 1.0]])  # 3 iterations, 1, none
    expected = [while_ref(x, 2.0) for x in xs]
    expected = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *expected)
    assert_tree_allclose(stx.pull(jax.vmap(while_f, (0, None)))(xs, 2.0), expected)
    assert_tree_allclose(jax.vmap(stx.pull(while_f), (0, None))(xs, 2.0), expected)


def test_fori_loop_with_dynamic_trip_count():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, c: stx.save_inter(c + i, name="c"), x)

    for n in (0, 3):
        expected_last = x_last = 1.0 + sum(range(n))
        assert_tree_allclose(
            stx.pull(f)(1.0, jnp.int32(n)), (x_last, {"c_0": expected_last if n else 0.0})
        )


def test_grad_through_scan_and_while():
    def f(x):
        c, _ = lax.scan(lambda c, _: (stx.save_inter(jnp.sin(c), name="s"), None), x, None, 3)
        return c

    s1 = jnp.sin(0.5)
    s2 = jnp.sin(s1)
    assert_tree_allclose(stx.pull(jax.grad(f))(0.5)[1], {"s_0": jnp.stack([s1, s2, jnp.sin(s2)])})
    assert_tree_allclose(
        jax.grad(stx.pull(f), has_aux=True)(0.5)[1], {"s_0": jnp.stack([s1, s2, jnp.sin(s2)])}
    )


def layer(w, x):
    h = stx.save_inter(jnp.tanh(x @ w), name="hidden")
    return x + h


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable])
def test_scan_over_checkpointed_layers_collects_each_value_once(policy):
    ws = jnp.stack([jnp.eye(3) * (i + 1) / 4 for i in range(4)])

    def loss(ws, x):
        step = jax.checkpoint(lambda x, w: (layer(w, x), None), policy=policy)
        return jnp.sum(lax.scan(step, x, ws)[0])

    def ref(ws, x):
        hs = []
        for w in ws:
            h = jnp.tanh(x @ w)
            hs.append(h)
            x = x + h
        return jnp.sum(x), {"hidden_0": jnp.stack(hs)}

    for g in (stx.pull(jax.grad(loss)), jax.grad(stx.pull(loss), has_aux=True)):
        grads, inters = g(ws, X)
        assert_tree_allclose(inters, ref(ws, X)[1])
        assert_tree_allclose(grads, jax.grad(lambda w, x: ref(w, x)[0])(ws, X))


def test_nesting_jit_in_scan_in_cond_in_vmap():
    @jax.jit
    def inner(c):
        return stx.save_inter(c * 2, name="j")

    def f(x, p):
        def yes(x):
            return lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]

        return lax.cond(p, yes, lambda x: x, x)

    def ref(x, p):
        return jnp.where(p, x * 4, x), {"j_0": jnp.where(p, jnp.stack([x * 2, x * 4]), 0.0)}

    check_pull(f, ref, X, jnp.asarray(True), transforms=("plain", "jit", "vmap", "jacrev"))


def test_scan_in_while():
    def f(x):
        def body(c):
            c, _ = lax.scan(lambda a, _: (stx.save_inter(a + 1, name="a"), None), c, None, 2)
            return c

        return lax.while_loop(lambda c: c < 5, body, x)

    # 0 -> 2 -> 4 -> 6: the last iteration's scan saved [5, 6].
    assert_tree_allclose(stx.pull(f)(0.0), (6.0, {"a_0": jnp.array([5.0, 6.0])}))
    assert_tree_allclose(
        stx.pull(jax.vmap(f))(jnp.array([0.0, 5.0])),
        (jnp.array([6.0, 5.0]), {"a_0": jnp.array([[5.0, 6.0], [0.0, 0.0]])}),
    )

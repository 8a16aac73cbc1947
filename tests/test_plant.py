"""`plant` and `grad_inters` against the same functions written by hand to take the replacement
(or a perturbation) as an argument, under jit, grad and vmap in both orders."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose, hlo_ops

X = jnp.array([0.3, -0.5, 0.8])
V = jnp.array([2.0, 3.0, -1.0])


def layers(x):
    for _ in range(3):  # one line, three occurrences: h_0, h_1, h_2
        x = jnp.tanh(stx.save_inter(x * 2.0, name="h"))
    return jnp.sum(x)


def layers_by_hand(x, replace=None):
    """`layers` with occurrence `k` of `h` replaced: `replace = (k, value)`."""
    for i in range(3):
        h = x * 2.0
        if replace is not None and replace[0] == i:
            h = replace[1]
        x = jnp.tanh(h)
    return jnp.sum(x)


def test_one_occurrence_and_every_occurrence():
    for k in range(3):
        got = stx.plant(layers)({f"h_{k}": V}, X)
        assert_tree_allclose(got, layers_by_hand(X, (k, V)))
    # A bare name: every occurrence.
    assert_tree_allclose(stx.plant(layers)({"h": V}, X), jnp.sum(jnp.tanh(V)))
    # Arrays are traced: a new value does not retrace, under jit too.
    planted = jax.jit(stx.plant(layers))
    for value in (V, V * 2):
        assert_tree_allclose(planted({"h_1": value}, X), layers_by_hand(X, (1, value)))


def test_hooks_ablate_and_steer():
    ablate = lambda v: v * 0  # noqa: E731
    steer = lambda v: v + 1.0  # noqa: E731
    assert_tree_allclose(stx.plant(layers)({"h_1": ablate}, X), layers_by_hand(X, (1, X * 0)))
    x1 = jnp.tanh(X * 2.0)
    expected = layers_by_hand(X, (1, x1 * 2.0 + 1.0))
    assert_tree_allclose(stx.plant(layers)({"h_1": steer}, X), expected)
    # Different hooks at different occurrences, and an array beside them.
    got = stx.plant(layers)({"h_0": steer, "h_2": ablate}, X)
    x = jnp.tanh(X * 2.0 + 1.0)
    x = jnp.tanh(x * 2.0)
    assert_tree_allclose(got, jnp.sum(jnp.tanh(x * 0)))


def test_downstream_uses_the_replacement_and_upstream_work_is_dropped():
    def f(x):
        expensive = jnp.cos(jnp.sin(x) @ jnp.ones((3, 3)))  # only feeds h
        return jnp.exp(stx.save_inter(expensive, name="h"))

    def kinds(fn, *args):
        return " ".join(hlo_ops(fn, *args))

    assert re.search(r"cosine|sine", kinds(f, X))
    assert not re.search(r"cosine|sine|dot", kinds(stx.plant(f), {"h": V}, X))
    assert_tree_allclose(stx.plant(f)({"h": V}, X), jnp.exp(V))


def _scan(x):
    def step(c, _):
        h = stx.save_inter(jnp.sin(c), name="h")
        return c + h, h

    return lax.scan(step, x, None, length=4)


def _scan_by_hand(x, hs=None, hook=None, ds=None):
    def step(c, given):
        h, d = given
        h = jnp.sin(c) if h is None else h
        h = h if hook is None else hook(h)
        h = h if d is None else h + d
        return c + h, h

    return lax.scan(step, x, (hs, ds), length=4)


def test_scan_stacked_value_and_hook_every_iteration():
    hs = jnp.arange(12.0).reshape(4, 3)
    assert_tree_allclose(stx.plant(_scan)({"h_0": hs}, X), _scan_by_hand(X, hs))
    hook = lambda v: v * 0.5  # noqa: E731
    assert_tree_allclose(stx.plant(_scan)({"h": hook}, X), _scan_by_hand(X, hook=hook))


def _while(x):
    def body(s):
        i, c = s
        return i + 1, c + stx.save_inter(jnp.sin(c), name="h")

    return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]


def _while_by_hand(x, h=None, hook=None):
    def body(s):
        i, c = s
        v = jnp.sin(c) if h is None else h
        return i + 1, c + (v if hook is None else hook(v))

    return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]


def test_while_one_value_every_iteration_and_hook():
    assert_tree_allclose(stx.plant(_while)({"h": V}, X), _while_by_hand(X, V))
    hook = lambda v: -v  # noqa: E731
    assert_tree_allclose(stx.plant(_while)({"h": hook}, X), _while_by_hand(X, hook=hook))


def test_cond_applies_in_the_branch_that_runs():
    def f(x):
        return lax.cond(
            x[0] > 0,
            lambda: stx.save_inter(jnp.sin(x), name="h") * 2,
            lambda: stx.save_inter(jnp.cos(x), name="h") + 1,
        )

    for x in (X, -X):  # the true branch's h is occurrence 0 of each branch, one slot
        expected = jnp.where(x[0] > 0, V * 2, V + 1)
        assert_tree_allclose(stx.plant(f)({"h_0": V}, x), expected)


def f_mlp(w, x):
    h = stx.save_inter(jnp.tanh(x @ w), name="h")
    return jnp.sum(h**2)


def f_mlp_by_hand(w, x, h):
    del w, x
    return jnp.sum(h**2)


W = jnp.array([[0.5, -1.0], [1.5, 0.2], [-0.3, 0.7]])
XS = jnp.stack([X, -X, X * 2])  # a batch of 3
HS = jnp.array([[1.0, 2.0], [0.5, -0.5], [0.0, 3.0]])


def test_vmap_both_orders():
    # Inside: the batch axis first, as pull returns it; an unbatched value is broadcast.
    inner = stx.plant(jax.vmap(f_mlp, in_axes=(None, 0)))
    by_hand = jax.vmap(f_mlp_by_hand, in_axes=(None, 0, 0))
    assert_tree_allclose(inner({"h": HS}, W, XS), by_hand(W, XS, HS))
    assert_tree_allclose(inner({"h": HS[1]}, W, XS), by_hand(W, XS, jnp.stack([HS[1]] * 3)))
    # Outside: vmap over the values too.
    outer = jax.vmap(lambda h, x: stx.plant(f_mlp)({"h": h}, W, x))
    assert_tree_allclose(outer(HS, XS), by_hand(W, XS, HS))


def vmap_in_scan(xs, reduce=None):
    # A vmap inside a scan's body: its marks leave the scan stacked, loop axis first.
    def body(c, _):
        c = jax.vmap(lambda ci: stx.save_inter(jnp.sin(ci) + 1.0, name="v", reduce=reduce))(c)
        return c, None

    return jnp.sum(lax.scan(body, xs, None, length=3)[0])


def vmap_in_scan_by_hand(xs, vs=None):
    """`vmap_in_scan`, returning the marked values `(3, B, 4)`, or taking them (`vs`)."""

    def body(c, v):
        c = jnp.sin(c) + 1.0 if v is None else v
        return c, c

    c, ys = lax.scan(body, xs, vs, length=3)
    return jnp.sum(c), ys


def test_marks_of_a_vmap_in_a_scan_are_planted_loop_axis_first():
    # Three iterations of a batch of three: a value of one iteration's shape per example
    # (3, 4) could be read two ways, so only the whole stack is taken, as pull returns it.
    xs = jnp.arange(12.0).reshape(3, 4) / 12.0
    out, ys = vmap_in_scan_by_hand(xs)
    assert_tree_allclose(stx.pull(vmap_in_scan)(xs), (out, {"v_0": ys}))
    vs = jnp.arange(36.0).reshape(3, 3, 4)
    assert_tree_allclose(stx.plant(vmap_in_scan)({"v_0": vs}, xs), vmap_in_scan_by_hand(xs, vs)[0])
    with pytest.raises(stx.PlantError, match=r"expected \(float32\[3, 3, 4\]\)\.($|\n)"):
        stx.plant(vmap_in_scan)({"v_0": vs[0]}, xs)
    rewritten = stx.extend.pull_jaxpr(jax.make_jaxpr(vmap_in_scan)(xs))
    assert [m.batch_ndim for m in rewritten.outs] == [0]  # its leading axis is the loop's
    # Reduced, the batch axis comes first, then the occurrences (as for any batched mark).
    (stack,) = stx.pull(lambda x: vmap_in_scan(x, "stack"))(xs)[1].values()
    assert_tree_allclose(stack, jnp.swapaxes(ys, 0, 1))
    # Under a vmap outside, a value per example is broadcast over that batch.
    xss = jnp.stack([xs, 2 * xs])
    outer = stx.plant(jax.vmap(vmap_in_scan))({"v_0": vs}, xss)
    assert_tree_allclose(outer, jax.vmap(lambda x: vmap_in_scan_by_hand(x, vs)[0])(xss))


def test_grad_both_orders_flows_through_the_replacement():
    def f(x):
        h = stx.save_inter(jnp.sin(x), name="h")
        return jnp.sum(h * x)

    def f_by_hand(x, h):
        return jnp.sum(h * x)

    # plant(grad(f)): under the inner grad the primal is replaced; derivatives flow through the
    # replacement (a constant), not through sin.
    assert_tree_allclose(stx.plant(jax.grad(f))({"h": V}, X), jax.grad(f_by_hand)(X, V))
    # grad(plant(f)), in the argument and in the replacement.
    planted = lambda x, h: stx.plant(f)({"h": h}, x)  # noqa: E731
    assert_tree_allclose(jax.grad(planted)(X, V), jax.grad(f_by_hand)(X, V))
    assert_tree_allclose(jax.grad(planted, argnums=1)(X, V), X)
    assert_tree_allclose(jax.jit(jax.grad(planted))(X, V), jax.grad(f_by_hand)(X, V))


def test_composes_with_pull_in_both_orders():
    # pull(plant(f)): the intermediates are what they now are.
    out, inters = stx.pull(lambda x: stx.plant(layers)({"h_1": V}, x))(X)
    x1 = jnp.tanh(X * 2.0)
    assert_tree_allclose(out, layers_by_hand(X, (1, V)))
    assert_tree_allclose(inters["h_0"], X * 2.0)
    assert_tree_allclose(inters["h_1"], V)
    assert_tree_allclose(inters["h_2"], jnp.tanh(V) * 2.0)
    # plant(pull(f)): pull returns the planted run and its intermediates.
    out, inters = stx.plant(stx.pull(layers))({"h_1": V}, X)
    assert_tree_allclose(out, layers_by_hand(X, (1, V)))
    assert_tree_allclose(inters["h_1"], V)
    del x1


def test_round_trip_on_the_readme_model():
    out, inters = stx.pull(layers)(X)
    np.testing.assert_array_equal(stx.plant(layers)(inters, X), out)


class Static(eqx.Module):
    w: jax.Array
    act: str = eqx.field(static=True)


def every_kind_of_mark(x):
    """A mark of each kind of value and place: planted back as pull returns them, nothing
    changes."""
    m = stx.save_inter
    y = m(10.0, name="float") * m(3, name="int") * x  # Python numbers
    y = y + m(np.float32(0.5), name="numpy")
    y = y + m({"a": x, "s": "tag", "n": None, "k": 2.0}, name="tree")["a"]
    y = y + m(Static(x, "tanh"), name="module").w
    y = y + m(x, name="summed", reduce="sum") + m(x * 2, name="summed", reduce="sum")
    y = lax.scan(lambda c, a: (m(c * a, name="scan"), None), y, jnp.arange(1.0, 3.0))[0]
    y = lax.cond(y[0] > 0, lambda v: m(v + 1, name="then"), lambda v: m(v - 1, name="else"), y)

    def body(carry):
        i, v = carry
        return i + 1, m(v * 0.5, name="while")

    y = lax.while_loop(lambda c: c[0] < 3, body, (0, y))[1]
    return jax.vmap(lambda v: m(jnp.sin(v), name="vmapped"))(y)


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_planting_what_pull_returned_changes_nothing_for_every_kind_of_mark(wrap):
    f = wrap(every_kind_of_mark)
    out, inters = stx.pull(f)(X)
    assert inters["float_0"] == 10.0 and inters["int_0"] == 3
    np.testing.assert_array_equal(stx.plant(f)(inters, X), f(X))
    np.testing.assert_array_equal(stx.plant(f)(inters, X), out)


def test_python_numbers_are_planted_and_differentiated_as_jit_takes_them():
    def f(x):
        return stx.save_inter(10.0, name="y") * x + stx.save_inter({"k": 3, "s": "tag"}, name="t")["k"]  # fmt: skip  # noqa: E501

    def by_hand(y, k, x):
        return y * x + k

    assert_tree_allclose(stx.plant(f)({"y_0": 5.0}, X), by_hand(5.0, 3, X))
    assert_tree_allclose(stx.plant(f)({"y": jnp.float32(-1.0)}, X), by_hand(-1.0, 3, X))
    assert_tree_allclose(stx.plant(f)({"t_0": {"k": 7, "s": "tag"}}, X), by_hand(10.0, 7, X))
    with pytest.raises(stx.PlantError, match=r"has 'other' where the marked value has 'tag'"):
        stx.plant(f)({"t_0": {"k": 7, "s": "other"}}, X)
    value, grads = stx.grad_inters(lambda x: jnp.sum(f(x)))(X)
    assert set(grads) == {"y_0"}  # `t_0` holds an int and a string: nothing to differentiate
    assert_tree_allclose(grads["y_0"], jax.grad(lambda y: jnp.sum(by_hand(y, 3, X)))(10.0))


# ---- bad input -------------------------------------------------------------------------------


def test_unknown_key_lists_the_known_ones_with_their_sites():
    with pytest.raises(stx.PlantError) as info:
        stx.plant(layers)({"g_0": V}, X)
    message = str(info.value)
    assert "no marked value 'g_0'" in message
    assert re.search(r"h_2: .*test_plant.py:\d+", message)
    with pytest.raises(stx.PlantError, match="no marked value 'h_3'"):
        stx.plant(layers)({"h_3": V}, X)


def test_wrong_shape_or_dtype_names_the_mark_and_both_shapes():
    with pytest.raises(
        stx.PlantError,
        match=r"'h_1' \(save_inter at .*test_plant.py:\d+\) is "
        r"\(float32\[2\]\); expected \(float32\[3\]\)",
    ):
        stx.plant(layers)({"h_1": jnp.ones(2)}, X)
    with pytest.raises(stx.PlantError, match=r"is \(int32\[3\]\); expected \(float32\[3\]\)"):
        stx.plant(layers)({"h_1": jnp.ones(3, jnp.int32)}, X)
    with pytest.raises(stx.PlantError, match=r"hook .* for 'h' \(save_inter at .*test_plant.py"):
        stx.plant(layers)({"h": lambda v: v[:2]}, X)


def test_a_reduced_name_cannot_be_planted():
    def f(x):
        return stx.save_inter(x, name="r", reduce="mean") * 2

    with pytest.raises(stx.PlantError, match=r"'r' at .*test_plant.py:\d+ has reduce='mean'"):
        stx.plant(f)({"r": V}, X)


# ---- grad_inters ------------------------------------------------------------------------------


def loss(w, x):
    h = stx.save_inter(jnp.tanh(x @ w), name="h")
    g = stx.save_inter(h * 3.0, name="g")
    return jnp.sum(jnp.sin(g) + h**2)


def loss_by_hand(w, x, dh, dg):
    """`loss` with perturbations added at each mark."""
    h = jnp.tanh(x @ w) + dh
    g = h * 3.0 + dg
    return jnp.sum(jnp.sin(g) + h**2)


def test_grad_inters_against_perturbations_and_finite_differences():
    value, grads = stx.grad_inters(loss)(W, X)
    zeros = jnp.zeros(2)
    dh, dg = jax.grad(loss_by_hand, argnums=(2, 3))(W, X, zeros, zeros)
    assert_tree_allclose((value, grads), (loss(W, X), {"h_0": dh, "g_0": dg}))
    eps = 1e-3
    for i in range(2):
        e = jnp.zeros(2).at[i].set(eps)
        fd = (loss_by_hand(W, X, e, zeros) - loss_by_hand(W, X, -e, zeros)) / (2 * eps)
        np.testing.assert_allclose(grads["h_0"][i], fd, rtol=1e-2)
    # jit, only=, argnums, has_aux.
    assert_tree_allclose(jax.jit(stx.grad_inters(loss))(W, X), (value, grads))
    assert list(stx.grad_inters(loss, only="g")(W, X)[1]) == ["g_0"]
    _, _, dw = stx.grad_inters(loss, argnums=0)(W, X)
    assert_tree_allclose(dw, jax.grad(loss)(W, X))
    aux_loss = lambda w, x: (loss(w, x), {"note": 1.0})  # noqa: E731
    (v, aux), g = stx.grad_inters(aux_loss, has_aux=True)(W, X)
    assert_tree_allclose((v, aux, g), (value, {"note": 1.0}, grads))


def test_grad_inters_stacked_in_scans_and_per_example_under_vmap():
    def scanned(x):
        return jnp.sum(_scan(x)[0] ** 2)

    def scanned_by_hand(x, ds):  # a perturbation added to each iteration's h
        return jnp.sum(_scan_by_hand(x, hook=None, hs=None, ds=ds)[0] ** 2)

    _, grads = stx.grad_inters(scanned)(X)
    by_hand = jax.grad(scanned_by_hand, argnums=1)(X, jnp.zeros((4, 3)))
    assert_tree_allclose(grads["h_0"], by_hand, rtol=1e-4)

    batched = lambda w, xs: jnp.sum(jax.vmap(lambda x: loss(w, x))(xs))  # noqa: E731
    _, grads = stx.grad_inters(batched)(W, XS)
    assert grads["h_0"].shape == (3, 2)
    for i in range(3):
        _, one = stx.grad_inters(loss)(W, XS[i])
        assert_tree_allclose(grads["h_0"][i], one["h_0"], rtol=1e-5)


def test_grad_inters_leaves_reduced_names_out_whatever_they_look_like():
    def f(x):
        stx.save_inter(x, name="t_1", reduce="sum")  # a reduced name shaped like a key
        return jnp.sum(stx.save_inter(x * 2, name="h") ** 2)

    assert_tree_allclose(stx.grad_inters(f)(X), (f(X), {"h_0": 4 * X}))
    assert [key.reduce for key in stx.pull(f)(X)[1]] == ["sum", None]

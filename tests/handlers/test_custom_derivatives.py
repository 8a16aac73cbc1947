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
    # fwd's own mark has a key where fwd runs (the pull's inputs are differentiated), and none
    # where it does not: a pull returns what ran.
    expected = {"primal_0": jnp.tanh(X), "fwd_0": jnp.tanh(X) * 10}
    out, inters = stx.pull(clip_grad)(X)
    assert_tree_allclose(inters, {"primal_0": jnp.tanh(X)})
    assert_tree_allclose(stx.pull(jax.jit(clip_grad))(X)[1], inters)
    # Under an inner grad: what JAX runs, fwd and bwd.
    grad, inters = stx.pull(jax.grad(clip_grad))(X)
    assert_tree_allclose(grad, jnp.full(3, 7.0))
    assert_tree_allclose(inters, {"fwd_0": jnp.tanh(X) * 10, "bwd_0": 3.0})
    # Outer grad: the custom rule still governs; the primal's and fwd's values come out.
    grad, inters = jax.grad(stx.pull(clip_grad), has_aux=True)(X)
    assert_tree_allclose(grad, jnp.full(3, 7.0))
    assert_tree_allclose(inters, expected)


def test_custom_vjp_under_vmap_both_orders():
    xs = jnp.stack([X, X * 2])
    expected = {"primal_0": jnp.tanh(xs)}
    assert_tree_allclose(stx.pull(jax.vmap(clip_grad))(xs)[1], expected)
    assert_tree_allclose(jax.vmap(stx.pull(clip_grad))(xs)[1], expected)
    differentiated = {"primal_0": jnp.tanh(xs), "fwd_0": jnp.tanh(xs) * 10}
    for fn in (jax.vmap(stx.pull(clip_grad)), stx.pull(jax.vmap(clip_grad))):
        total = lambda xs: (lambda out, inters: (jnp.sum(out), inters))(*fn(xs))  # noqa: B023, E731
        assert_tree_allclose(jax.grad(total, has_aux=True)(xs)[1], differentiated)
    grads = jax.vmap(jax.grad(stx.pull(clip_grad), has_aux=True))(xs)
    assert_tree_allclose(grads, (jnp.full_like(xs, 7.0), differentiated))


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


# ---- marks in a custom rule: found in both orders (issue 14, item 3) ------------------------


@jax.custom_jvp
def rule_marked(x):
    return jnp.sin(x)


@rule_marked.defjvp
def _rule_marked_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    stx.save_inter(x * 2.0, name="x")  # depends on the primal only
    stx.save_inter(t * 3.0, name="t")  # a derivative: depends on the tangent
    return x, t * 2.0  # deliberately not sin's


def rule_marked_ref(x):
    """`rule_marked` by hand, undifferentiated: the rule does not run, and its mark has no key
    (the function has no mark of its own)."""
    return jnp.sin(x), {}


def test_custom_jvp_rule_mark_in_both_orders_of_jvp():
    x, t = jnp.float32(2.0), jnp.float32(1.0)
    # What JAX runs under jvp: the rule, whose marks a pull around it collects.
    (out, dout), inters = stx.pull(lambda x, t: jax.jvp(rule_marked, (x,), (t,)))(x, t)
    assert_tree_allclose((out, dout, inters), (x, 2 * t, {"x_0": 2 * x, "t_0": 3 * t}))
    # The other order: the rule's primal mark, with a zero tangent; the tangent's mark is a
    # derivative, which only a pull around the differentiation sees.
    for g in (stx.pull(rule_marked), stx.pull(jax.jit(rule_marked))):
        (out, inters), (dout, dinters) = jax.jvp(g, (x,), (t,))
        assert_tree_allclose((out, dout), (x, 2 * t))
        assert_tree_allclose((inters, dinters), ({"x_0": 2 * x}, {"x_0": 0.0 * x}))
    # A `jit` between the pull and the differentiation traces the pull before it is
    # differentiated, as undifferentiated: the rule's marks have no key there.
    (out, inters), _ = jax.jvp(jax.jit(stx.pull(rule_marked)), (x,), (t,))
    assert_tree_allclose((out, inters), (x, {}))
    # Undifferentiated, the rule does not run: no key.
    check_pull(rule_marked, rule_marked_ref, x, transforms=("plain", "jit", "vmap"))


def test_custom_jvp_rule_tangent_mark_under_linearize():
    # A pull around `linearize` and its linear map sees the rule run on the tangent: both marks.
    # Reverse mode computes no tangent: under grad the tangent's mark has no value and no key.
    x, t = jnp.float32(2.0), jnp.float32(1.0)
    out, inters = stx.pull(lambda x, t: jax.linearize(rule_marked, x)[1](t))(x, t)
    assert_tree_allclose((out, inters), (2 * t, {"x_0": 2 * x, "t_0": 3 * t}))
    grad, inters = stx.pull(jax.grad(rule_marked))(x)
    assert_tree_allclose((grad, inters), (2.0, {"x_0": 2 * x}))


def test_custom_jvp_rule_mark_under_grad_and_vmap_in_both_orders():
    xs = jnp.array([0.5, 2.0])
    # grad: the rule governs (d/dx = 2); the rule's mark is the primal's value in both orders.
    for g in (
        jax.grad(stx.pull(rule_marked), has_aux=True),
        stx.pull(jax.grad(rule_marked)),
    ):
        grads, inters = jax.vmap(g)(xs)
        assert_tree_allclose(grads, jnp.full(2, 2.0))
        assert_tree_allclose(inters, {"x_0": 2 * xs})
    # grad, vmapped inside pull.
    grads, inters = stx.pull(jax.vmap(jax.grad(rule_marked)))(xs)
    assert_tree_allclose((grads, inters), (jnp.full(2, 2.0), {"x_0": 2 * xs}))
    # jvp of a vmapped pull and pull of a vmapped jvp agree.
    ts = jnp.ones(2)
    a = jax.jvp(jax.vmap(stx.pull(rule_marked)), (xs,), (ts,))[0][1]
    b = stx.pull(jax.vmap(lambda x, t: jax.jvp(rule_marked, (x,), (t,))))(xs, ts)[1]
    assert_tree_allclose(a, {"x_0": 2 * xs})
    assert_tree_allclose(b, {"x_0": 2 * xs, "t_0": 3 * ts})


@jax.custom_jvp
def calls_itself(x):
    return jnp.tanh(stx.save_inter(x + 1.0, name="p"))


@calls_itself.defjvp
def _calls_itself_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = calls_itself(x)  # the primal again: its mark is the primal's, not a new one
    return y, stx.save_inter(1 - y**2, name="slope") * t


def test_custom_jvp_rule_that_calls_its_function_repeats_no_mark():
    x, t = jnp.float32(0.3), jnp.float32(1.0)
    y = jnp.tanh(x + 1)
    expected = {"p_0": x + 1, "slope_0": 1 - y**2}
    assert_tree_allclose(stx.pull(calls_itself)(x)[1], {"p_0": x + 1})
    (_, inters), (_, dinters) = jax.jvp(stx.pull(calls_itself), (x,), (t,))
    assert_tree_allclose(inters, expected)
    assert_tree_allclose(dinters, {"p_0": 0.0, "slope_0": 0.0})
    grad, inters = jax.grad(stx.pull(calls_itself), has_aux=True)(x)
    assert_tree_allclose((grad, inters), (1 - y**2, expected))


def test_nested_pull_does_not_collect_rule_marks_twice():
    def outer(x, t):
        (y, inters), _ = jax.jvp(stx.pull(rule_marked), (x,), (t,))
        return y + inters["x_0"]

    x, t = jnp.float32(2.0), jnp.float32(1.0)
    # The tangent's mark runs in the inner rule, inside the outer pull: it collects it once.
    assert_tree_allclose(stx.pull(outer)(x, t), (3 * x, {"t_0": 3 * t}))


def test_custom_vjp_fwd_and_bwd_marks_under_an_outer_vjp():
    out, vjp = jax.vjp(stx.pull(clip_grad), X)
    expected = {"primal_0": jnp.tanh(X), "fwd_0": jnp.tanh(X) * 10}
    assert_tree_allclose(out, (jnp.sum(jnp.tanh(X)), expected))
    (ct,) = vjp((jnp.float32(1.0), jax.tree.map(jnp.zeros_like, expected)))
    assert_tree_allclose(ct, jnp.full(3, 7.0))  # the custom bwd

    # bwd runs when the cotangent is known, after `pull` has returned: a pull around the
    # differentiation collects it (once: fwd's mark was the inner pull's).
    def outer(x):
        return jax.grad(lambda x: stx.pull(clip_grad)(x)[0])(x)

    grad, inters = stx.pull(outer)(X)
    assert_tree_allclose((grad, inters), (jnp.full(3, 7.0), {"bwd_0": 3.0}))

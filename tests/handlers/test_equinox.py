import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import pytest

import statax as stx
from statax.testing import assert_tree_allclose, check_pull

X = jnp.array([0.4, -0.9, 1.3])


def test_filter_checkpoint():
    def f(x):
        return jnp.sum(eqx.filter_checkpoint(lambda y: stx.save_inter(jnp.sin(y), name="s"))(x))

    check_pull(f, lambda x: (jnp.sum(jnp.sin(x)), {"s_0": jnp.sin(x)}), X)


def body(c):
    return stx.save_inter(c * 1.5 + 0.1, name="b")


def cond(c):
    return c < 2.0


def loop_ref(x):
    c, last, steps = x, 0.0, []
    while c < 2.0:
        c = c * 1.5 + 0.1
        last = c
        steps.append(c)
    return c, last, steps


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
@pytest.mark.parametrize("x", [0.5, 3.0])  # 3.0: the body never runs
def test_equinox_while_loop_gives_last_iteration(kind, x):
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=16, kind=kind)

    c, last, _ = loop_ref(x)
    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        assert_tree_allclose(g(x), (c, {"b_0": last}))
    if kind == "checkpointed":
        grad, inters = jax.grad(stx.pull(f), has_aux=True)(x)
        assert_tree_allclose(inters, {"b_0": last})


@pytest.mark.parametrize("max_steps", [4, 20, 4096])  # 4096: diffrax's DirectAdjoint
@pytest.mark.parametrize("x", [0.5, 3.0])
def test_equinox_bounded_while_loop_is_a_while_loop(max_steps, x):
    # A bounded loop is nested scans of conds inside equinox; to its user it is a while loop:
    # the last iteration that ran, zeros if none, whatever max_steps (and so the nesting) is.
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=max_steps, kind="bounded")

    c, steps = x, []
    while c < 2.0 and len(steps) < max_steps:
        c = c * 1.5 + 0.1
        steps.append(c)
    last = steps[-1] if steps else 0.0
    assert_tree_allclose(stx.pull(f)(x), (c, {"b_0": last}))
    assert_tree_allclose(jax.jit(stx.pull(f))(x), (c, {"b_0": last}))
    grad, inters = jax.grad(stx.pull(f), has_aux=True)(x)
    assert_tree_allclose((grad, inters), (jax.grad(f)(x), {"b_0": last}))


def count_body():
    def body(c):
        stx.save_inter((c == c).astype(jnp.int32), name="n", reduce="sum")
        stx.save_inter(c * 2, name="v")
        return c * 2

    return body


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_equinox_while_loop_under_vmap_is_per_example(kind):
    # equinox runs every example until all are done and masks its own state; the marks are
    # each example's own, as for lax.while_loop: its iteration count, its last value, zeros
    # where the body never ran.
    def f(x):
        return eqxi.while_loop(lambda c: c < 10.0, count_body(), x, max_steps=16, kind=kind)

    def g(x):
        return jax.lax.while_loop(lambda c: c < 10.0, count_body(), x)

    xs = jnp.array([0.5, 3.0, 20.0])
    expected = (
        jnp.array([16.0, 12.0, 20.0]),
        {"n": jnp.array([5, 2, 0]), "v_0": jnp.array([16.0, 12.0, 0.0])},
    )
    for h in (stx.pull(jax.vmap(f)), jax.vmap(stx.pull(f)), stx.pull(jax.vmap(g))):
        assert_tree_allclose(h(xs), expected)


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_equinox_while_loop_under_vmap_orders_agree(kind):
    def f(x):
        return eqxi.while_loop(cond, body, x, max_steps=8, kind=kind)

    xs = jnp.array([0.5, 1.9, 3.0])
    assert_tree_allclose(stx.pull(jax.vmap(f))(xs), jax.vmap(stx.pull(f))(xs))


def test_noinline():
    def g(x):
        return stx.save_inter(x * 3, name="n") + 1

    def f(x):
        return jnp.sum(eqxi.noinline(g)(x) * 2)

    def ref(x):
        return jnp.sum((x * 3 + 1) * 2), {"n_0": x * 3}

    check_pull(f, ref, X, transforms=("plain", "jit", "vmap", "grad"))
    # Unpulled, the call stays a noinline.
    assert any(e.primitive.name == "noinline" for e in jax.make_jaxpr(f)(X).eqns)


def test_noinline_function_is_traced_once_per_pull(monkeypatch):
    from statax.handlers import equinox as handler

    traced = []
    original = handler.trace
    monkeypatch.setattr(handler, "trace", lambda *a, **k: traced.append(1) or original(*a, **k))

    def f(x):
        return eqxi.noinline(lambda y: stx.save_inter(y * 3, name="n"))(x)

    assert_tree_allclose(stx.pull(f)(X)[1], {"n_0": X * 3})
    assert len(traced) == 1  # finding the mark and rewriting the call share one trace

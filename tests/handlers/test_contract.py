"""The handler contract: a `Rewrite` adds outputs *and* inputs to an equation.

A handler for a primitive of our own adds an input by hand; then every built-in handler
threads a planted value (`stx.plant`: a mark that takes its value in from outside) to the mark
inside, checked against the same function written by hand to take the value as an argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import statax as stx
from statax import extend
from statax.testing import assert_tree_allclose

once_call_p = Primitive("once_call")
once_call_p.multiple_results = True
once_call_p.def_impl(lambda *args, jaxpr: jaxpr_as_fun(jaxpr)(*args))
once_call_p.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)
mlir.register_lowering(
    once_call_p,
    mlir.lower_fun(lambda *args, jaxpr: jaxpr_as_fun(jaxpr)(*args), multiple_results=True),
)


def once_call(f, x):
    (out,) = once_call_p.bind(x, jaxpr=jax.make_jaxpr(lambda y: [f(y)])(x))
    return out


def by_hand_handler(eqn):
    # The contract written out: fresh input variables after the original inputs, fresh
    # output variables after the original outputs, and their metas.
    inner, outs, ins = extend.pull_jaxpr(eqn.params["jaxpr"])
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    new = eqn.replace(
        invars=[*eqn.invars, *(jex.Var(a) for a in inner.in_avals[n_in:])],
        outvars=[*eqn.outvars, *(jex.Var(a) for a in inner.out_avals[n_out:])],
        params=dict(eqn.params, jaxpr=inner),
    )
    return extend.Rewrite(new, outs, ins)


def inner_fn(y):
    return jnp.sin(stx.save_inter(y * 2, name="h")) + 1


def test_a_handler_that_adds_an_input():
    extend.register_handler(once_call_p, by_hand_handler)
    try:
        f = lambda x: once_call(inner_fn, x) * 3  # noqa: E731
        x, value = jnp.arange(3.0), jnp.array([0.5, -1.0, 2.0])
        # Collecting: one output.
        out, inters = stx.pull(f)(x)
        assert_tree_allclose((out, inters), (f(x), {"h_0": x * 2}))
        # Planting: the planted mark takes its choice and value in, through the primitive.
        planted = lambda x, v: stx.plant(f)({"h_0": v}, x)  # noqa: E731
        assert_tree_allclose(planted(x, value), (jnp.sin(value) + 1) * 3)
        (call,) = jax.make_jaxpr(planted)(x, value).eqns  # the pulled function, one jit
        (eqn,) = [
            e for e in extend.params.jit_jaxpr(call.params).eqns if e.primitive is once_call_p
        ]
        assert len(eqn.invars) == 3 and len(eqn.outvars) == 2  # x, choice, value; out, h
    finally:
        extend.unregister_handler(once_call_p)
    with pytest.raises(stx.UnhandledPrimitiveError):  # unregistered: an error again
        stx.pull(lambda x: once_call(inner_fn, x))(1.0)


def test_a_handler_that_miscounts_its_inputs_is_reported():
    def bad(eqn):
        new, outs, ins = by_hand_handler(eqn)
        return extend.Rewrite(new.replace(invars=new.invars[:1]), outs, ins)

    extend.register_handler(once_call_p, bad)
    try:
        match = r"`once_call` returned an equation with 1 inputs"
        with pytest.raises(stx.HandlerError, match=match):
            stx.plant(lambda x: once_call(inner_fn, x))({"h": 2.0}, 1.0)
    finally:
        extend.unregister_handler(once_call_p)


V = jnp.array([0.5, -1.0, 2.0])
MESH = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("s",))


def _scan(x):
    def step(c, xi):
        h = stx.save_inter(xi * c, name="h")
        return c + h, h

    return lax.scan(step, 1.0, x)


def _scan_by_hand(x, hs):
    def step(c, h):
        return c + h, h

    return lax.scan(step, 1.0, hs)


def _while(x):
    def body(c):
        i, acc = c
        return i + 1, acc + stx.save_inter(acc * 2, name="h")

    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))


def _while_by_hand(x, h):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + h), (0, x))


@jax.custom_jvp
def _custom(x):
    return jnp.cos(stx.save_inter(x * 3, name="h"))


_custom.defjvp(lambda p, t: (_custom(p[0]), -jnp.sin(p[0] * 3) * 3 * t[0]))


@jax.custom_vjp
def _custom_vjp(x):
    return jnp.cos(stx.save_inter(x * 3, name="h"))


_custom_vjp.defvjp(lambda x: (_custom_vjp(x), x), lambda x, ct: (-jnp.sin(x * 3) * 3 * ct,))


def _solve(x):
    def matvec(v):
        return 2.0 * v

    def solve(mv, b):
        return stx.save_inter(b / 2.0, name="h")

    return lax.custom_linear_solve(matvec, x, solve, symmetric=True)


_smap = jax.shard_map(
    lambda x: stx.save_inter(x * 2, name="h") + 1, mesh=MESH, in_specs=P("s"), out_specs=P("s")
)

# (function, by hand taking the planted value, planted value(s), x)
CASES = {
    "jit": (jax.jit(lambda x: stx.save_inter(x * 2, name="h") + x), lambda x, h: h + x, V, V),
    "checkpoint": (
        jax.checkpoint(lambda x: jnp.sin(stx.save_inter(x * 2, name="h"))),
        lambda x, h: jnp.sin(h),
        V,
        V,
    ),
    "scan: one value per iteration": (_scan, _scan_by_hand, V * 3, V),
    "while: one value, every iteration": (_while, _while_by_hand, V * 3, V),
    "cond: the branch that runs": (
        lambda x: lax.cond(x[0] > 0, lambda: stx.save_inter(x, name="h") * 2, lambda: -x),
        lambda x, h: jnp.where(x[0] > 0, h * 2, -x),
        V * 3,
        V,
    ),
    "custom_jvp": (_custom, lambda x, h: jnp.cos(h), V * 3, V),
    "custom_vjp": (_custom_vjp, lambda x, h: jnp.cos(h), V * 3, V),
    "custom_linear_solve": (_solve, lambda x, h: h, V * 3, V),
    "shard_map: one row per shard": (
        _smap,
        lambda x, h: h.reshape(x.shape) + 1,
        jnp.array([[1.0, 2.0], [3.0, 4.0]]),
        jnp.arange(4.0),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_every_handler_threads_a_planted_value(case):
    f, by_hand, value, x = CASES[case]
    expected = jax.tree.leaves(by_hand(x, value))
    assert_tree_allclose(jax.tree.leaves(stx.plant(f)({"h_0": value}, x)), expected)
    assert_tree_allclose(jax.tree.leaves(jax.jit(stx.plant(f))({"h": value}, x)), expected)
    # Pulled, the intermediate is what it now is.
    _, inters = stx.pull(lambda x, v: stx.plant(f)({"h": v}, x))(x, value)
    assert_tree_allclose(inters, {"h_0": value})


def test_a_planted_custom_derivative_is_differentiated_as_written():
    # Planting changes the function, so its custom rule no longer describes it: the planted
    # function is differentiated as written (h no longer depends on x).
    def f(x):
        return _custom(x).sum()

    planted = lambda x, h: stx.plant(f)({"h": h}, x)  # noqa: E731
    assert_tree_allclose(jax.grad(planted)(V, V * 3), jnp.zeros(3))
    assert_tree_allclose(jax.grad(planted, argnums=1)(V, V * 3), -jnp.sin(V * 3))
    assert_tree_allclose(jax.grad(f)(V), -jnp.sin(V * 3) * 3)  # unplanted: the custom rule


def test_under_vmap_a_planted_value_comes_in_per_example():
    # A scan under an inner vmap is rebatched; the planted value has the batch axis first.
    xs = jnp.stack([V, V * 2])
    values = jnp.stack([V * 3, V * 5])
    out = stx.plant(jax.vmap(_scan))({"h": values}, xs)
    assert_tree_allclose(out, jax.vmap(_scan_by_hand)(xs, values))
    # An unbatched value is broadcast over the batch.
    out = stx.plant(jax.vmap(_scan))({"h": V * 3}, xs)
    assert_tree_allclose(out, jax.vmap(_scan_by_hand, in_axes=(0, None))(xs, V * 3))


def _total(tree):
    return sum(jnp.sum(x) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", CASES)
def test_planted_values_under_vmap_and_grad_in_both_orders(case):
    f, by_hand, value, x = CASES[case]
    xs, values = jnp.stack([x, x * 0.5]), jnp.stack([value, value * -2.0])
    expected = jax.vmap(by_hand)(xs, values)
    # vmap(plant(f)) and plant(vmap(f)), the values batched along with the inputs.
    outer = jax.vmap(lambda x, v: stx.plant(f)({"h": v}, x))(xs, values)
    inner = stx.plant(jax.vmap(f))({"h": values}, xs)
    for got in (outer, inner):
        assert_tree_allclose(jax.tree.leaves(got), jax.tree.leaves(expected), rtol=1e-5)
    if case.startswith("while"):
        return  # JAX cannot reverse-differentiate a while loop
    # grad(plant(f)), in the input and the value; plant(grad(f)): the value is a constant there.
    planted = lambda x, v: _total(stx.plant(f)({"h": v}, x))  # noqa: E731
    reference = lambda x, v: _total(by_hand(x, v))  # noqa: E731
    assert_tree_allclose(
        jax.grad(planted, argnums=(0, 1))(x, value),
        jax.grad(reference, argnums=(0, 1))(x, value),
        rtol=1e-5,
    )
    inner = stx.plant(jax.grad(lambda x: _total(f(x))))({"h_0": value}, x)
    if case.startswith("custom"):
        # JAX applies a custom rule while tracing the inner grad, before plant sees the
        # function: the rule gives the derivative, at the original primal (a linear solve's
        # transposed solve is a second occurrence, h_1, left as it is here).
        assert_tree_allclose(inner, jax.grad(lambda x: _total(f(x)))(x), rtol=1e-5)
    else:
        assert_tree_allclose(inner, jax.grad(reference)(x, value), rtol=1e-5)

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import statax as stx
from statax._jax import jaxprs as _compat
from statax.testing import assert_tree_allclose, hlo_ops

X = jnp.array([0.5, -1.0, 2.0])


@jax.jit
def attention(x):
    return stx.save_inter(jnp.tanh(x), name="attn")


def encoder(x):
    with stx.scope("encoder"):
        with stx.scope("layer0"):
            x = attention(x)
        x = lax.scan(lambda c, _: (attention(c), None), x, None, length=2)[0]
    with stx.scope("decoder"):
        x = jax.vmap(attention)(x)
    return x


def test_scopes_nest_and_hold_across_jit_scan_and_vmap():
    _, inters = stx.pull(encoder)(X)
    assert list(inters) == ["encoder/layer0/attn_0", "encoder/attn_0", "decoder/attn_0"]
    # The same jitted function, traced once per scope: names follow the scope of each call.
    t0 = jnp.tanh(X)
    assert_tree_allclose(
        inters["encoder/attn_0"], jnp.stack([jnp.tanh(t0), jnp.tanh(jnp.tanh(t0))])
    )


def test_scope_as_decorator():
    @stx.scope("block")
    def block(x):
        return stx.save_inter(x + 1, name="out")

    assert list(stx.pull(block)(X)[1]) == ["block/out_0"]
    assert list(stx.pull(lambda x: stx.save_inter(x, name="out"))(X)[1]) == ["out_0"]


def test_scope_name_must_be_a_string():
    with pytest.raises(TypeError, match="non-empty string"):
        stx.scope(3)


def many(x):
    a = stx.save_inter(jnp.sin(x) @ jnp.ones((3, 3)), name="encoder/a")
    stx.save_inter(jnp.exp(jnp.cos(x) * 3) @ jnp.ones((3, 3)), name="encoder/b")
    stx.save_inter(jnp.tanh(x) * 7, name="decoder/c")
    return jnp.sum(a)


@pytest.mark.parametrize(
    "only, keys",
    [
        ("encoder/a", ["encoder/a_0"]),
        (["encoder/a", "decoder/c"], ["encoder/a_0", "decoder/c_0"]),
        (re.compile("encoder/.*"), ["encoder/a_0", "encoder/b_0"]),
        (lambda meta: meta.name.endswith("c"), ["decoder/c_0"]),
    ],
)
def test_only_selects_by_name_regex_or_predicate(only, keys):
    for g in (stx.pull(many, only=only), stx.pull(jax.jit(many), only=only)):
        assert list(g(X)[1]) == keys


def test_unselected_work_disappears_from_the_compiled_program():
    everything = hlo_ops(stx.pull(many), X)
    only_a = hlo_ops(stx.pull(many, only="encoder/a"), X)
    nothing = hlo_ops(stx.pull(many, only=[]), X)
    assert len(nothing) < len(only_a) < len(everything)
    assert nothing == hlo_ops(many, X)


def test_only_with_a_bad_argument_is_a_type_error():
    with pytest.raises(TypeError, match="only=..."):
        stx.pull(many, only=3)


def test_unselected_mark_in_an_unhandled_primitive_is_not_an_error():
    from .helpers import twice_call

    def f(x):
        stx.save_inter(x, name="kept")
        return twice_call(lambda y: stx.save_inter(y * 2, name="hidden"), x)

    assert list(stx.pull(f, only="kept")(1.0)[1]) == ["kept_0"]


def test_only_is_in_force_where_marks_are_bound_also_in_a_rebatched_loop():
    # Under pull(vmap(f)) a scan holding marks is rewritten while vmap batches it, before the
    # rewrite of the whole: the selection must already hold there, so that the unselected "b"
    # is not stacked by the scan (and computed) only to be dropped.
    def f(x):
        def step(c, _):
            stx.save_inter(c, name="a")
            stx.save_inter(jnp.sin(c) * 3, name="b")
            return c * 2, None

        return jax.lax.scan(step, x, None, length=4)[0]

    def scan_outputs(g, xs):
        jaxpr = jax.make_jaxpr(g)(xs)
        found = []

        def walk(j):
            for eqn in j.eqns:
                if eqn.primitive.name == "scan":
                    found.append(len(eqn.outvars))
                for sub in _compat.jaxprs_in_params(eqn.params):
                    walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

        walk(jaxpr.jaxpr)
        return found

    xs = jnp.array([1.0, 2.0, 3.0])
    for g in (stx.pull(jax.vmap(f), only="a"), jax.vmap(stx.pull(f, only="a"))):
        out, inters = g(xs)
        assert list(inters) == ["a_0"]
        assert jnp.allclose(inters["a_0"], jnp.outer(xs, 2.0 ** jnp.arange(4)))
    # One carry and one stacked "a": nothing for "b".
    assert scan_outputs(stx.pull(jax.vmap(f), only="a"), xs) == [2]
    assert scan_outputs(stx.pull(jax.vmap(f)), xs) == [3]


def test_off_switch_returns_no_intermediates_and_the_plain_program():
    out, inters = stx.pull(many, enabled=False)(X)
    assert inters == {} and jnp.allclose(out, many(X))
    assert hlo_ops(stx.pull(many, enabled=False), X) == hlo_ops(many, X)


def test_off_switch_as_a_static_argument_under_jit():
    step = jax.jit(lambda x, collect: stx.pull(many, enabled=collect)(x), static_argnums=1)
    assert step(X, False)[1] == {}
    assert sorted(step(X, True)[1]) == ["decoder/c_0", "encoder/a_0", "encoder/b_0"]

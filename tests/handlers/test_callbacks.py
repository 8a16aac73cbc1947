"""Host callbacks and PRNG primitives (`statax/handlers/callbacks.py`): they hold Python
functions but run no code of a user's that marks, so `pull` never traces their impl: a
callback runs only when the program runs, and the marks around it come back as by hand."""

import jax
import jax.numpy as jnp
import numpy as np

import statax as stx
from statax.testing import assert_tree_allclose

X = jnp.array([0.5, -1.0, 2.0])


def test_a_pure_callback_runs_only_when_the_program_runs():
    calls = []

    def host(x):
        calls.append(1)
        return np.sin(x)

    def f(x):
        h = stx.save_inter(x * 2.0, name="h")
        y = jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        return stx.save_inter(y + 1.0, name="out")

    want = (jnp.sin(X * 2.0) + 1.0, {"h_0": X * 2.0, "out_0": jnp.sin(X * 2.0) + 1.0})
    assert_tree_allclose(stx.pull(f)(X), want, rtol=1e-6)
    assert len(calls) == 1  # run once, eagerly: never while pull traced
    assert_tree_allclose(jax.jit(stx.pull(f))(X), want, rtol=1e-6)
    assert len(calls) == 2


def test_debug_print_and_random_keys_beside_marks(capsys):
    def f(x, key):
        jax.debug.print("h={h}", h=x.sum())
        noise = jax.random.normal(key, x.shape)
        return stx.save_inter(x + noise, name="h")

    key = jax.random.key(0)
    out, inters = jax.jit(stx.pull(f))(X, key)
    want = X + jax.random.normal(key, X.shape)
    assert_tree_allclose((out, inters), (want, {"h_0": want}), rtol=1e-6)
    assert "h=1.5" in capsys.readouterr().out


def test_callbacks_and_prng_are_declared_to_run_no_marking_python():
    from statax._core.registry import rules_for

    def f(x, key):
        jax.debug.print("{}", x)
        y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y + jax.random.normal(jax.random.wrap_key_data(jax.random.key_data(key)), x.shape)

    eqns = jax.make_jaxpr(f)(X, jax.random.key(0)).eqns
    declared = {e.primitive.name: rules_for(e).runs_python for e in eqns}
    for name in ("pure_callback", "random_wrap"):
        assert declared[name] is False, (name, declared)
    # jax.debug.print is `debug_print` in newer JAX, a `debug_callback` before
    assert {"debug_print", "debug_callback"} & set(declared)
    for name in {"debug_print", "debug_callback"} & set(declared):
        assert declared[name] is False, (name, declared)

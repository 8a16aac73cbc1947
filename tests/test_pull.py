"""`pull` against hand-written references: naming, pytrees, composition, DCE, caching."""

import functools
import gc
import inspect
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import statax as stx
from statax._drivers.naming import origins
from statax.testing import assert_tree_allclose, check_pull


def f_two_layers(x):
    h = stx.save_inter(jnp.tanh(x * 2.0), name="h")
    g = stx.save_inter(jnp.sin(h) + x, name="h")
    stx.save_inter({"sq": h**2, "id": h}, name="stats")
    return jnp.sum(g * h)


def ref_two_layers(x):
    h = jnp.tanh(x * 2.0)
    g = jnp.sin(h) + x
    return jnp.sum(g * h), {"h_0": h, "h_1": g, "stats_0": {"sq": h**2, "id": h}}


X = jnp.array([0.1, -0.4, 0.7])


def test_composition_matrix():
    check_pull(f_two_layers, ref_two_layers, X)


def test_keys_count_each_name_in_program_order():
    _, inters = stx.pull(f_two_layers)(X)
    assert list(inters) == ["h_0", "h_1", "stats_0"]


@jax.jit
def _doubled(z):
    return stx.save_inter(z * 2, name="a")


def test_marks_at_the_top_level_and_inside_equations_count_in_program_order():
    # pull takes the marks at its own level as they are made, and finds the others in the
    # equations that hold them (a jit, a scan, a vmap's batched mark, a cached jit): one
    # count per name across both, in program order.
    def f(x):
        stx.save_inter(x, name="a")
        y = _doubled(x)
        stx.save_inter(y + 1, name="a")
        z = jax.vmap(lambda t: stx.save_inter(t * 3, name="a"))(x)
        c, _ = lax.scan(lambda c, t: (stx.save_inter(c + t, name="b"), None), 0.0, x)
        stx.save_inter(z + c, name="b")
        return jnp.sum(_doubled(z))

    def ref(x):
        c = jnp.cumsum(x)
        inters = {"a_0": x, "a_1": 2 * x, "a_2": 2 * x + 1, "a_3": 3 * x}
        inters.update({"b_0": c, "b_1": 3 * x + c[-1], "a_4": 6 * x})  # a scan stacks
        return jnp.sum(6 * x), inters

    for _ in range(2):  # the second time, `_doubled`'s trace comes from jit's cache
        out, inters = stx.pull(f)(X)
        assert_tree_allclose((out, inters), ref(X))
        assert list(inters) == list(ref(X)[1])
    check_pull(f, ref, X)


def test_keys_stay_unique_when_user_names_look_generated():
    def f(x):
        stx.save_inter(x, name="y")
        stx.save_inter(x + 1, name="y_0")
        stx.save_inter(x + 2, name="y")
        stx.save_inter(x + 3, name="y_0_0")
        return x

    _, inters = stx.pull(f)(1.0)
    assert list(inters) == ["y_0", "y_0_0", "y_1", "y_0_0_0"]
    assert [float(v) for v in inters.values()] == [1.0, 2.0, 3.0, 4.0]


def test_a_container_of_one_array_keeps_its_structure():
    def f(x):
        stx.save_inter({"a": x * 2}, name="d")
        stx.save_inter([x + 1], name="l")
        stx.save_inter(x, name="x")
        return jnp.sum(x)

    def ref(x):
        return jnp.sum(x), {"d_0": {"a": x * 2}, "l_0": [x + 1], "x_0": x}

    check_pull(f, ref, X)


def test_non_array_leaves_pass_through_unchanged():
    fn = jax.nn.relu

    def f(x):
        stx.save_inter((x, "label", None, fn, 3.5), name="mixed")
        return x

    _, inters = stx.pull(jax.jit(f))(jnp.ones(2))
    arr, label, none, func, number = inters["mixed_0"]
    assert (label, none, func, number) == ("label", None, fn, 3.5)
    assert_tree_allclose(arr, jnp.ones(2))


def test_unhashable_static_leaf_passes_through():
    class Unhashable:
        __hash__ = None

    obj = Unhashable()

    def f(x):
        stx.save_inter((x, obj), name="u")
        return x

    assert stx.pull(f)(1.0)[1]["u_0"][1] is obj


def test_constants_are_collected():
    def f(x):
        stx.save_inter(jnp.arange(3.0), name="const")
        return x

    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f)), stx.pull(jax.grad(f))):
        assert_tree_allclose(g(1.0)[1], {"const_0": jnp.arange(3.0)})


def unused_mark(x):
    stx.save_inter(x * 3.0, name="unused")
    jax.jit(lambda y: stx.save_inter(y * 5.0, name="in_dead_jit"))(x)
    return jnp.sin(stx.save_inter(x * 2.0, name="used"))


def unused_mark_ref(x):
    return jnp.sin(x * 2.0), {"unused_0": x * 3.0, "in_dead_jit_0": x * 5.0, "used_0": x * 2.0}


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.grad(jax.jit(f)),
        lambda f: jax.grad(jax.checkpoint(f)),
        lambda f: jax.grad(jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)),
        lambda f: jax.grad(jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable)),
        lambda f: jax.jit(jax.grad(jax.jit(f))),
        lambda f: jax.grad(jax.grad(f)),
    ],
)
def test_unused_values_survive_dead_code_elimination_and_remat_collects_once(transform):
    out, inters = stx.pull(transform(unused_mark))(0.3)
    assert_tree_allclose(inters, unused_mark_ref(0.3)[1])


def test_inner_grad_saves_the_primal():
    out, inters = stx.pull(jax.grad(f_two_layers))(X)
    assert_tree_allclose(inters, ref_two_layers(X)[1])
    assert_tree_allclose(out, jax.grad(lambda x: ref_two_layers(x)[0])(X))


def test_inner_vmap_any_in_axes_puts_the_batch_axis_first():
    xs = jnp.arange(6.0).reshape(3, 2) / 10

    for in_axes, data in ((0, xs), (1, xs.T)):
        _, inters = stx.pull(jax.vmap(f_two_layers, in_axes=in_axes))(data)
        assert_tree_allclose(inters, jax.vmap(ref_two_layers)(xs)[1])


def test_value_not_depending_on_the_batch_stays_unbatched():
    def f(x):
        stx.save_inter(jnp.ones(2), name="const")
        return x

    _, inters = stx.pull(jax.vmap(f))(jnp.ones(5))
    assert inters["const_0"].shape == (2,)


def test_hessian_in_both_orders():
    def f(x):
        return jnp.sum(stx.save_inter(jnp.sin(x), name="s") ** 2)

    ref = jax.hessian(lambda x: jnp.sum(jnp.sin(x) ** 2))(X)
    assert_tree_allclose(stx.pull(jax.hessian(f))(X), (ref, {"s_0": jnp.sin(X)}))
    assert_tree_allclose(jax.hessian(stx.pull(f), has_aux=True)(X), (ref, {"s_0": jnp.sin(X)}))


class MLP(eqx.Module):
    layers: list
    activation: callable = eqx.field(static=True, default=jax.nn.relu)
    label: str = "mlp"

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = stx.save_inter(self.activation(layer(x)), name=f"layer{i}")
        return x


def test_equinox_module_and_loss_of_module():
    model = MLP(jax.random.key(0))

    def ref(m, x):
        h0 = jax.nn.relu(m.layers[0](x))
        h1 = jax.nn.relu(m.layers[1](h0))
        return h1, {"layer0_0": h0, "layer1_0": h1}

    assert_tree_allclose(stx.pull(model)(X), ref(model, X))
    assert_tree_allclose(eqx.filter_jit(stx.pull(model))(X), ref(model, X))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    def loss_ref(m, x):
        out, inters = ref(m, x)
        return jnp.sum(out**2), inters

    for fn in (stx.pull(loss), stx.pull(eqx.filter_jit(loss)), eqx.filter_jit(stx.pull(loss))):
        assert_tree_allclose(fn(model, X), loss_ref(model, X))
    grads, inters = eqx.filter_grad(stx.pull(loss), has_aux=True)(model, X)
    assert_tree_allclose(grads, eqx.filter_grad(lambda m, x: loss_ref(m, x)[0])(model, X))
    assert_tree_allclose(inters, loss_ref(model, X)[1])
    assert_tree_allclose(stx.pull(eqx.filter_grad(loss))(model, X)[1], loss_ref(model, X)[1])


def test_module_weights_are_traced_not_baked_in():
    model = MLP(jax.random.key(0))
    model2 = jax.tree_util.tree_map(lambda x: x * 2 if eqx.is_array(x) else x, model)
    pulled = stx.pull(model)
    assert_tree_allclose(stx.pull(model2)(X)[1]["layer0_0"], jax.nn.relu(model2.layers[0](X)))
    assert pulled(X)[1]["layer0_0"] is not None


def test_nested_pull_consumes_its_own_marks():
    def inner(x):
        stx.save_inter(x * 2, name="inner")
        return x + 1

    def outer(x):
        y, inters = stx.pull(inner)(x)
        stx.save_inter(inters["inner_0"] + 100, name="outer")
        return y

    for g in (stx.pull(outer), stx.pull(jax.jit(outer)), jax.jit(stx.pull(outer))):
        out, inters = g(1.0)
        assert_tree_allclose(inters, {"outer_0": 102.0})


@pytest.mark.fast_paths
def test_traced_pull_stages_what_returning_the_marks_by_hand_does():
    # Where a jaxpr is being staged, `pull(f)` traces `f` into it and adds nothing.
    def by_hand(x):  # f_two_layers, returning its marks itself
        h = jnp.tanh(x * 2.0)
        g = jnp.sin(h) + x
        stats = {"sq": h**2, "id": h}
        return jnp.sum(g * h), {"h_0": h, "h_1": g, "stats_0": stats}

    assert str(jax.make_jaxpr(stx.pull(f_two_layers))(X)) == str(jax.make_jaxpr(by_hand)(X))


def test_traced_pull_rewrites_only_what_it_staged():
    # In one trace, a scan holding a mark staged before an inner pull is not the inner
    # pull's: it stays, and the enclosing pull collects it.
    def scanned(x, name):
        return lax.scan(lambda c, t: (stx.save_inter(c * t, name=name), None), 1.0, x)[0]

    def outer(x):
        before = scanned(x, "before")
        inner, inters = stx.pull(lambda x: scanned(x + 1, "inner"))(x)
        return before + inner + inters["inner_0"][-1]

    def ref(x):
        before, inner = jnp.cumprod(x), jnp.cumprod(x + 1)
        return before[-1] + 2 * inner[-1], {"before_0": before}

    for g in (stx.pull(outer), jax.jit(stx.pull(outer)), stx.pull(jax.jit(outer))):
        assert_tree_allclose(g(X), ref(X))


def test_traced_pull_keeps_the_constants_of_what_it_rewrites():
    # A constant that only a rewritten equation reads stays in the jaxpr.
    def f(x):
        ys = jnp.array([1.0, -2.0, 3.0])
        return lax.scan(lambda c, y: (c, stx.save_inter(c * y, name="v")), x, ys)[0]

    expected = (2.0, {"v_0": jnp.array([2.0, -4.0, 6.0])})
    assert_tree_allclose(jax.jit(stx.pull(f))(2.0), expected)
    assert_tree_allclose(stx.pull(f)(2.0), expected)


def test_traced_pull_rewriting_in_place_keeps_static_outputs():
    def f(x):
        ys = lax.scan(lambda c, t: (c, stx.save_inter(c * t, name="v")), x, jnp.arange(3.0))[1]
        return ys, "train", 2.0

    def g(x):
        (ys, mode, scale), inters = stx.pull(f)(x)
        assert (mode, scale) == ("train", 2.0)
        return ys * scale, inters

    expected = (jnp.arange(3.0) * 4.0, {"v_0": jnp.arange(3.0) * 2.0})
    assert_tree_allclose(jax.jit(g)(2.0), expected)


def test_a_python_float_argument_is_saved_traced_or_not():
    def f(x, scale):
        stx.save_inter(scale, name="scale")
        return x * scale

    expected = (jnp.float32(6.0), {"scale_0": jnp.float32(2.0)})
    assert_tree_allclose(stx.pull(f)(3.0, 2.0), expected)
    assert_tree_allclose(jax.jit(lambda x: stx.pull(f)(x, 2.0))(3.0), expected)


def test_static_arguments_and_outputs():
    def f(x, mode, scale=2.0):
        stx.save_inter(x * scale, name=mode)
        return x, mode

    (out, mode), inters = stx.pull(f)(jnp.ones(2), "train", scale=3.0)
    assert mode == "train" and list(inters) == ["train_0"]
    assert_tree_allclose(inters["train_0"], 3 * jnp.ones(2))


def test_python_int_and_bool_arguments_are_static():
    def f(x, n, flag):
        assert isinstance(n, int) and isinstance(flag, bool)
        return stx.save_inter(x * n if flag else x, name="x")

    assert_tree_allclose(stx.pull(f)(jnp.ones(2), 3, True)[1], {"x_0": 3 * jnp.ones(2)})


def test_python_float_argument_is_traced_not_static():
    count = []

    def f(x):
        count.append(1)
        return stx.save_inter(x * 2, name="x2")

    g = stx.pull(jax.jit(f))
    assert_tree_allclose(g(1.0), (2.0, {"x2_0": 2.0}))
    assert_tree_allclose(g(5.0), (10.0, {"x2_0": 10.0}))
    assert len(count) == 1
    assert jax.make_jaxpr(stx.pull(f))(1.0).in_avals[0].weak_type  # traced, weakly typed


def test_a_plain_function_is_traced_at_every_call():
    """What it reads from outside its arguments may have changed since: a kept trace would
    answer for the function as it was."""
    traces = []

    def f(x, label="a"):
        traces.append(label)
        return stx.save_inter(x + 1, name="y")

    for _ in range(3):
        stx.pull(f)(jnp.ones(3))
    assert traces == ["a"] * 3


def test_a_jitted_function_keeps_jax_jits_trace():
    traces = []

    def f(x, label="a"):
        traces.append(label)
        return stx.save_inter(x + 1, name="y")

    g = jax.jit(f, static_argnames="label")
    for _ in range(3):
        stx.pull(g)(jnp.ones(3))  # a fresh pull of the same function each time
    assert traces == ["a"]
    stx.pull(g)(jnp.ones(4))  # new shape
    stx.pull(g)(jnp.ones(3, jnp.int32))  # new dtype
    stx.pull(g)(jnp.ones(3), label="b")  # new static value
    stx.pull(g)(jnp.ones(3), label="b")
    assert traces == ["a", "a", "a", "b"]


def test_repeated_calls_do_not_redo_the_rewrite_of_a_jitted_function(monkeypatch):
    import statax._drivers.entries as entries_module

    calls = []
    original = entries_module.pull_collected
    monkeypatch.setattr(
        entries_module, "pull_collected", lambda *a: calls.append(1) or original(*a)
    )

    def f(x):
        return stx.save_inter(x + 1)

    jitted = jax.jit(f)
    for _ in range(3):
        stx.pull(jitted)(jnp.ones(3))
    assert len(calls) == 1
    for _ in range(3):
        stx.pull(f)(jnp.ones(3))  # traced, and rewritten, at every call
    assert len(calls) == 4


def test_cache_does_not_keep_dead_functions_alive():
    def make():
        def f(x):
            return stx.save_inter(x * 2)

        return f

    f = make()
    stx.pull(f)(jnp.ones(2))
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def _jitted_layers(n):
    @jax.jit
    def f(x):
        for i in range(n):
            x = stx.save_inter(jnp.tanh(x) + i, name=f"l{i}")
        return jnp.sum(x)

    def ref(x):
        inters = {}
        for i in range(n):
            x = inters[f"l{i}_0"] = jnp.tanh(x) + i
        return jnp.sum(x), inters

    return f, ref


@pytest.mark.fast_paths
def test_eager_calls_of_a_jitted_function_run_compiled(monkeypatch):
    import statax._drivers.compiled as compiled_module
    import statax._drivers.pull as pull_module

    f, ref = _jitted_layers(12)
    pulled = stx.pull(f)
    xs = [X + k for k in range(4)]  # arrays of one kind (as jit's cache tells them apart)
    out, inters = pulled(xs[0])  # the first call evaluates, and keeps a compiled evaluation
    assert_tree_allclose((out, inters), ref(xs[0]))
    locations = origins(inters)
    assert all("test_pull.py:" in where for where in locations.values())
    evaluated = []
    original = pull_module.evaluate  # (what both paths evaluate with: entries.evaluate)
    for module in (pull_module, compiled_module):
        monkeypatch.setattr(module, "evaluate", lambda *a: evaluated.append(1) or original(*a))
    pulled(xs[1])  # (traced into the compiled evaluation, once)
    evaluated.clear()
    for x in xs[1:]:  # the same types: one dispatch of the compiled program
        out, inters = stx.pull(f)(x)  # (a fresh pull of the same function too)
        assert_tree_allclose((out, inters), ref(x))
        # Program order (a compiled program's dicts come back in key order: l10 before l2),
        # and keys that know where their values were saved.
        assert list(inters) == list(ref(x)[1])
        assert origins(inters) == locations
    assert evaluated == []
    out, inters = pulled(jnp.ones((2, 3)))  # new types: traced once, inside the compiled one
    assert_tree_allclose((out, inters), ref(jnp.ones((2, 3))))
    assert evaluated == [1]


def test_eager_calls_that_cannot_run_compiled_evaluate():
    @jax.jit
    def f(x):
        stx.save_inter({"x": x, "tag": "a string"}, name="tagged")  # a non-array leaf
        return x + 1

    for _ in range(2):
        out, inters = stx.pull(f)(X)
        assert_tree_allclose(out, X + 1)
        assert inters["tagged_0"]["tag"] == "a string"
    g, ref = _jitted_layers(2)
    for x in (X, 1.5):  # a Python float is not an array: evaluated, weakly typed
        assert_tree_allclose(stx.pull(g)(x), ref(jnp.asarray(x)))


@pytest.mark.fast_paths
def test_a_pull_that_has_run_compiled_takes_any_call_as_its_function_would():
    # A pull that has run compiled sends each eager call straight to its compiled evaluation,
    # checking nothing `jax.jit` does not: what jit refuses, or the evaluation will not trace
    # (anything but arrays), takes the path of any other call; the function's own errors are
    # raised once, as they are.
    traces = []

    @functools.partial(jax.jit, static_argnames="mode")
    def f(x, mode="double"):
        traces.append(x.shape)
        if x.ndim > 1:
            raise ValueError("f takes vectors")
        y = stx.save_inter(2 * x if mode == "double" else x, name="y")
        return y + 1

    def by_hand(x, mode="double"):
        y = 2 * x if mode == "double" else x
        return y + 1, {"y_0": y}

    pulled = stx.pull(f)
    for _ in range(3):
        assert_tree_allclose(pulled(X), by_hand(X))
    assert "_compiled" in pulled.__dict__
    assert_tree_allclose(pulled(X, mode="same"), by_hand(X, "same"))  # a string: refused by jit
    for v in (1.5, 2, np.float32(0.5), np.arange(3.0)):  # numbers, and a NumPy array
        out, inters = pulled(v)
        assert_tree_allclose((out, inters), by_hand(jnp.asarray(v)))
        assert out.weak_type == jnp.asarray(v).weak_type
    traces.clear()
    with pytest.raises(ValueError, match="f takes vectors"):
        pulled(jnp.ones((2, 3)))
    assert traces == [(2, 3)]  # traced once: not again on another path
    assert_tree_allclose(pulled(X), by_hand(X))


def test_compiled_evaluation_does_not_keep_dead_functions_alive():
    f, _ = _jitted_layers(2)
    for _ in range(2):
        stx.pull(f)(X)
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def test_closure_over_an_outer_tracer_is_not_cached():
    def outer(w):
        return stx.pull(lambda x: stx.save_inter(w * x, name="wx"))(2.0)[1]["wx_0"]

    assert_tree_allclose(jax.grad(outer)(3.0), 2.0)
    assert_tree_allclose(jax.jit(outer)(4.0), 8.0)


def test_bound_method_of_plain_object():
    class Scaler:
        def __init__(self, s):
            self.s = s

        def __call__(self, x):
            return stx.save_inter(x * self.s, name="scaled")

    assert_tree_allclose(stx.pull(Scaler(3.0).__call__)(2.0)[1], {"scaled_0": 6.0})
    assert_tree_allclose(stx.pull(Scaler(4.0).__call__)(2.0)[1], {"scaled_0": 8.0})


def test_pull_of_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="needs a callable"):
        stx.pull(3)


# ---- the cache is keyed on JAX's configuration, as jax.jit's is ------------------------------


def test_cache_follows_enable_x64():
    def g(x):
        return jnp.arange(3) + stx.save_inter(x, name="x").astype(int)

    x = jnp.float32(1.0)
    assert stx.pull(g)(x)[0].dtype == jnp.int32
    with _x64():
        out, inters = stx.pull(g)(x)
        assert out.dtype == g(x).dtype == jax.jit(g)(x).dtype == jnp.int64
        assert inters["x_0"].dtype == jnp.float32
    assert stx.pull(g)(x)[0].dtype == jnp.int32  # and back


class _x64:
    def __enter__(self):
        jax.config.update("jax_enable_x64", True)

    def __exit__(self, *exc):
        jax.config.update("jax_enable_x64", False)


def _traced_under(context):
    """How often jitted `f` is traced when pulled once outside `context`, once inside, once
    after (what statax keeps of it is keyed as `jax.jit`'s own trace is)."""
    traces = []

    def f(x):
        traces.append(1)
        return stx.save_inter(x @ x, name="xx")

    x, g = jnp.ones((2, 2)), jax.jit(f)
    expected = stx.pull(g)(x)
    with context:
        assert_tree_allclose(stx.pull(g)(x), expected)
    assert_tree_allclose(stx.pull(g)(x), expected)
    return len(traces)


@pytest.mark.parametrize(
    "context",
    [
        lambda: jax.disable_jit(),
        lambda: jax.default_matmul_precision("highest"),
        lambda: jax.numpy_rank_promotion("warn"),
        lambda: jax.numpy_dtype_promotion("strict"),
    ],
    ids=["disable_jit", "matmul_precision", "rank_promotion", "dtype_promotion"],
)
def test_cache_is_keyed_on_flags_that_change_tracing(context):
    # Traced again under the flag, and the trace from outside is reused after it.
    assert _traced_under(context()) == 2


def test_cached_trace_from_permissive_promotion_is_not_reused_under_strict():
    def f(x, i):
        return stx.save_inter(x + i, name="s")

    x, i = jnp.ones(3), jnp.arange(3)
    with jax.numpy_dtype_promotion("standard"):
        assert stx.pull(f)(x, i)[0].dtype == jnp.float32
    with (
        jax.numpy_dtype_promotion("strict"),
        pytest.raises(ValueError, match="dtype_promotion=strict"),
    ):
        stx.pull(f)(x, i)
    m = jnp.ones((2, 3))
    with jax.numpy_rank_promotion("allow"):
        assert stx.pull(f)(x, m)[0].shape == (2, 3)
    with jax.numpy_rank_promotion("raise"), pytest.raises(ValueError, match="rank_promotion"):
        stx.pull(f)(x, m)


def test_pull_keeps_the_signature():
    def f(x, n=2, *, scale):
        return stx.save_inter(x * scale, name="y") ** n

    pulled = stx.pull(f)
    assert inspect.signature(pulled) == inspect.signature(f)
    jitted = jax.jit(pulled, static_argnames="n")  # reads the signature
    out, inters = jitted(jnp.float32(2.0), n=3, scale=jnp.float32(1.5))
    assert_tree_allclose((out, inters), (jnp.float32(27.0), {"y_0": jnp.float32(3.0)}))


def test_changing_a_handler_drops_every_cached_rewrite():
    from statax._core import exposers, marks, registry, rewrite
    from statax._drivers import cache

    def f(x):
        return lax.cond(x > 0, lambda: stx.save_inter(x, name="c"), lambda: x)

    g = jax.jit(f)
    stx.pull(g)(1.0)  # (a jitted function's trace is kept, while it lives)
    assert cache._CACHE and rewrite._PULLED and marks._SAVES
    registry.register_rules(lax.cond_p, registry.rules_of(lax.cond_p))  # (the same record again)
    caches = (marks._SAVES, rewrite._PULLED, rewrite._PULLED_OPEN)
    assert not cache._CACHE and not any(caches)
    assert not exposers._INERT and not marks._IMPLS


def branches_and_loop(x, p):
    y = lax.cond(
        p, lambda x: stx.save_inter(x * 2, name="a"), lambda x: stx.save_inter(x - 1, name="b"), x
    )
    body = lambda c: (c[0] + 1, stx.save_inter(c[1] + 1, name="w"))  # noqa: E731
    return lax.while_loop(lambda c: c[0] < 0, body, (x[0], y))[1]


def branches_and_loop_by_hand(x, p):
    """What ran, and the values (zeros where not): a = 2x if p, b = x - 1 if not; the loop
    runs -x[0] times (none for x[0] >= 0)."""
    a, b = (x * 2, jnp.zeros(3)) if p else (jnp.zeros(3), x - 1)
    y, w, n = (a if p else b), jnp.zeros(3), int(max(0, -x[0]))
    for _ in range(n):
        y = y + 1
        w = y
    return y, {"a_0": a, "a_0.ran": p, "b_0": b, "b_0.ran": not p, "w_0": w, "w_0.ran": n > 0}


@pytest.mark.parametrize("wrap", ["plain", "jit"])
def test_ran_masks_say_which_occurrences_did_not_run(wrap):
    pulled = stx.pull(branches_and_loop, ran=True)
    pulled = jax.jit(pulled) if wrap == "jit" else pulled
    for x, p in ((jnp.arange(3.0), True), (jnp.arange(3.0) - 2, False)):
        out, inters = pulled(x, p)
        want_out, want = branches_and_loop_by_hand(x, p)
        assert_tree_allclose((out, inters), (want_out, jax.tree.map(jnp.asarray, want)))
    xs, ps = jnp.stack([jnp.arange(3.0), jnp.arange(3.0) - 2]), jnp.array([True, False])
    _, batched = stx.pull(jax.vmap(branches_and_loop), ran=True)(xs, ps)
    per_example = [branches_and_loop_by_hand(x, bool(p))[1] for x, p in zip(xs, ps)]
    want = jax.tree.map(lambda *v: jnp.stack([jnp.asarray(u) for u in v]), *per_example)
    assert_tree_allclose(batched, want)
    text = str(stx.describe(batched))
    assert "a_0" in text and "(ran 1 of 2)" in text and "a_0.ran" not in text
    _, inters = stx.pull(branches_and_loop, ran=True)(jnp.arange(3.0), True)
    lines = {line.split()[0]: line for line in str(stx.describe(inters)).splitlines()}
    assert "(did not run)" in lines["b_0"] and "(did not run)" in lines["w_0"]
    assert "did not run" not in lines["a_0"]

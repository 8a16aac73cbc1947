import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import statax as stx
from statax._jax import jaxprs as _compat
from statax.testing import assert_tree_allclose


def test_save_inter_is_identity_on_any_pytree():
    tree = {"a": jnp.arange(3.0), "b": ("text", None, np.ones(2)), "c": jax.nn.relu}
    out = stx.save_inter(tree, name="t")
    assert out["b"][0] == "text" and out["b"][1] is None and out["c"] is jax.nn.relu
    assert_tree_allclose(out["a"], tree["a"])
    assert_tree_allclose(out["b"][2], tree["b"][2])


def test_default_name_is_state():
    def f(x):
        stx.save_inter(x)
        return x

    assert list(stx.pull(f)(jnp.ones(2))[1]) == ["state_0"]


@pytest.mark.parametrize("name", [3, None.__class__, ("a",), b"bytes"])
def test_non_string_name_is_a_type_error_at_call_time(name):
    with pytest.raises(TypeError, match=r"needs a string name.*test_primitive.py:\d+"):
        stx.save_inter(jnp.ones(2), name=name)


def test_jaxpr_records_name_and_location():
    def f(x):
        return stx.save_inter(x * 2, name="doubled")

    jaxpr = jax.make_jaxpr(f)(1.0)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is stx.extend.save_inter_p]
    meta = eqn.params["meta"]
    assert meta.name == "doubled"
    assert meta.location.endswith("test_primitive.py:" + str(f.__code__.co_firstlineno + 1))


def test_jvp_saves_the_primal_and_passes_tangents_through():
    def f(x):
        return stx.save_inter(jnp.sin(x), name="s") * 2

    primal, tangent = jax.jvp(f, (1.0,), (1.0,))
    assert_tree_allclose(primal, 2 * jnp.sin(1.0))
    assert_tree_allclose(tangent, 2 * jnp.cos(1.0))
    jaxpr = jax.make_jaxpr(lambda x, t: jax.jvp(f, (x,), (t,)))(1.0, 1.0)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is stx.extend.save_inter_p]
    assert eqn.invars[0].aval.shape == ()  # bound once, on the primal


def test_transpose_passes_cotangents_through():
    f = lambda x: stx.save_inter(3.0 * x, name="lin")  # noqa: E731
    (ct,) = jax.linear_transpose(f, 1.0)(2.0)
    assert_tree_allclose(ct, 6.0)


def test_batching_hands_values_on_with_their_batch_axes():
    def f(x):
        y = stx.save_inter(x, name="y")
        return y + 1

    xs = jnp.arange(6.0).reshape(2, 3)
    assert_tree_allclose(jax.vmap(f, in_axes=1, out_axes=1)(xs), xs + 1)
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=1))(xs)
    # The mark sees the batch axis at 0; the program downstream is unchanged.
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is stx.extend.save_inter_p]
    assert eqn.invars[0].aval.shape == (3, 2)


@pytest.mark.fast_paths
def test_impl_runs_eagerly():
    # An idle mark (as staged outside a pull) only reads; any other hands its operand on.
    x = jnp.arange(3)
    params = _params()
    assert params["status"] == "idle"
    assert stx.extend.save_inter_p.bind(x, **params) == []
    (y,) = stx.extend.save_inter_p.bind(x, **dict(params, status="inert"))
    assert y is x


def _params():
    jaxpr = jax.make_jaxpr(lambda x: stx.save_inter(x))(1.0)
    return jaxpr.eqns[0].params


@pytest.mark.fast_paths
def test_an_unpulled_mark_is_one_equation_that_only_reads():
    # Outside a pull a mark reads its value and defines nothing (no outputs): the program reads
    # on from the value itself, so the jaxpr is the hand-written one plus that equation.
    def f(x):
        y = jnp.sin(x)
        assert stx.save_inter(y, name="y") is y
        return jnp.cos(y)

    def by_hand(x):
        return jnp.cos(jnp.sin(x))

    jaxpr = jax.make_jaxpr(f)(1.0).jaxpr
    sin, mark, cos = jaxpr.eqns
    assert mark.primitive is stx.extend.save_inter_p and mark.params["status"] == "idle"
    assert mark.invars == sin.outvars == cos.invars
    assert mark.outvars == []
    unmarked = jaxpr.replace(eqns=[sin, cos])
    assert str(unmarked) == str(jax.make_jaxpr(by_hand)(1.0).jaxpr)


@jax.custom_jvp
def tangent_marked(x):
    return jnp.sin(x)


@tangent_marked.defjvp
def _tangent_marked_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # On a tangent: partially evaluated as an unknown.
    return jnp.sin(x), stx.save_inter(jnp.cos(x) * t, name="t")


@pytest.mark.fast_paths
def test_an_unpulled_mark_passes_jaxs_own_checks():
    # However it is staged (directly, on a value an equation made or on an input; or bound,
    # under a transformation), an unpulled mark has no outputs, and JAX's checks of the jaxprs
    # it is in (`jax_enable_checks`) pass, through differentiation and batching.
    def f(x):
        y = stx.save_inter(jnp.sin(x), name="y")
        stx.save_inter(x, name="x")  # a tracer made by no equation
        stx.save_inter({"pair": (x, y)}, name="tree")  # a pytree: one equation on its leaves
        return jnp.cos(y)

    g = tangent_marked
    with jax.enable_checks(True):
        closed = jax.make_jaxpr(f)(1.0)
        jax.make_jaxpr(jax.grad(f))(1.0)
        jax.make_jaxpr(jax.vmap(jax.grad(f)))(jnp.ones(3))
        assert_tree_allclose(jax.jit(jax.grad(f))(1.0), -jnp.sin(jnp.sin(1.0)) * jnp.cos(1.0))
        assert_tree_allclose(jax.jit(jax.grad(g))(0.5), jnp.cos(0.5))
        assert_tree_allclose(jax.linearize(g, 0.5)[1](2.0), 2.0 * jnp.cos(0.5))
    marks = [e for e in closed.eqns if e.primitive is stx.extend.save_inter_p]
    assert [len(e.invars) for e in marks] == [1, 1, 2]
    assert all(e.outvars == [] for e in marks)


def test_an_unpulled_mark_on_a_tangent_is_kept_by_linearize():
    # `linearize` traces its linear map into a frame that drops each equation no output reads,
    # binding the partially evaluated JVP rule there: the rule's unpulled mark on a tangent
    # stays, and a later pull of the linear map's jaxpr collects it.
    def by_hand(t):
        return jnp.cos(0.5) * t, {"t_0": jnp.cos(0.5) * t}

    _, linear = jax.linearize(tangent_marked, 0.5)
    rewritten = stx.extend.pull_jaxpr(jax.make_jaxpr(linear)(2.0))
    out, t = jaxpr_as_fun(rewritten.jaxpr)(2.0)
    assert [m.name for m in rewritten.outs] == ["t"]
    assert_tree_allclose((out, {"t_0": t}), by_hand(2.0))


def marked_in_scan(x):
    def body(c, _):
        c = stx.save_inter(c * 2.0, name="live")  # read on, as the carry
        stx.save_inter(jnp.sin(c), name="dead")  # read by nothing
        return c, None

    return jax.lax.scan(body, x, None, length=3)[0]


@pytest.mark.fast_paths
def test_unpulled_marks_on_live_values_survive_dead_code_elimination_and_partial_evaluation():
    # A jaxpr traced without a pull keeps its marks on the values the program reads however JAX
    # transforms it: `grad` of a scan evaluates its body partially (hoisting loop-invariant
    # work) and eliminates dead code. Pulled later, the jaxpr returns them. A mark on a value
    # nothing else reads keeps nothing alive: dead-code elimination drops it with the value,
    # as it would drop the value unmarked (libraries look at what it keeps: Flax's `nn.scan`
    # refuses a broadcast variable that depends on the carry).
    closed = jax.make_jaxpr(jax.grad(marked_in_scan))(0.5)
    rewritten = stx.extend.pull_jaxpr(closed)
    assert [m.name for m in rewritten.outs] == ["live"]
    out, live = jaxpr_as_fun(rewritten.jaxpr)(0.5)
    assert_tree_allclose(out, 8.0)
    assert_tree_allclose(live, 0.5 * 2.0 ** jnp.arange(1, 4))

    def f(x):
        stx.save_inter(jnp.sin(x), name="dead")
        y = jnp.cos(x)
        stx.save_inter(y, name="live")
        return y * 2

    kept, used = _compat.dce(jax.make_jaxpr(f)(0.5).jaxpr, [True])
    assert [e.primitive.name for e in kept.eqns] == ["cos", "save_inter", "mul"] and used == [True]
    assert kept.eqns[1].params["meta"].name == "live"


@pytest.mark.fast_paths
def test_an_unpulled_mark_under_checkpoint_is_not_replayed():
    def h(x):
        return jnp.cos(stx.save_inter(jnp.sin(x), name="s"))

    closed = jax.make_jaxpr(jax.grad(jax.checkpoint(h)))(0.5)
    assert str(closed).count("save_inter[") == 1  # in the forward pass only
    rewritten = stx.extend.pull_jaxpr(closed)
    grad, s = jaxpr_as_fun(rewritten.jaxpr)(0.5)
    assert_tree_allclose((grad, s), (-jnp.sin(jnp.sin(0.5)) * jnp.cos(0.5), jnp.sin(0.5)))


def marked_throughout(x):
    def body(c, a):
        return stx.save_inter(jnp.sin(c) + a, name="carry"), None

    c, _ = jax.lax.scan(body, x, jnp.arange(3.0))
    y = jax.jit(lambda v: stx.save_inter(v * 2.0, name="in_jit"))(c)
    return jnp.sum(stx.save_inter(jnp.cos(y), name="out"))


def marked_throughout_by_hand(x):
    def body(c, a):
        c = jnp.sin(c) + a
        return c, c

    c, carries = jax.lax.scan(body, x, jnp.arange(3.0))
    return {"carry_0": carries, "in_jit_0": c * 2.0, "out_0": jnp.cos(c * 2.0)}


@pytest.mark.parametrize(
    "transform",
    [lambda f: f, jax.jit, jax.grad, jax.jacfwd, lambda f: jax.grad(jax.checkpoint(f))],
    ids=["plain", "jit", "grad", "jacfwd", "grad_checkpoint"],
)
def test_a_jaxpr_traced_without_pull_gives_its_marks_to_a_later_pull(transform):
    x = jnp.float32(0.3)
    rewritten = stx.extend.pull_jaxpr(jax.make_jaxpr(transform(marked_throughout))(x))
    flat = jaxpr_as_fun(rewritten.jaxpr)(x)
    assert [m.name for m in rewritten.outs] == ["carry", "in_jit", "out"]
    inters = {f"{m.name}_0": v for m, v in zip(rewritten.outs, flat[1:], strict=True)}
    assert_tree_allclose(flat[0], transform(marked_throughout)(x))
    assert_tree_allclose(inters, marked_throughout_by_hand(x))


def marks_at_one_site(x, reduce=None):
    for i in range(2):
        x = stx.save_inter(jnp.sin(x), name=f"l{i}", reduce=reduce)  # one call site
    return x


def test_a_call_site_seen_before_names_its_marks_as_the_first_time():
    # An unpulled mark at a call site statax has seen looks up what it made there, keyed by
    # everything that shapes it: the name, the mode and the enclosing scope.
    line = marks_at_one_site.__code__.co_firstlineno + 2
    where = f"test_primitive.py:{line}"

    def metas(fn):
        eqns = jax.make_jaxpr(fn)(0.5).eqns
        return [(e.params["meta"].name, e.params["meta"].reduce, e.params["meta"].location)
                for e in eqns if e.primitive is stx.extend.save_inter_p]  # fmt: skip

    def scoped(scope, reduce=None):
        def fn(x):
            with stx.scope(scope):
                return marks_at_one_site(x, reduce)

        return fn

    for _ in range(2):
        assert [(n, r, loc.rsplit("/", 1)[-1]) for n, r, loc in metas(marks_at_one_site)] == [
            ("l0", None, where),
            ("l1", None, where),
        ]
        assert [n for n, _, _ in metas(scoped("a"))] == ["a/l0", "a/l1"]
        assert [(n, r) for n, r, _ in metas(scoped("b", "stack"))] == [
            ("b/l0", "stack"),
            ("b/l1", "stack"),
        ]


def test_bad_input_at_a_call_site_seen_before_is_still_an_error():
    def f(x, name, reduce=None):
        return stx.save_inter(x, name=name, reduce=reduce)

    jax.make_jaxpr(lambda x: f(x, "ok"))(1.0)
    with pytest.raises(TypeError, match=r"needs a string name.*test_primitive.py:\d+"):
        jax.make_jaxpr(lambda x: f(x, ["unhashable"]))(1.0)
    with pytest.raises(ValueError, match="reduce must be one of"):
        jax.make_jaxpr(lambda x: f(x, "ok", "median"))(1.0)


def test_a_mark_on_a_value_nobody_keeps_leaves_a_well_formed_jaxpr():
    # An unpulled mark on a value made by an equation holds only its variable, not the tracer:
    # the tracer may die at once, and the jaxpr still defines what the mark reads.
    import gc

    def f(x):
        stx.save_inter(jnp.sin(x), name="dropped")  # the tracer of sin(x) dies here
        gc.collect()
        stx.save_inter(x, name="input")  # a tracer made by no equation
        return jnp.cos(x)

    def by_hand(x):
        return jnp.cos(x), {"dropped_0": jnp.sin(x), "input_0": x}

    closed = jax.make_jaxpr(f)(0.5)
    assert [e.primitive.name for e in closed.eqns] == ["sin", "save_inter", "save_inter", "cos"]
    rewritten = stx.extend.pull_jaxpr(closed)
    out, *inters = jaxpr_as_fun(rewritten.jaxpr)(0.5)
    names = {f"{m.name}_0": v for m, v in zip(rewritten.outs, inters, strict=True)}
    assert_tree_allclose((out, names), by_hand(0.5))
    assert_tree_allclose(stx.pull(f)(0.5), by_hand(0.5))


def test_a_pull_at_a_call_site_seen_before_still_selects_and_plants():
    # The marks a pull takes as they are made look up what their call site made before too;
    # a selection (`only=`) or a planting in force takes the full path.
    def by_hand(x, l1=None):
        l0 = jnp.sin(x)
        l1 = jnp.sin(l0) if l1 is None else l1
        return l1, {"l0_0": l0, "l1_0": l1}

    x, v = jnp.float32(0.5), jnp.float32(2.0)
    for _ in range(2):
        assert_tree_allclose(stx.pull(marks_at_one_site)(x), by_hand(x))
        out, inters = stx.pull(marks_at_one_site, only="l1")(x)
        assert_tree_allclose((out, inters), (by_hand(x)[0], {"l1_0": by_hand(x)[1]["l1_0"]}))
        assert_tree_allclose(stx.plant(marks_at_one_site)({"l1_0": v}, x), by_hand(x, v)[0])
        planted = stx.pull(lambda x: stx.plant(marks_at_one_site)({"l0_0": v}, x))(x)
        assert_tree_allclose(planted, (jnp.sin(v), {"l0_0": v, "l1_0": jnp.sin(v)}))

"""`stateful`, `get_state`, `set_state`: every program against the same program with its state
threaded by hand, under `jit`, `vmap` and `grad` in both orders."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statax as stx
from statax.testing import assert_tree_allclose


def f(x):
    y = stx.get_state(name="y", init=lambda: 4 * jnp.ones(()))
    z = x * y
    return stx.set_state(z, name="z")


def g(x):
    y = stx.get_state(name="y", init=lambda: (4 * jnp.ones(()), {"g": 1.0}))
    z = x * y[0]
    stx.set_state((z, y), "zy")
    return z


# ---- the original project's documented values ------------------------------------------------


def test_outside_stateful_get_uses_init_and_warns_and_set_does_nothing():
    with pytest.warns(stx.StatefulWarning, match="outside stx.stateful"):
        assert f(2.0) == 8.0
    assert stx.set_state(3.0, "z") == 3.0


@pytest.mark.parametrize(
    "run, expected",
    [
        (lambda: stx.stateful(f)(1.0), (4.0, {"z": 4.0})),
        (lambda: stx.stateful(f, output_unchanged=True)(2.0), (8.0, {"z": 8.0, "y": 4.0})),
        (
            lambda: stx.stateful(f, output_unchanged=True)(2.0, state={"y": 3.0}),
            (6.0, {"z": 6.0, "y": 3.0}),
        ),
        (lambda: jax.jit(stx.stateful(f))(1.0, state={"y": 3.0}), (3.0, {"z": 3.0})),
        (lambda: stx.stateful(jax.jit(f))(1.0, state={"y": 3.0}), (3.0, {"z": 3.0})),
        (lambda: stx.stateful(jax.grad(f))(1.0, state={"y": 3.0}), (3.0, {"z": 3.0})),
        (
            lambda: jax.grad(stx.stateful(f), has_aux=True)(1.0, state={"y": 3.0}),
            (3.0, {"z": 3.0}),
        ),
        (
            lambda: stx.stateful(jax.vmap(f))(jnp.ones(10), state={"y": 3.0}),
            (np.full(10, 3.0), {"z": np.full(10, 3.0)}),
        ),
        (
            lambda: jax.vmap(stx.stateful(f))(jnp.ones(10), state={"y": jnp.zeros(10) + 3}),
            (np.full(10, 3.0), {"z": np.full(10, 3.0)}),
        ),
    ],
)
def test_documented_values(run, expected):
    out, state = run()
    assert list(state) == list(expected[1])
    assert_tree_allclose((out, state), expected)


def test_non_array_leaves_pass_through():
    out, state = stx.stateful(g)(1.0)
    assert out == 4.0 and state["zy"][1][1] == {"g": 1.0}
    assert_tree_allclose(state["zy"][:2], (4.0, (4.0, {"g": 1.0}))[:2])
    out, state = stx.stateful(g)(1.0, state={"y": (2.0, {"g": 0.0})})
    assert out == 2.0
    assert state["zy"][1] == (2.0, {"g": 0.0})  # the Python numbers passed in, as they were
    np.testing.assert_allclose(state["zy"][0], 2.0)


def test_gradients_flow_from_state_inputs():
    def h(a, b):
        c = stx.get_state("c", init=lambda: jnp.ones(()))
        return a * c**2 + b

    grad = jax.grad(lambda c: stx.stateful(h)(2.0, 1.0, state={"c": c})[0])(3.0)
    np.testing.assert_allclose(grad, 2.0 * 2 * 3.0)


# ---- errors -------------------------------------------------------------------------------


def test_a_name_passed_in_and_never_used_is_an_error_naming_it():
    with pytest.raises(stx.StateError, match=r"never reads or sets: \['w'\].*\['y', 'z'\]"):
        stx.stateful(f)(1.0, state={"w": 1.0})


@pytest.mark.parametrize(
    "bad, says",
    [
        (jnp.ones(3, jnp.int32), r"'y' passed in is int32\[3\].*expects float32\[\]"),
        (jnp.int32(3), r"'y' passed in is int32\[\].*expects float32\[\]"),
        # Per example (as from under a vmap): readable under a vmap only.
        (jnp.ones(3), r"'y' holds float32\[3\] .* as float32\[\].*passed in from one\) is per"),
    ],
)
def test_a_state_of_the_wrong_kind_names_the_state_and_both_types(bad, says):
    with pytest.raises(stx.StateError, match=says) as info:
        stx.stateful(f)(1.0, state={"y": bad})
    assert "test_stateful.py" in str(info.value)  # where the get_state is


def test_a_state_that_changes_kind_is_an_error():
    def h(x):
        stx.set_state(jnp.ones(3), "a")
        return stx.get_state("a", init=lambda: jnp.zeros(()))

    with pytest.raises(stx.StateError, match=r"'a' holds float32\[3\].*as float32\[\]"):
        stx.stateful(h)(1.0)


def test_set_in_one_branch_with_no_value_before_is_an_error():
    def h(p, x):
        return lax.cond(p, lambda x: stx.set_state(x, "a"), lambda x: x, x)

    with pytest.raises(stx.StateError, match="'a' is set in some branches"):
        stx.stateful(h)(jnp.bool_(True), 1.0)


def test_set_in_a_while_loop_with_no_value_before_is_an_error():
    def h(n):
        return lax.while_loop(lambda i: i < n, lambda i: stx.set_state(i + 1, "last"), 0)

    with pytest.raises(stx.StateError, match="'last' is set inside a while_loop"):
        stx.stateful(h)(jnp.int32(3))


# ---- programs, each with its state threaded by hand ----------------------------------------
# A case: (program, reference, args, state). `reference(*args, state) -> (out, new_state)`.


def ordered(x):
    stx.set_state(x * 2, "a")
    a = stx.get_state("a", init=lambda: jnp.zeros(()))  # sees the set, not init
    stx.set_state(a + 1, "a")
    return a * x


def ordered_ref(x, state):
    a = x * 2
    return a * x, {"a": a + 1}


def scan_counter(xs):
    def body(c, x):
        n = stx.get_state("n", init=lambda: jnp.ones(()))
        stx.set_state(n * x + 1, "n")
        return c + n, n

    return lax.scan(body, 0.0, xs)


def scan_counter_ref(xs, state):
    n = state.get("n", jnp.ones(()))
    c, ys = 0.0, []
    for x in xs:
        c, ys, n = c + n, [*ys, n], n * x + 1
    return (c, jnp.stack(ys)), {"n": n}


def reverse_scan(xs):
    def body(c, x):
        n = stx.get_state("n", init=lambda: jnp.zeros(()))
        stx.set_state(n * 0.5 + x, "n")
        return c, n

    return lax.scan(body, 0.0, xs, reverse=True)[1]


def reverse_scan_ref(xs, state):
    n, ys = state.get("n", jnp.zeros(())), [None] * len(xs)
    for i in reversed(range(len(xs))):
        ys[i], n = n, n * 0.5 + xs[i]
    return jnp.stack(ys), {"n": n}


def while_counter(x):
    def body(carry):
        i, acc = carry
        k = stx.get_state("k", init=lambda: jnp.ones(()))
        stx.set_state(k * x, "k")
        return i + 1, acc + k

    return lax.while_loop(lambda c: c[0] < 3, body, (0, 0.0))[1]


def while_counter_ref(x, state):
    k, acc = state.get("k", jnp.ones(())), 0.0
    for _ in range(3):
        acc, k = acc + k, k * x
    return acc, {"k": k}


def fori(x):
    def body(i, c):
        k = stx.get_state("k", init=lambda: jnp.ones(()))
        stx.set_state(k + x, "k")
        return c * k

    return lax.fori_loop(0, 4, body, 1.0)


def fori_ref(x, state):
    k, c = state.get("k", jnp.ones(())), 1.0
    for _ in range(4):
        c, k = c * k, k + x
    return c, {"k": k}


def branches(x):
    stx.set_state(x, "v")

    def big(x):
        stx.set_state(stx.get_state("v") * 10, "v")
        return x + 1

    def small(x):
        stx.set_state(stx.get_state("v") - 1, "w")
        return x - 1

    return lax.switch(jnp.int32(x > 0) + jnp.int32(x > 1), [small, small, big], x)


def branches_ref(x, state):
    w = state.get("w", jnp.zeros(()))
    if x > 1:
        return x + 1, {"v": x * 10, "w": w}
    return x - 1, {"v": x, "w": x - 1}


def checkpointed(x):
    @jax.checkpoint
    def inner(x):
        n = stx.get_state("n", init=lambda: jnp.zeros(()))
        stx.set_state(n + 1, "n")
        return jnp.sin(x) * (n + 1)

    return inner(inner(x))


def checkpointed_ref(x, state):
    n = state.get("n", jnp.zeros(()))
    x = jnp.sin(x) * (n + 1)
    x = jnp.sin(x) * (n + 2)
    return x, {"n": n + 2}  # set once per call, however often recomputed


@jax.custom_jvp
def custom(x):
    n = stx.get_state("n", init=lambda: jnp.zeros(()))
    stx.set_state(n + x, "n")
    return jnp.sin(x)


custom.defjvp(lambda p, t: (custom(p[0]), jnp.cos(p[0]) * t[0]))


def custom_call(x):
    return custom(x) + custom(2 * x)


def custom_call_ref(x, state):
    n = state.get("n", jnp.zeros(()))
    return jnp.sin(x) + jnp.sin(2 * x), {"n": n + 3 * x}


def jitted(x):
    step = jax.jit(ordered)
    return step(x) + step(x + 1)


def jitted_ref(x, state):
    a, s = ordered_ref(x, state)
    b, s = ordered_ref(x + 1, s)
    return a + b, s


def inner_vmap(xs):
    def step(x):
        n = stx.get_state("n", init=lambda: jnp.zeros(()))
        stx.set_state(n + x, "n")
        return x * n

    return jax.vmap(step)(xs) + jax.vmap(step)(xs)  # the second reads each example's own n


def inner_vmap_ref(xs, state):
    n = jnp.broadcast_to(state.get("n", jnp.zeros(())), xs.shape)
    first, n = xs * n, n + xs
    second, n = xs * n, n + xs
    return first + second, {"n": n}


def setter(x):
    stx.set_state(x * 3, "b")
    return x**2


def equinox_transforms(x):
    y = eqx.filter_jit(ordered)(x)
    grads = eqx.filter_grad(lambda v: eqx.filter_vmap(setter)(v).sum())(jnp.stack([x, 2 * x]))
    return y + grads.sum()


def equinox_transforms_ref(x, state):
    y, state = ordered_ref(x, state)
    # The vmapped setter sets one value per example.
    return y + 2 * (x + 2 * x), {**state, "b": 3 * jnp.stack([x, 2 * x])}


CASES = {
    "ordered": (ordered, ordered_ref, (1.5,), {}),
    "scan": (scan_counter, scan_counter_ref, (jnp.arange(1.0, 5.0) / 4,), {}),
    "scan_given": (scan_counter, scan_counter_ref, (jnp.arange(4.0),), {"n": 2.0}),
    "reverse_scan": (reverse_scan, reverse_scan_ref, (jnp.arange(4.0),), {}),
    "while": (while_counter, while_counter_ref, (1.5,), {}),
    "while_given": (while_counter, while_counter_ref, (0.5,), {"k": 3.0}),
    "fori": (fori, fori_ref, (0.5,), {"k": 2.0}),
    "switch_big": (branches, branches_ref, (2.0,), {"w": 5.0}),
    "switch_small": (branches, branches_ref, (0.5,), {"w": 5.0}),
    "checkpoint": (checkpointed, checkpointed_ref, (0.7,), {}),
    "custom_jvp": (custom_call, custom_call_ref, (0.3,), {"n": 1.0}),
    "jit": (jitted, jitted_ref, (1.5,), {}),
    "inner_vmap": (inner_vmap, inner_vmap_ref, (jnp.arange(3.0),), {"n": 1.0}),
    "equinox": (equinox_transforms, equinox_transforms_ref, (1.5,), {}),
}


def _state(state):
    return {k: jnp.asarray(v, jnp.float32) for k, v in state.items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["plain", "jit_outside", "jit_inside"])
def test_state_is_threaded_as_by_hand(case, order):
    fn, ref, args, state = CASES[case]
    state = _state(state)
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)
    run = {
        "plain": stx.stateful(fn),
        "jit_outside": jax.jit(stx.stateful(fn)),
        "jit_inside": stx.stateful(jax.jit(fn)),
    }[order]
    out, new = run(*args, state=state)
    expected = ref(*args, state)
    assert sorted(new) == sorted(expected[1])
    assert_tree_allclose((out, new), expected, rtol=1e-5)


@pytest.mark.parametrize("case", ["ordered", "scan", "while", "fori", "switch_big", "checkpoint"])
def test_vmap_outside_is_per_example_state(case):
    fn, ref, args, state = CASES[case]
    state = _state(state)
    batch = tuple(jnp.stack([jnp.asarray(a, jnp.float32) * s for s in (1.0, 0.5)]) for a in args)
    bstate = {k: jnp.stack([v, v + 1]) for k, v in state.items()}
    out, new = jax.vmap(stx.stateful(fn))(*batch, state=bstate)
    for i in range(2):
        expected = ref(*(b[i] for b in batch), {k: v[i] for k, v in bstate.items()})
        assert_tree_allclose(jax.tree.map(lambda v, i=i: v[i], (out, new)), expected, rtol=1e-5)


@pytest.mark.parametrize("case", ["ordered", "scan_given", "fori", "checkpoint", "jit"])
def test_grad_outside_through_args_and_state(case):
    fn, ref, args, state = CASES[case]
    state = _state(state)
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)

    def loss(run):
        def of(args, state):
            out, new = run(*args, state=state)
            leaves = jax.tree.leaves((out, new))
            return sum(jnp.sum(jnp.sin(x)) for x in leaves)

        return of

    got = jax.grad(loss(stx.stateful(fn)), argnums=(0, 1))(args, state)
    want = jax.grad(loss(lambda *a, state: ref(*a, state)), argnums=(0, 1))(args, state)
    assert_tree_allclose(got, want, rtol=1e-4)


def test_inside_a_grad_within_stateful_a_read_state_is_a_constant():
    # `ordered` reads back what it set; differentiated inside `stateful`, that read is a
    # constant (as documented): d(a * x)/dx = a, not the 4x of the function written out.
    out, new = stx.stateful(jax.grad(ordered))(jnp.float32(1.5))
    assert_tree_allclose((out, new), (3.0, {"a": 4.0}))
    out, new = jax.grad(stx.stateful(ordered), has_aux=True)(jnp.float32(1.5))
    assert_tree_allclose((out, new), (6.0, {"a": 4.0}))  # outside: the function as written


def test_checkpoint_under_grad_sets_once():
    # The recomputation in the backward pass sets nothing: `n` counts calls, not passes.
    fn, ref, _, _ = CASES["checkpoint"]
    for run in (stx.stateful(jax.grad(fn)), jax.jit(stx.stateful(jax.grad(fn)))):
        _, new = run(jnp.float32(0.7))
        np.testing.assert_allclose(new["n"], 2.0)


def test_shard_map_state_is_per_shard():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Explicit,))

    def body(x):
        n = stx.get_state("n", init=lambda: jnp.zeros(()))
        stx.set_state(n + x.sum(), "n")
        return x * 2

    smap = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))

    def h(x):
        return smap(smap(x))

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    blocks = np.arange(8.0).reshape(4, 2).sum(1)
    for run in (stx.stateful(h), jax.jit(stx.stateful(h))):
        out, new = run(x)
        assert_tree_allclose((out, new), (4 * np.arange(8.0), {"n": 3 * blocks}))


def test_a_jitted_function_is_not_traced_again_for_the_same_shapes():
    traces = []

    def h(x):
        traces.append(1)
        return scan_counter(x)

    run = stx.stateful(jax.jit(h))
    for k in range(3):
        run(jnp.arange(3.0) + k, state={"n": jnp.float32(k)})
    assert len(traces) == 1
    run(jnp.arange(4.0), state={"n": jnp.float32(0)})
    assert len(traces) == 2


# ---- composition with pull and plant -------------------------------------------------------


def marked(x):
    y = stx.get_state("y", init=lambda: jnp.ones(()))
    h = stx.save_inter(x * y, name="h")
    stx.set_state(y + h, "y")
    return h * 2


@pytest.mark.parametrize(
    "run",
    [
        lambda x, s: (lambda r: ((r[0][0], r[1]), r[0][1]))(
            stx.pull(stx.stateful(marked))(x, state=s)
        ),
        lambda x, s: (lambda r: ((r[0][0], r[0][1]), r[1]))(
            stx.stateful(stx.pull(marked))(x, state=s)
        ),
    ],
    ids=["pull_outside", "pull_inside"],
)
def test_composes_with_pull(run):
    (out, inters), state = run(jnp.float32(2.0), {"y": jnp.float32(3.0)})
    assert_tree_allclose((out, inters, state), (12.0, {"h_0": 6.0}, {"y": 9.0}))


def test_composes_with_plant_in_both_orders():
    values = {"h_0": jnp.float32(100.0)}
    s = {"y": jnp.float32(3.0)}
    expected = (200.0, {"y": 103.0})  # the planted value flows on, into the state too
    assert_tree_allclose(
        stx.plant(stx.stateful(marked))(values, jnp.float32(2.0), state=s), expected
    )
    assert_tree_allclose(
        stx.stateful(stx.plant(marked))(values, jnp.float32(2.0), state=s), expected
    )


def test_no_state_eqn_is_left_in_the_program():
    jaxpr = jax.make_jaxpr(lambda x: stx.stateful(scan_counter)(x))(jnp.arange(3.0))
    text = str(jaxpr)
    assert "get_state" not in text and "set_state" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(stx.stateful(scan_counter)).lower(jnp.arange(3.0)).compile()


def test_a_batched_predicate_inside_stateful_is_an_error_not_a_wrong_state():
    def h(x):
        stx.set_state(jnp.zeros(()), "v")
        return lax.cond(x > 0, lambda x: stx.set_state(x, "v"), lambda x: stx.set_state(-x, "v"), x)

    xs = jnp.array([1.0, -2.0])
    with pytest.raises(stx.StateError, match="predicate differs per example"):
        stx.stateful(jax.vmap(h))(xs)
    _, new = jax.vmap(stx.stateful(h))(xs)  # the vmap outside: per-example state
    assert_tree_allclose(new, {"v": np.array([1.0, 2.0])})

    def loop(x):
        return lax.while_loop(lambda c: c < x, lambda c: stx.set_state(c + 1, "n"), 0.0)

    with pytest.raises(stx.StateError, match="predicate differs per example"):
        stx.stateful(jax.vmap(loop))(xs, state={"n": jnp.float32(0)})


def test_the_batching_guard_is_part_of_the_cond_record():
    # What statax knows of `cond` is one record: removing it removes the guard (and gives JAX
    # its batching rule back); registering it again with its guard brings the guard back.
    from statax._jax import tracing
    from statax.handlers import cond

    def h(x):
        stx.set_state(jnp.zeros(()), "v")
        return lax.cond(x > 0, lambda x: stx.set_state(x, "v"), lambda x: -x, x)

    ours = tracing.batching_rule(lax.cond_p)
    stx.extend.unregister_handler(lax.cond_p)
    try:
        assert tracing.batching_rule(lax.cond_p) is not ours  # JAX's own again
        assert stx.extend.equations  # (the rest of statax still imports)
    finally:
        stx.extend.register_exposer(
            lax.cond_p,
            cond._cond_exposer,
            thread_state=cond._cond_state,
            batching_guard=cond.BATCHING_GUARD,
            selectable=True,
            runs_python=False,
        )
    with pytest.raises(stx.StateError, match="predicate differs per example"):
        stx.stateful(jax.vmap(h))(jnp.array([1.0, -2.0]))


def test_while_under_an_inner_vmap_with_a_shared_predicate_is_per_example():
    def h(x):
        def body(c):
            i, a = c
            n = stx.get_state("n", init=lambda: jnp.zeros(()))
            stx.set_state(n + a, "n")
            return i + 1, a * 2

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    out, new = stx.stateful(jax.vmap(h))(jnp.array([1.0, -2.0]))
    assert_tree_allclose((out, new), (np.array([8.0, -16.0]), {"n": np.array([7.0, -14.0])}))


@jax.custom_vjp
def custom_v(x):
    stx.set_state(x * 2, "cv")
    return jnp.sin(x)


custom_v.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))


def test_custom_vjp_sets_state_and_keeps_its_derivative_outside():
    out, new = stx.stateful(custom_v)(jnp.float32(0.5))
    assert_tree_allclose((out, new), (np.sin(0.5), {"cv": 1.0}))
    grad, new = jax.grad(stx.stateful(custom_v), has_aux=True)(jnp.float32(0.5))
    assert_tree_allclose((grad, new), (np.cos(0.5), {"cv": 1.0}))


# ---- state passed back in ------------------------------------------------------------------


def running_sum(xs):
    def per_example(x):
        total = stx.get_state("total", init=lambda: jnp.zeros(()))
        stx.set_state(total + x, "total")
        return x * 2

    return jax.vmap(per_example)(xs)


def test_per_example_state_from_an_inner_vmap_is_passed_back_in():
    # Running statistics across calls: what one call returns, per example, the next takes in.
    run = jax.jit(stx.stateful(running_sum))
    state = None
    for step in range(3):
        xs = jnp.arange(3.0) + step
        _, state = run(xs, state=state) if state is not None else run(xs)
    assert_tree_allclose(state, {"total": jnp.arange(3.0) * 3 + 3.0})  # by hand: 0+1+2 more
    with pytest.raises(stx.StateError, match=r"holds float32\[3\].*per example: read it inside"):
        stx.stateful(lambda x: stx.get_state("total", init=lambda: jnp.zeros(())))(1.0, state=state)


def set_in_a_branch(x, p):
    lax.cond(p, lambda: stx.set_state(x * 2.0, "s"), lambda: x)
    return x


def get_then_set_under_checkpoint(x):
    def inner(x):
        stx.set_state(stx.get_state("s") * x, "s")
        return x

    return jax.checkpoint(inner)(x)


def test_a_python_number_in_state_is_taken_as_jit_takes_one():
    x = jnp.float32(3.0)
    for p, expected in ((True, 6.0), (False, 1.0)):  # by hand: the branch that ran sets it
        out, state = stx.stateful(set_in_a_branch)(x, p, state={"s": 1.0})
        assert_tree_allclose((out, state), (x, {"s": jnp.asarray(expected, jnp.float32)}))
    out, state = stx.stateful(get_then_set_under_checkpoint)(x, state={"s": 2.0})
    assert_tree_allclose((out, state), (x, {"s": jnp.float32(6.0)}))
    grad = jax.grad(
        lambda x: stx.stateful(get_then_set_under_checkpoint)(x, state={"s": 2.0})[1]["s"]
    )(x)
    assert_tree_allclose(grad, jnp.float32(2.0))  # d(2 x)/dx


# ---- state in Python functions that a library's primitive runs -------------------------------

A = jnp.array([[4.0, 1, 0], [1, 3, 0.5], [0, 0.5, 2]])
B = jnp.array([1.0, 2, 3])


def counted_solve(b, solver):
    """`A x = b` by lineax, through a `FunctionLinearOperator` whose matvec counts its calls
    and keeps its last argument in state."""
    import lineax as lx

    def matvec(x):
        stx.set_state(stx.get_state("calls", init=lambda: jnp.zeros((), jnp.int32)) + 1, "calls")
        stx.set_state(x, "last_x")
        return A @ x

    struct = jax.ShapeDtypeStruct((3,), jnp.float32)
    op = lx.FunctionLinearOperator(matvec, struct, tags=lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, solver=solver).value


def test_state_in_a_lineax_matvec_is_threaded():
    import lineax as lx

    cg = lx.CG(rtol=1e-6, atol=1e-6)
    # By hand: CG's own count of matvecs is its number of steps, plus one for the residual.
    steps = lx.linear_solve(
        lx.MatrixLinearOperator(A, lx.positive_semidefinite_tag), B, solver=cg
    ).stats["num_steps"]
    threaded = stx.stateful(counted_solve)
    for run in (threaded, jax.jit(threaded, static_argnums=1)):
        x, state = run(B, cg)
        assert_tree_allclose(x, jnp.linalg.solve(A, B), rtol=1e-5)
        assert set(state) == {"calls", "last_x"}
        assert int(state["calls"]) == int(steps) + 1
    # The solve runs as written under differentiation (LU: differentiable as written).
    lu = lx.LU()
    tangent = jax.jvp(lambda b: stx.stateful(counted_solve)(b, lu)[0], (B,), (jnp.ones(3),))[1]
    assert_tree_allclose(tangent, jnp.linalg.solve(A, jnp.ones(3)), rtol=1e-5)
    if tuple(map(int, lx.__version__.split(".")[:3])) < (0, 1, 1):
        return  # lineax 0.1.0 (the newest for JAX 0.8) transposes the operator it was given
    grad = jax.grad(lambda b: stx.stateful(counted_solve)(b, lu)[0].sum())(B)
    assert_tree_allclose(grad, jnp.linalg.solve(A.T, jnp.ones(3)), rtol=1e-5)


def test_state_in_an_equinox_noinline_function_is_threaded():
    @eqx.internal.noinline
    def noinline(x):
        stx.set_state(x * 2, "n")
        return x + 1

    out, state = stx.stateful(lambda x: noinline(x) * 3)(jnp.float32(1.0))
    assert_tree_allclose((out, state), (jnp.float32(6.0), {"n": jnp.float32(2.0)}))

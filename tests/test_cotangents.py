"""The backward pass at a mark (`pull(fn, cotangents=True)`, `plant` of `"h_0.grad"`,
`first_nonfinite`), checked against references written by hand: the cotangent at a place is the
gradient with respect to a perturbation added there (zero), and an edited cotangent is what a
`custom_vjp` identity that edits it gives."""

import functools

import diffrax
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statax as stx
from statax._core import fastpaths as _fastpaths
from statax.testing import assert_tree_allclose, hlo_ops

WS = jnp.stack([jnp.eye(3) * s + 0.1 for s in (0.5, -1.0, 2.0)])
X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


def stacked(ws, x, eps=None, checkpointed=False):
    """Layers under `lax.scan`, `z` marked in each; with `eps`, `z + eps[i]` instead (the
    reference: the gradient with respect to `eps` at zero is the cotangent at `z`)."""

    def layer(h, w_e):
        w, e = w_e
        z = h @ w
        z = stx.save_inter(z, name="z") if e is None else z + e
        return jnp.tanh(z), None

    if checkpointed:
        layer = jax.checkpoint(layer)
    return jax.lax.scan(layer, x, (ws, eps))[0]


def loss(ws, x, eps=None, checkpointed=False):
    return jnp.sum(stacked(ws, x, eps, checkpointed) ** 2)


def zeros_at_z(x):
    return jnp.zeros((len(WS), *x.shape))


def reference(x, checkpointed=False):
    """`(value, cotangent)` at `z`, by hand."""
    _, acts = stx.pull(stacked)(WS, x)
    ct = jax.grad(loss, argnums=2)(WS, x, zeros_at_z(x), checkpointed)
    return acts["z_0"], ct


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("order", ["plain", "jit_in", "jit_out"])
def test_scan_stacks_each_iterations_cotangent(order, checkpointed):
    def step(ws, x):
        return jax.value_and_grad(loss)(ws, x, None, checkpointed)

    if order == "jit_in":
        pulled = stx.pull(jax.jit(step), cotangents=True)
    else:
        pulled = stx.pull(step, cotangents=True)
    if order == "jit_out":
        pulled = jax.jit(pulled)
    (value, grads), acts = pulled(WS, X)
    z, ct = reference(X, checkpointed)
    assert list(acts) == ["z_0", "z_0.grad"]
    assert_tree_allclose(acts, {"z_0": z, "z_0.grad": ct})
    assert_tree_allclose((value, grads), step(WS, X))  # (the step itself is unchanged)


@pytest.mark.parametrize("order", ["vmap_in", "vmap_out"])
def test_vmap_gives_each_examples_cotangent(order):
    per_example = lambda x: jax.grad(lambda ws: loss(ws, x[None]))(WS)  # noqa: E731
    if order == "vmap_in":
        _, acts = stx.pull(jax.vmap(per_example), cotangents=True)(X)
    else:
        _, acts = jax.vmap(stx.pull(per_example, cotangents=True))(X)
    want = jax.vmap(lambda x: reference(x[None])[1])(X)
    assert_tree_allclose(acts["z_0.grad"], want)


def test_cond_gives_the_branch_that_ran():
    def f(x, p):
        def a(x):
            return stx.save_inter(jnp.sin(x), name="s") * 2.0

        def b(x):
            return stx.save_inter(jnp.cos(x), name="s") * 3.0

        return jnp.sum(jax.lax.cond(p, a, b, x) ** 2)

    def by_hand(x, p, e):
        return jnp.sum(
            jax.lax.cond(p, lambda x: (jnp.sin(x) + e) * 2, lambda x: (jnp.cos(x) + e) * 3, x) ** 2
        )

    x = jnp.linspace(-1.0, 1.0, 5)
    for p in (True, False):
        for wrap in (lambda f: f, jax.jit):
            _, acts = stx.pull(wrap(lambda x, p: jax.grad(f)(x, p)), cotangents=True)(x, p)
            want = jax.grad(by_hand, argnums=2)(x, p, jnp.zeros(5))
            assert_tree_allclose(acts["s_0.grad"], want)


def test_custom_vjp_the_cotangent_its_rule_receives():
    received = []

    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    def bwd(x, ct):
        jax.debug.callback(lambda ct: received.append(np.asarray(ct)), ct)
        return (ct * jnp.cos(x),)

    g.defvjp(lambda x: (jnp.sin(x), x), bwd)

    def f(x):
        return jnp.sum(jnp.exp(stx.save_inter(g(x), name="y")))

    x = jnp.linspace(-1.0, 1.0, 5)
    grads, acts = stx.pull(jax.grad(f), cotangents=True)(x)
    assert_tree_allclose(acts["y_0.grad"], received[-1])
    assert_tree_allclose(grads, jax.grad(f)(x))


def test_shard_map_one_row_per_shard():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 8), NamedSharding(mesh, P("x")))

    def f(x):
        def body(x):
            return jax.lax.psum(jnp.sum(stx.save_inter(jnp.sin(x), name="z") ** 2), "x")

        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    def by_hand(x, e):
        return jnp.sum((jnp.sin(x) + e) ** 2)

    with jax.set_mesh(mesh):  # (explicit sharding: eager reductions need the mesh)
        _, acts = stx.pull(jax.grad(f), cotangents=True)(x)
        want = jax.grad(by_hand, argnums=1)(x, jnp.zeros(8))
    assert acts["z_0.grad"].shape == (4, 2)  # (shards, each shard's)
    assert_tree_allclose(acts["z_0.grad"].reshape(8), want)


def test_equinox_checkpointed_while_loop_reverse_mode():
    """The backward loop runs the iterations last to first: as for any while loop, its last
    iteration, the forward pass's first, is what comes back."""

    def run(x, eps=None):
        def body(c):
            i, v = c
            v = jnp.sin(v) + 0.1
            v = stx.save_inter(v, name="v") if eps is None else v + eps[i]
            return i + 1, v

        _, v = eqx.internal.while_loop(
            lambda c: c[0] < 3, body, (0, x), max_steps=5, kind="checkpointed"
        )
        return jnp.sum(v**2)

    x = jnp.linspace(-1.0, 1.0, 4)
    _, acts = stx.pull(jax.grad(run), cotangents=True)(x)
    want = jax.grad(run, argnums=1)(x, jnp.zeros((5, 4)))[0]  # iteration 0's
    assert_tree_allclose(acts["v_1.grad"], want)


def test_cotangents_without_differentiation_inside_say_so():
    # Not a dict without its '.grad' keys (the user's next line a bare KeyError): an error that
    # says why there are none, and what to pull instead.
    def f(x):
        return jnp.sum(stx.save_inter(jnp.sin(x), name="h"))

    x = jnp.ones(3)
    why = r"differentiates none of its marks \('h'; the first at .*test_cotangents.py:\d+\)"
    with pytest.raises(stx.CotangentsError, match=why + r"(.|\n)*stx.pull\(jax.grad\(loss\)"):
        stx.pull(f, cotangents=True)(x)
    with pytest.raises(stx.CotangentsError, match=why):  # under jit: when it is traced
        jax.jit(stx.pull(f, cotangents=True))(x)
    # Differentiated outside the pull: its backward pass runs after pull returned.
    with pytest.raises(stx.CotangentsError, match=why):
        jax.grad(stx.pull(f, cotangents=True), has_aux=True)(x)
    assert list(stx.pull(jax.grad(f))(x)[1]) == ["h_0"]  # (not asked)
    assert list(stx.pull(jax.grad(f), cotangents=True)(x)[1]) == ["h_0", "h_0.grad"]


# ---- edit: plant at "h_0.grad" ---------------------------------------------------------------


@jax.custom_vjp
def clipped(z):
    return z


clipped.defvjp(lambda z: (z, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))


def loss_clipped_by_hand(ws, x):
    def layer(h, w):
        return jnp.tanh(clipped(h @ w)), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2) * 5.0


@pytest.mark.parametrize("jit", [False, True])
def test_plant_a_hook_on_the_cotangent_is_a_custom_vjp_identity(jit):
    step = jax.value_and_grad(lambda ws, x: loss(ws, x) * 5.0)
    clip = {"z_0.grad": lambda g: jnp.clip(g, -0.5, 0.5)}
    planted = lambda ws, x: stx.plant(step)(clip, ws, x)  # noqa: E731
    got = (jax.jit(planted) if jit else planted)(WS, X)
    want = jax.value_and_grad(loss_clipped_by_hand)(WS, X)
    assert_tree_allclose(got, want)
    assert not np.allclose(got[1], step(WS, X)[1])  # (the clip bites)


def test_plant_a_cotangent_where_nothing_differentiates_says_so():
    def f(x):
        return jnp.sum(stx.save_inter(jnp.sin(x), name="h"))

    with pytest.raises(
        stx.PlantError, match=r"'h_0.grad'(.|\n)*only where the function differentiates"
    ):
        stx.plant(f)({"h_0.grad": jnp.zeros(3)}, jnp.ones(3))


def test_plant_zero_cuts_a_path_and_mixes_with_a_forward_plant():
    def f(x):
        a = stx.save_inter(jnp.sin(x), name="a")
        b = stx.save_inter(jnp.cos(x), name="b")
        return jnp.sum(a * b)

    x = jnp.linspace(0.0, 1.0, 4)
    grads = stx.plant(jax.grad(f))({"a_0.grad": jnp.zeros(4)}, x)
    assert_tree_allclose(grads, -jnp.sin(x) * jnp.sin(x))  # only through b
    # With the forward value of b replaced as well: d/dx sum(sin(x) * 2), a's path cut.
    grads = stx.plant(jax.grad(f))({"a_0.grad": jnp.zeros(4), "b_0": jnp.full(4, 2.0)}, x)
    assert_tree_allclose(grads, jnp.zeros(4))
    grads = stx.plant(jax.grad(f))({"b_0": jnp.full(4, 2.0)}, x)
    assert_tree_allclose(grads, 2.0 * jnp.cos(x))


def test_plant_names_each_occurrence_as_pull_does():
    """Two occurrences of one name: `"s_0.grad"` is the first mark's cotangent, as `pull`
    keys it, not the first the backward pass reaches (issue 39, item 1)."""

    def f(x):
        a = stx.save_inter(jnp.sin(x), name="s")
        b = stx.save_inter(jnp.cos(x[:1]), name="s")
        return jnp.sum(a) + 2.0 * jnp.sum(b)

    x = jnp.array([0.5, 1.0])
    step = jax.grad(f)
    cut_first = stx.plant(step)({"s_0.grad": jnp.zeros(2)}, x)
    assert_tree_allclose(cut_first, jnp.array([-2.0 * jnp.sin(0.5), 0.0]))
    cut_second = stx.plant(step)({"s_1.grad": jnp.zeros(1)}, x)
    assert_tree_allclose(cut_second, jnp.cos(x))
    with pytest.raises(stx.PlantError, match=r"'s_1.grad'.*float32\[2\].*float32\[1\]"):
        stx.plant(step)({"s_1.grad": jnp.zeros(2)}, x)  # (s_0's shape)
    # Planting back what pull read changes nothing.
    _, inters = stx.pull(step, cotangents=True)(x)
    grads = {k: v for k, v in inters.items() if k.endswith(".grad")}
    assert sorted(grads) == ["s_0.grad", "s_1.grad"]
    assert_tree_allclose(stx.plant(step)(grads, x), step(x))


def test_plant_a_tied_layer_applied_twice():
    """One `jax.jit` layer called twice: JAX differentiates its trace once for both calls, and
    each call's cotangent is still its own."""

    @jax.jit
    def layer(w, h):
        return jnp.tanh(stx.save_inter(h * w, name="pre"))

    def f(w, x):
        return jnp.sum(layer(w, layer(w, x)) ** 2)

    w, x = jnp.float32(0.8), jnp.linspace(-1.0, 1.0, 3)
    step = jax.grad(f, argnums=1)

    def by_hand(scale_first):  # the cotangent of the first call's `pre` scaled
        @jax.custom_vjp
        def scaled(v):
            return v

        scaled.defvjp(lambda v: (v, None), lambda _, g: (g * scale_first,))
        return jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(scaled(x * w)) * w) ** 2), 1)(w, x)

    def perturbed(d0, d1):  # f with a perturbation added at each call's `pre`
        h = jnp.tanh(x * w + d0)
        return jnp.sum(jnp.tanh(h * w + d1) ** 2)

    _, inters = stx.pull(step, cotangents=True)(w, x)
    assert sorted(inters) == ["pre_0", "pre_0.grad", "pre_1", "pre_1.grad"]
    want = jax.grad(perturbed, argnums=(0, 1))(jnp.zeros(3), jnp.zeros(3))
    assert_tree_allclose((inters["pre_0.grad"], inters["pre_1.grad"]), want)
    got = stx.plant(step)({"pre_0.grad": lambda g: 3.0 * g}, w, x)
    assert_tree_allclose(got, by_hand(3.0))


# A loop or a branch inside a `vmap` inside the differentiated function (a batch loss of a
# per-example recurrent model): issue 39, item 2. The reference threads a perturbation, one
# per example and iteration, through the same program by hand.


def _per_example(kind, w, x, d):
    """`x` one example (3 steps); `d` the perturbation at the mark, laid out as pull lays out
    the value (iterations first, here per example)."""
    if kind == "scan":

        def body(h, xd):
            return jnp.tanh(w * h + xd[0]) + xd[1], None

        return jax.lax.scan(body, 0.0, (x, d))[0] ** 2
    if kind == "fori":
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(w * h + x[i]) + d[i], 0.0) ** 2
    if kind == "map":  # (batch_size=3: one batch of 3, laid out (1, 3))
        rows = (x, d.reshape(3))
        return jnp.sum(jax.lax.map(lambda a: jnp.sin(w * a[0]) + a[1], rows, batch_size=3))
    return jax.lax.cond(jnp.sum(x) > 1.5, lambda: jnp.sum(jnp.sin(w * x) + d), lambda: 0.0)


def _marked(kind, w, x):
    mark = lambda v: stx.save_inter(v, name="h")  # noqa: E731
    if kind == "scan":
        return jax.lax.scan(lambda h, xt: (mark(jnp.tanh(w * h + xt)), None), 0.0, x)[0] ** 2
    if kind == "fori":
        return jax.lax.fori_loop(0, 3, lambda i, h: mark(jnp.tanh(w * h + x[i])), 0.0) ** 2
    if kind == "map":
        return jnp.sum(jax.lax.map(lambda a: mark(jnp.sin(w * a)), x, batch_size=3))
    return jax.lax.cond(jnp.sum(x) > 1.5, lambda: jnp.sum(mark(jnp.sin(w * x))), lambda: 0.0)


XS = jnp.array([[0.1, 0.2, 0.3], [0.6, 0.7, 0.8]])  # (the second example takes the branch)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["scan", "fori", "map", "cond"])
def test_a_loop_or_branch_under_vmap_inside_grad_gives_its_cotangent(kind, jit):
    def loss(w, xs):
        return jnp.mean(jax.vmap(lambda x: _marked(kind, w, x))(xs))

    step = jax.grad(loss)
    _, inters = stx.pull(jax.jit(step) if jit else step, cotangents=True)(0.5, XS)
    assert sorted(inters) == ["h_0", "h_0.grad"]
    per_site = (2, 1, 3) if kind == "map" else XS.shape  # (examples, steps or elements)

    def perturbed(d):
        return jnp.mean(jax.vmap(lambda x, dd: _per_example(kind, 0.5, x, dd))(XS, d))

    want = jax.grad(perturbed)(jnp.zeros(per_site))
    assert_tree_allclose(inters["h_0.grad"], want)
    assert inters["h_0.grad"].shape == inters["h_0"].shape == per_site
    # planted: the cotangent cut, and doubled, as a custom_vjp identity there would
    assert_tree_allclose(
        stx.plant(step)({"h_0.grad": jnp.zeros(per_site)}, 0.5, XS), jnp.float32(0.0)
    )
    doubled = stx.plant(step)({"h_0.grad": lambda g: 2.0 * g}, 0.5, XS)

    @jax.custom_vjp
    def twice(v):
        return v

    twice.defvjp(lambda v: (v, None), lambda _, g: (2.0 * g,))

    def by_hand(w):
        def marked(x):
            if kind == "scan":
                body = lambda h, xt: (twice(jnp.tanh(w * h + xt)), None)  # noqa: E731
                return jax.lax.scan(body, 0.0, x)[0] ** 2
            if kind == "fori":
                step = lambda i, h: twice(jnp.tanh(w * h + x[i]))  # noqa: E731
                return jax.lax.fori_loop(0, 3, step, 0.0) ** 2
            if kind == "map":
                return jnp.sum(jax.lax.map(lambda a: twice(jnp.sin(w * a)), x, batch_size=3))
            true = lambda: jnp.sum(twice(jnp.sin(w * x)))  # noqa: E731
            return jax.lax.cond(jnp.sum(x) > 1.5, true, lambda: 0.0)

        return jnp.mean(jax.vmap(marked)(XS))

    assert_tree_allclose(doubled, jax.grad(by_hand)(0.5))


@pytest.mark.parametrize("jit", [False, True])
def test_a_batched_cond_with_one_name_in_both_branches_gives_one_cotangent(jit):
    """Issue 47: under a `vmap` inside `grad`, the predicate batched, JAX runs both branches
    and selects; a mark of one name in each (one slot) has one cotangent, each example's from
    the branch it took: the cotangent by hand, with a perturbation added at the slot."""

    def g(x, e):
        def a(x):
            return (stx.save_inter(jnp.sin(x), name="c") + e) * 2.0

        def b(x):
            return (stx.save_inter(jnp.cos(x) * x, name="c") + e) * 3.0

        return jax.lax.cond(jnp.sum(x) > 0, a, b, x)

    def loss(xs, es):
        return jnp.sum(jax.vmap(g)(xs, es) ** 2)

    xs = jnp.array([[0.3, 0.5], [-0.7, 0.2], [-0.1, -0.4]])  # branches a, b, b
    zeros = jnp.zeros_like(xs)
    step = lambda xs: jax.grad(loss)(xs, zeros)  # noqa: E731
    grads, inters = stx.pull(jax.jit(step) if jit else step, cotangents=True)(xs)
    assert sorted(inters) == ["c_0", "c_0.grad"]
    assert_tree_allclose(inters["c_0.grad"], jax.grad(loss, argnums=1)(xs, zeros))
    assert_tree_allclose(grads, jax.grad(loss)(xs, zeros))
    want = jnp.where(jnp.sum(xs, 1, keepdims=True) > 0, jnp.sin(xs), jnp.cos(xs) * xs)
    assert_tree_allclose(inters["c_0"], want)


def _branch(marks, x, e, first):
    """A branch: marks `(name, c)` in order, on `x`; with `e`, no marks but the perturbation
    of each one's slot added where it is: `name_k`, k its occurrence in this branch after the
    `first[name]` slots of earlier calls."""
    h, counts = x, {}
    for name, c in marks:
        n = counts[name] = counts.get(name, -1) + 1
        v = jnp.tanh(h * 0.9 + c)
        h = stx.save_inter(v, name=name) if e is None else v + e[f"{name}_{first[name] + n}"]
    return h


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.exhaustive) for s in (1, 2))]
)
def test_random_batched_conds_give_each_slot_one_cotangent(seed):
    """Random branches of marks named from a small set (so the two branches share slots, or
    not) under a `vmap` inside `grad`, the predicate batched, called once or twice (a `jax.jit`
    called twice is differentiated once for both calls), jitted or not: every slot's
    cotangent, each example's from the branch it took, against the gradient at a zero
    perturbation of the slot (one per slot and call, added by either branch)."""
    rng = np.random.default_rng(seed)
    for _ in range(10):
        branches = [
            [(str(rng.choice(["a", "b", "c"])), float(rng.uniform(-0.5, 0.5))) for _ in range(k)]
            for k in rng.integers(1, 4, size=2)
        ]
        threshold, jit = float(rng.uniform(-0.5, 0.5)), bool(rng.random() < 0.5)
        calls = int(rng.integers(1, 3))
        per_call = {
            name: max(sum(m == name for m, _ in b) for b in branches)
            for name in {m for b in branches for m, _ in b}
        }
        slots = sorted(f"{name}_{k}" for name, n in per_call.items() for k in range(n * calls))

        def loss(xs, es):
            def g(x, e, call):
                first = {name: call * n for name, n in per_call.items()}
                false, true = (lambda x, b=b: _branch(b, x, e, first) for b in branches)
                return jax.lax.cond(jnp.sum(x) > threshold, true, false, x)

            if es is None and calls > 1:  # one jitted function, called twice
                once = jax.jit(lambda xs: jax.vmap(lambda x: g(x, None, 0))(xs))
                return jnp.sum(jnp.sin(once(once(xs) * 1.5)) * 2.0)
            h = xs
            for call in range(calls):
                h = jax.vmap(lambda x, e, call=call: g(x, e, call))(h, es)
                h = h * 1.5 if call < calls - 1 else h
            return jnp.sum(jnp.sin(h) * 2.0)

        xs = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
        step = lambda xs: jax.grad(loss)(xs, None)  # noqa: E731
        _, inters = stx.pull(jax.jit(step) if jit else step, cotangents=True)(xs)
        assert sorted(inters) == sorted([*slots, *(k + ".grad" for k in slots)]), branches
        zeros = {k: jnp.zeros_like(xs) for k in slots}
        want = jax.grad(loss, argnums=1)(xs, zeros)
        for key in slots:
            np.testing.assert_allclose(
                inters[key + ".grad"],
                want[key],
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{key}: {branches}, {calls} calls",
            )


def test_first_nonfinite_inside_a_vmapped_scan_inside_the_grad():
    def per_example(w, x):
        def body(h, xt):
            z = stx.save_inter(w * h + xt, name="z")
            return jnp.sqrt(z), None

        return jax.lax.scan(body, 1.0, x)[0]

    def loss(w, xs):
        return jnp.mean(jax.vmap(lambda x: per_example(w, x))(xs))

    xs = jnp.array([[0.0, 0.0, 0.0], [0.0, -1.0, 1.0]])  # example 1: z is 0 at step 1 only
    _, found = stx.first_nonfinite(jax.grad(loss))(1.0, xs)
    assert found is not None and found.key == "z_0.grad" and found.index == (1, 1)
    assert float(found.value) == 0.0


def _in_scope(x):
    with jax.named_scope("blk"):
        y = jnp.sin(x)
    return jnp.sum(y)


@pytest.mark.parametrize(
    "make",
    [
        lambda: stx.pull(jax.grad(_in_scope), at=stx.scopes("blk"), cotangents=True),
        lambda: stx.pull(jax.jit(jax.grad(_in_scope)), at=stx.scopes("blk"), cotangents=True),
        lambda: stx.pull(_in_scope, at=stx.scopes("blk"), cotangents=True),  # (no grad inside)
        lambda: functools.partial(
            stx.plant(jax.grad(_in_scope), at=stx.scopes("blk")), {"blk_0.grad": jnp.zeros(3)}
        ),
    ],
)
def test_a_named_scope_with_cotangents_says_why_it_has_none(make):
    """One rule wherever the scope is, whether or not the function differentiates (item 6)."""
    with pytest.raises(stx.SelectionError, match=r"scope 'blk'.*no cotangent can be read"):
        make()(jnp.ones(3))


# ---- localise ------------------------------------------------------------------------------


def poisoned(ws, bs, x):
    """Six layers under `lax.scan`; in layer 3 the bias is 0 and the weights too, so `z` is 0
    there, and `exp(log(z))` (finite forward: 0) has a NaN derivative."""

    def layer(h, wb):
        w, b = wb
        z = stx.save_inter(jnp.square(h @ w + b[None]), name="pre")
        return jnp.exp(jnp.log(z)), None

    return jnp.sum(jax.lax.scan(layer, x, (ws, bs))[0])


def poisoned_model():
    ws = jnp.stack([jnp.eye(3) * 0.5] * 6).at[3].set(0.0)
    bs = jnp.full((6, 3), 0.2).at[3].set(0.0)
    return ws, bs, jnp.ones((2, 3))


def test_first_nonfinite_names_layer_3_not_the_loss():
    ws, bs, x = poisoned_model()
    grads, found = stx.first_nonfinite(jax.grad(poisoned))(ws, bs, x)
    assert not np.isfinite(grads).all()
    assert found.key == "pre_0.grad" and found.index == (3,)
    assert found.location.endswith(f"test_cotangents.py:{poisoned.__code__.co_firstlineno + 6}")
    np.testing.assert_array_equal(found.value, np.zeros((2, 3)))
    assert np.isnan(found.cotangent).all()
    assert "'pre_0.grad' at index (3,)" in str(found)


def test_first_nonfinite_costs_one_run_when_finite():
    ws, bs, x = poisoned_model()
    ws, bs = ws.at[3].set(0.5), bs.at[3].set(0.2)
    calls = []

    def step(ws, bs, x):
        calls.append(1)
        return jax.grad(poisoned)(ws, bs, x)

    grads, found = stx.first_nonfinite(step)(ws, bs, x)
    assert found is None and len(calls) == 1
    assert_tree_allclose(grads, jax.grad(poisoned)(ws, bs, x))


def test_first_nonfinite_per_example_under_vmap():
    ws, bs, x = poisoned_model()
    xs = jnp.stack([x, x.at[:].set(-0.4)])  # example 1: z is 0 in layer 0 as well
    per_example = jax.vmap(jax.grad(poisoned), in_axes=(None, None, 0))
    _, found = stx.first_nonfinite(per_example)(ws, bs, xs)
    # Both examples go non-finite at layer 3, which the backward pass reaches first; of the
    # two, the lower example (a tie-break).
    assert found.key == "pre_0.grad" and found.index == (0, 3)  # (example, layer)


def test_first_nonfinite_orders_by_layer_before_example():
    """Example 0 goes non-finite at layer 3, example 1 at layer 1: the backward pass reaches
    layer 3 first (issue 39, item 5)."""

    def pe(x, keep):
        def layer(h, k):
            z = stx.save_inter(h * k, name="z")
            return h + jnp.sqrt(z), None

        return jax.lax.scan(layer, x, keep)[0].sum()

    keep = jnp.ones((2, 4)).at[0, 3].set(0.0).at[1, 1].set(0.0)
    _, found = stx.first_nonfinite(jax.vmap(jax.grad(pe)))(jnp.ones((2, 2)), keep)
    assert found.key == "z_0.grad" and found.index == (0, 3)
    np.testing.assert_array_equal(found.value, jnp.zeros(2))


def test_first_nonfinite_answers_alike_on_a_cached_call():
    """The second call with the same shapes takes the cached trace: the same answer (item 3)."""

    def loss(ws, x):
        def layer(h, w):
            z = stx.save_inter(h * w, name="z")
            return h + jnp.sqrt(z), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0])

    step = jax.grad(loss)
    answers = [stx.first_nonfinite(step)(jnp.array([1.0, 0.0, 1.0]), jnp.array([1.0, 2.0]))[1]]
    answers.append(stx.first_nonfinite(step)(jnp.array([1.0, 0.0, 1.0]), jnp.array([1.0, 2.0]))[1])
    for found in answers:
        assert found.key == "z_0.grad" and found.index == (1,)
        np.testing.assert_array_equal(found.value, jnp.zeros(2))


def test_first_nonfinite_keeps_the_example_under_a_vmap_inside_the_grad():
    """A batch-mean loss: the `vmap` is inside the differentiation (item 4)."""

    def f(w, xs):
        return jnp.mean(jax.vmap(lambda x: jnp.sum(jnp.sqrt(stx.save_inter(x * w, name="z"))))(xs))

    xs = jnp.array([[1.0, 2.0], [0.0, 4.0], [5.0, 6.0]])
    _, found = stx.first_nonfinite(jax.grad(f))(jnp.ones(2), xs)
    assert found.key == "z_0.grad" and found.index == (1,)
    np.testing.assert_array_equal(found.value, xs[1])
    assert np.isinf(np.asarray(found.cotangent)[0])


# ---- real training steps, models nobody marked ---------------------------------------------


def test_an_equinox_optax_step_selected_by_module():
    """Each layer's output cotangent, per example, from the step's own backward pass, against
    the gradient with respect to a perturbation of each layer's output (the MLP by hand)."""
    x, y = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.ones((3, 2))
    model = eqx.nn.MLP(4, 2, width_size=8, depth=2, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, state, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    def by_hand(eps):
        def forward(x, eps):
            h = x
            for i, layer in enumerate(model.layers):
                h = layer(h) + eps[i]
                h = jax.nn.relu(h) if i < 2 else h
            return h

        return jnp.mean((jax.vmap(forward)(x, eps) - y) ** 2)

    pulled = stx.pull(step, at=stx.modules("layers[*]"), cotangents=True)
    (new_model, new_state, value), acts = pulled(model, state, x, y)
    eps = [jnp.zeros((3, 8)), jnp.zeros((3, 8)), jnp.zeros((3, 2))]
    want = jax.grad(by_hand)(eps)
    for i in range(3):
        assert_tree_allclose(acts[f"layers[{i}]_0.grad"], want[i])
    # The step is the step: the same new model and state, of the model's own classes.
    assert_tree_allclose((new_model, new_state, value), step(model, state, x, y))
    assert type(new_model.layers[0]) is type(model.layers[0]) is eqx.nn.Linear
    # Without cotangents too: the optimizer's moments are copies of the model's structure.
    got, acts = stx.pull(step, at=stx.modules("layers[*]"))(model, state, x, y)
    assert_tree_allclose(got, step(model, state, x, y))
    assert list(acts) == ["layers[0]_0", "layers[1]_0", "layers[2]_0"]


def test_an_nnx_optax_step_selected_by_module_and_summarized():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])

        def __call__(self, x):
            return self.layers[1](jax.nn.relu(self.layers[0](x)))

    x, y = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.ones((3, 2))

    @nnx.jit
    def step(net, optimizer, x, y):
        value, grads = nnx.value_and_grad(lambda n: jnp.mean((n(x) - y) ** 2))(net)
        optimizer.update(net, grads)
        return value

    def by_hand(net, eps):
        h = jax.nn.relu(net.layers[0](x) + eps[0])
        return jnp.mean((net.layers[1](h) + eps[1] - y) ** 2)

    net = Net(nnx.Rngs(0))
    want = jax.grad(by_hand, argnums=1)(net, [jnp.zeros((3, 8)), jnp.zeros((3, 2))])
    kernel = net.layers[0].kernel[...]
    optimizer = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)
    pulled = stx.pull(step, at=stx.modules("layers[*]"), cotangents=True)
    _, acts = pulled(net, optimizer, x, y)
    assert_tree_allclose([acts["layers[0]_0.grad"], acts["layers[1]_0.grad"]], want)
    assert not np.allclose(net.layers[0].kernel[...], kernel)  # (the step updated it)
    # Summaries only: a per-layer table of gradient statistics from one call.
    _, stats = stx.pull(step, at=stx.modules("layers[*]"), cotangents=True, summarize=stx.stats)(
        net, optimizer, x, y
    )
    assert set(stats) == {"layers[0]_0", "layers[1]_0", "layers[0]_0.grad", "layers[1]_0.grad"}
    assert stats["layers[1]_0.grad"]["nan_count"] == 0


def test_linen_blocks_by_scope():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(3)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, eps=None):
            for i in range(2):
                x = Block()(x)
                x = x if eps is None else x + eps[i]
            return jnp.sum(x**2)

    model = Model()
    params = model.init(jax.random.key(0), X)
    step = jax.grad(model.apply)
    _, acts = stx.pull(step, at=stx.scopes("Model/Block_*"), cotangents=True)(params, X)
    want = jax.grad(lambda e: model.apply(params, X, e))([jnp.zeros((2, 3))] * 2)
    assert_tree_allclose([acts["Model/Block_0_0.grad"], acts["Model/Block_1_0.grad"]], want)


# ---- diffrax: a neural ODE's vector field, both adjoints -----------------------------------


SEEN = []


@jax.custom_vjp
def seen_and_scaled(z, scale):
    return z


def _seen_bwd(scale, g):
    jax.debug.callback(lambda g: SEEN.append(np.asarray(g)), g)
    return g * scale, None


seen_and_scaled.defvjp(lambda z, scale: (z, scale), _seen_bwd)


def ode_loss(w, y0, adjoint, by_hand=None):
    def field(t, y, w):
        z = jnp.tanh(w * y)
        return stx.save_inter(z, name="f") if by_hand is None else seen_and_scaled(z, by_hand)

    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
        args=w,
        saveat=diffrax.SaveAt(t1=True),
        adjoint=adjoint,
    )
    return jnp.sum(solution.ys**2)


@pytest.mark.parametrize(
    "adjoint",
    [pytest.param(a, marks=pytest.mark.exhaustive) for a in ("recursive_checkpoint", "backsolve")],
)
def test_diffrax_vector_field_read_and_edit(adjoint):
    """Read: as in any while loop, the cotangent of the backward solve's last evaluation (what
    a custom_vjp identity's rule received last). Edit: a hook scaling it is the identity that
    scales its cotangent."""
    adjoint = {
        "recursive_checkpoint": diffrax.RecursiveCheckpointAdjoint(),
        "backsolve": diffrax.BacksolveAdjoint(),
    }[adjoint]
    w, y0 = jnp.float32(0.7), jnp.array([0.5, -0.3])
    SEEN.clear()
    want = jax.grad(ode_loss)(w, y0, adjoint, 1.0)
    last = SEEN[-1]
    grads, acts = stx.pull(jax.grad(ode_loss), cotangents=True)(w, y0, adjoint)
    (key,) = [k for k in acts if k.endswith(".grad")]
    assert_tree_allclose((grads, acts[key]), (want, last))
    planted = stx.plant(jax.grad(ode_loss))({"f.grad": lambda g: 0.5 * g}, w, y0, adjoint)
    assert_tree_allclose(planted, jax.grad(ode_loss)(w, y0, adjoint, 0.5))


# ---- cost: taps nobody reads are no program at all ------------------------------------------


def plain_loss(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)


def test_taps_not_read_compile_to_the_plain_step():
    plain = jax.value_and_grad(plain_loss)
    marked = jax.value_and_grad(loss)
    assert hlo_ops(marked, WS, X) == hlo_ops(plain, WS, X)
    unread = stx.pull(marked, cotangents=True, only=lambda meta: False)
    assert unread(WS, X)[1] == {}
    got, want = hlo_ops(unread, WS, X), hlo_ops(lambda *a: (plain(*a), {}), WS, X)
    # The same instructions; in the same order too where the fast paths are on (off, XLA
    # schedules the program `pull` evaluates again in another order, taps or none).
    assert (got if _fastpaths.on else sorted(got)) == (want if _fastpaths.on else sorted(want))
    # Read, the cotangents are outputs, and the step itself the same.
    read = stx.pull(marked, cotangents=True)
    assert len(hlo_ops(read, WS, X)) > len(hlo_ops(plain, WS, X))


# ---- selections: edit and localise in a model nobody marked ---------------------------------


class Poisoned(eqx.Module):
    """Blocks of `y = exp(log((W x + b)^2))`; block 2's weight and bias are zero."""

    blocks: list

    def __init__(self):
        keys = jax.random.split(jax.random.key(0), 4)
        self.blocks = [eqx.nn.Linear(3, 3, key=k) for k in keys]
        zero = lambda layer: eqx.tree_at(  # noqa: E731
            lambda lin: (lin.weight, lin.bias), layer, (jnp.zeros((3, 3)), jnp.zeros(3))
        )
        self.blocks[2] = zero(self.blocks[2])

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.exp(jnp.log(jnp.square(block(x))))
        return jnp.sum(x)


def test_a_selection_plants_and_localises_in_a_model_nobody_marked():
    model, x = Poisoned(), jnp.ones(3)
    step = eqx.filter_grad(lambda m, x: m(x))
    grads, found = stx.first_nonfinite(step, at=stx.modules("blocks[*]"))(model, x)
    assert found.key == "blocks[2]_0.grad" and found.place == "blocks[2]"
    np.testing.assert_array_equal(found.value, np.zeros(3))
    # Cut the path at block 2: no NaN upstream of it, and the first blocks get no gradient.
    planted = stx.plant(step, at=stx.modules("blocks[*]"))(
        {"blocks[2]_0.grad": jnp.zeros(3)}, model, x
    )
    assert np.isfinite(planted.blocks[0].weight).all()
    np.testing.assert_array_equal(planted.blocks[0].weight, 0.0)
    np.testing.assert_array_equal(planted.blocks[3].weight, step(model, x).blocks[3].weight)


def test_program_places_are_refused_with_cotangents():
    with pytest.raises(stx.SelectionError, match="cotangent"):
        stx.pull(jax.grad(loss), at=stx.primitives("tanh"), cotangents=True)

"""No cache answers for other options: `pull`, `plant` and `stx.sites`, called on one function
object again and again with other selections, `only=`, `cotangents=`, `summarize=` and shapes,
with a `jit` at every depth, give what a fresh function with the fast paths off gives.

The reference is always a *fresh* function (made again by its factory: no cache of statax's or
JAX's has seen it) evaluated with the fast paths off."""

import fnmatch
import os

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import statax as stx
from statax._core import fastpaths

HERE = os.path.basename(__file__)


def AT_SIZE(*params):  # noqa: N802 (read as a marker)
    """`params`, run only at size (`-m exhaustive`): the README's test command runs one of a
    test's depths, CI all of them."""
    return [pytest.param(p, marks=pytest.mark.exhaustive) for p in params]


def assert_same(got, want):
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for a, b in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def assert_same_pull(got, want):
    assert list(got[1]) == list(want[1])  # the keys, in order
    assert_same(got[0], want[0])
    assert_same(dict(got[1]), dict(want[1]))


def fresh(make, call):
    """`call(make())` for a function never seen, with the fast paths off."""
    with fastpaths.enabled(False):
        return call(make())


# ---- a plain JAX function, a `jit` at each depth ----------------------------------------------

LINE_SIN = None  # set below: the line of `jnp.sin` in `_core`


def _core(w, x):
    with jax.named_scope("a"):
        h = jnp.sin(x * w)  # LINE_SIN
    h = stx.save_inter(h, name="h")
    with jax.named_scope("b"):
        z = jnp.cos(h)
    z = stx.save_inter(z, name="z")
    return jnp.sum(z**2)


with open(__file__) as _file:
    LINE_SIN = next(i for i, line in enumerate(_file, 1) if line.rstrip().endswith("# LINE_SIN"))


def make_plain(depth, body=None):
    """`body` (`_core` by default) with a `jit` around it (`"outer"`), inside it (`"inside"`)
    or none: a factory of fresh functions."""
    body = _core if body is None else body

    def make():
        core = jax.jit(lambda w, x: body(w, x)) if depth == "inside" else body
        fn = lambda w, x: core(w, x) * 1.0  # noqa: E731
        return jax.jit(fn) if depth == "outer" else fn

    return make


def make_step(depth):
    """A gradient step of `_core`, with a `jit` at `depth`."""

    def make():
        core = jax.jit(lambda w, x: _core(w, x)) if depth == "inside" else _core
        step = jax.grad(lambda w, x: core(w, x) * 1.0)
        return jax.jit(step) if depth == "outer" else step

    return make


SELECTIONS = [
    stx.primitives("sin"),
    stx.primitives("cos"),
    stx.scopes("a"),
    stx.scopes("b"),
    stx.scopes("a", "b"),
    stx.lines(f"{HERE}:{LINE_SIN}"),
    None,
]


@pytest.mark.parametrize("depth", ["outer", "inside", "none"])
def test_a_second_selection_is_not_answered_by_the_first(depth):
    make = make_plain(depth)
    fn = make()
    w, x = jnp.float32(0.7), jnp.linspace(0.0, 1.0, 4)
    for _ in range(2):  # each selection twice, in turn
        for at in SELECTIONS:
            got = stx.pull(fn, at=at)(w, x)
            want = fresh(make, lambda f, at=at: stx.pull(f, at=at)(w, x))
            assert_same_pull(got, want)


def _summary(v):  # (one function, compared by identity by summarize=)
    return jnp.sum(v)


# (Places in the program are selected where nothing differentiates them: in the function, not
# in its step; see `refuse_program_places`.)
FORWARD_OPTIONS = [
    {},
    {"only": "h"},
    {"summarize": _summary},
    {"at": stx.primitives("sin")},
    {"at": stx.scopes("b")},
    {"at": stx.primitives("cos"), "only": "h"},
    {"at": stx.scopes("a"), "summarize": _summary},
    {"only": "z"},
]
STEP_OPTIONS = [
    {},
    {"only": "h"},
    {"only": "z"},
    {"cotangents": True},
    {"only": "z", "cotangents": True},
    {"summarize": _summary},
    {"cotangents": True, "summarize": _summary},
]


@pytest.mark.parametrize("depth", [*AT_SIZE("outer", "inside"), "none"])
def test_pull_plant_and_sites_on_one_function_answer_as_a_fresh_one(depth):
    make, make_forward = make_step(depth), make_plain(depth)
    step, forward = make(), make_forward()
    w = jnp.float32(0.7)
    for n in (4, 6, 4):  # shapes change, and come back
        x = jnp.linspace(0.0, 1.0, n)
        for options in FORWARD_OPTIONS:
            got = stx.pull(forward, **options)(w, x)
            want = fresh(make_forward, lambda f, o=options: stx.pull(f, **o)(w, x))
            assert_same_pull(got, want)
        for options in STEP_OPTIONS:
            got = stx.pull(step, **options)(w, x)
            want = fresh(make, lambda f, o=options: stx.pull(f, **o)(w, x))
            assert_same_pull(got, want)
        for values in (
            {"h": lambda v: 2 * v},
            {"h_0.grad": jnp.zeros(n)},
            {"z_0.grad": lambda c: -c},
            {"z_0": jnp.ones(n)},
        ):
            got = stx.plant(step)(values, w, x)
            want = fresh(make, lambda f, v=values: stx.plant(f)(v, w, x))
            assert_same(got, want)
        got = stx.sites(forward)(w, x)
        want = fresh(make_forward, lambda f: stx.sites(f)(w, x))
        assert str(got) == str(want)
        for at in (stx.primitives("sin"), stx.scopes("a")):
            assert got.bytes(at) == want.bytes(at)


# ---- Flax Linen: a jitted apply, a jit one level down, an `nn.jit` method ------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4)(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Block(name="block_0")(x)
        return Block(name="block_1")(x)


class JitNet(nn.Module):
    @nn.jit
    @nn.compact
    def __call__(self, x):
        x = Block(name="block_0")(x)
        return Block(name="block_1")(x)


def make_linen(kind):
    def make():
        net = JitNet() if kind == "nn.jit" else Net()
        if kind == "jit":
            return jax.jit(net.apply)
        if kind == "jit inside":
            apply = jax.jit(net.apply)
            return lambda p, x: apply(p, x) * 1.0
        return net.apply

    return make


@pytest.mark.parametrize("kind", ["jit", "jit inside", "nn.jit"])
def test_linen_scopes_through_a_jit_answer_each_selection(kind):
    make = make_linen(kind)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    net = JitNet() if kind == "nn.jit" else Net()
    params = net.init(jax.random.key(0), x)
    root = "JitNet" if kind == "nn.jit" else "Net"
    fn = make()
    for _ in range(2):
        for pattern in ("block_0", "block_1", "block_*"):
            at = stx.scopes(f"{root}/{pattern}")
            got = stx.pull(fn, at=at)(params, x)
            want = fresh(make, lambda f, at=at: stx.pull(f, at=at)(params, x))
            assert_same_pull(got, want)
            # and what the blocks return, run by hand
            h0 = Block().apply({"params": params["params"]["block_0"]}, x)
            h1 = Block().apply({"params": params["params"]["block_1"]}, h0)
            by_hand = {f"{root}/block_0_0": h0, f"{root}/block_1_0": h1}
            chosen = {
                k: v for k, v in by_hand.items() if fnmatch.fnmatchcase(k[:-2], f"{root}/{pattern}")
            }
            assert_same(dict(got[1]), chosen)


def test_linen_scopes_through_a_jit_kept_from_another_function():
    """A jitted `apply` called first by one pulled function, then by another under the same
    selection: its trace, kept by JAX, holds the module's mark; the program's scope is not
    marked a second time."""
    x = jnp.ones((2, 4))
    net = Net()
    params = net.init(jax.random.key(0), x)
    apply = jax.jit(net.apply)
    at = stx.scopes("Net/block_0")
    first = stx.pull(apply, at=at)(params, x)
    second = stx.pull(lambda p, x: apply(p, x) * 1.0, at=at)(params, x)
    assert list(first[1]) == list(second[1]) == ["Net/block_0_0"]
    assert_same(dict(first[1]), dict(second[1]))


# ---- Keras: a stateless_call under jax.jit ------------------------------------------------------


def make_keras():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="dense_a")(inputs)
    h = keras.layers.Dense(8, name="dense_b")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


@pytest.mark.usefixtures("allow_rank_promotion")
@pytest.mark.parametrize("depth", ["outer", "inside"])
def test_keras_scopes_through_a_jit_answer_each_selection(depth):
    model = make_keras()
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    call = jax.jit(lambda tv, ntv, x: model.stateless_call(tv, ntv, x)[0])
    if depth == "inside":
        jitted = call
        call = lambda tv, ntv, x: jitted(tv, ntv, x) * 1.0  # noqa: E731
    for _ in range(2):
        for name in ("dense_a", "dense_b", "head"):
            got = stx.pull(call, at=stx.scopes(name))(tv, ntv, x)
            assert list(got[1]) == [f"{name}_0"]
            ref = keras.Model(model.inputs, model.get_layer(name).output)
            want = ref.stateless_call(tv[: len(ref.trainable_variables)], [], x)[0]
            assert_same(got[1][f"{name}_0"], want)


# ---- equinox modules and a jitted model ------------------------------------------------------


def make_eqx(depth):
    def make():
        keys = jax.random.split(jax.random.key(1), 3)
        model = eqx.nn.MLP(3, 2, 5, 2, key=keys[0])
        if depth == "outer":
            return model, eqx.filter_jit(lambda m, x: m(x))
        if depth == "inside":
            inner = eqx.filter_jit(lambda m, x: m(x))
            return model, lambda m, x: inner(m, x) * 1.0
        return model, lambda m, x: m(x)

    return make


@pytest.mark.parametrize("depth", ["outer", "inside", "none"])
def test_equinox_module_selections_through_a_filter_jit_answer_each_selection(depth):
    make = make_eqx(depth)
    model, run = make()
    x = jnp.linspace(-1.0, 1.0, 3)
    layers = [model.layers[0](x)]
    layers.append(model.layers[1](jax.nn.relu(layers[0])))
    layers.append(model.layers[2](jax.nn.relu(layers[1])))
    for _ in range(2):
        for i in range(3):
            at = stx.modules(f"layers[{i}]")
            got = stx.pull(run, at=at)(model, x)
            assert list(got[1]) == [f"layers[{i}]_0"]
            assert_same(got[1][f"layers[{i}]_0"], layers[i])
            m2, run2 = make()
            want = fresh(lambda: None, lambda _, at=at: stx.pull(run2, at=at)(m2, x))
            assert_same_pull(got, want)


# ---- equinox's checkpointed while loop: the last iteration comes back ---------------------------


def _loop(w, x):
    def cond(c):
        return c[0] < 3

    def body(c):
        i, h = c
        return i + 1, stx.save_inter(jnp.sin(h * w) + i, name="h")

    return jnp.sum(eqx.internal.while_loop(cond, body, (0, x), max_steps=4, kind="checkpointed")[1])


def _last_iteration(w, x):  # the loop by hand: the value the last iteration marks
    h = x
    for i in range(3):
        h = jnp.sin(h * w) + i
    return h


@pytest.mark.parametrize("depth", AT_SIZE("outer", "inside", "none"))
def test_an_equinox_checkpointed_loop_on_one_function_answers_as_a_fresh_one(depth):
    make = make_plain(depth, _loop)
    fn = make()
    grad_make = lambda: jax.grad(make())  # noqa: E731
    step = grad_make()
    w = jnp.float32(0.7)
    for n in (3, 5):
        x = jnp.linspace(0.0, 1.0, n)
        for options in ({}, {"only": "h"}, {"summarize": _summary}, {"ran": True}):
            got = stx.pull(fn, **options)(w, x)
            want = fresh(make, lambda f, o=options: stx.pull(f, **o)(w, x))
            assert_same_pull(got, want)
        _, got = stx.pull(fn)(w, x)
        assert_same(got["h_0"], _last_iteration(w, x))  # (its documented rule)
        for options in ({}, {"cotangents": True}):
            got = stx.pull(step, **options)(w, x)
            want = fresh(grad_make, lambda f, o=options: stx.pull(f, **o)(w, x))
            assert_same_pull(got, want)
        got = stx.plant(step)({"h": lambda v: 2 * v}, w, x)
        want = fresh(grad_make, lambda f: stx.plant(f)({"h": lambda v: 2 * v}, w, x))
        assert_same(got, want)

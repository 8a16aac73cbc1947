"""Every answer reflects the model as it is now (issue 47).

For each kind of state a model holds (a global array rebound, an equinox model, Flax NNX
changed in place and by an optimizer step, Keras by `assign` and by `fit`, Hugging Face Flax
with `model.params` replaced), placed as the function, as an argument, or closed over by a
loss, every driver (`pull`, `plant`, `grad_inters`, `sites`, `first_nonfinite`, `stateful`,
`sweep`, `record`) is called, the state is changed, and the driver is called again: through the
same wrapper (a second, cached call) and a new one. Each answer is compared with the same
driver on a brand-new model object holding the new state, and the function's own output with
an eager call of it. Under the user's `jax.jit`, statax answers as that `jax.jit` does (a kept
jit object keeps its trace; a new one traces the model as it is now). Shapes that change
retrace. The whole matrix runs with the fast paths on and off; the README's command runs one
placement of four kinds (`-m exhaustive` the rest).
"""

from __future__ import annotations

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

import statax as stx
from statax._core import fastpaths as _fastpaths
from statax.testing import assert_tree_allclose


def assert_same(actual, expected):
    assert_tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)


pytestmark = [
    pytest.mark.usefixtures("allow_rank_promotion"),  # (Keras, transformers)
    # (Keras's `fit` reads its variables with `np.array(variable)`, NumPy 2 warns)
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword"),
]

X = jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(5, 3)
IDS = jnp.array([[1, 7, 3, 9], [4, 4, 2, 8]], jnp.int32)


# ---- the kinds of state: make, change, copy into a brand-new object, call ------------------------


class Kind:
    """A model kind: `make()`, `change(model) -> model` (the same object changed in place, or
    the new value a user rebinds: `rebinds`), `fresh(model)` (a brand-new object holding the
    same state), `call(model, x)`, the input, and the selection that reaches inside
    (`selection(placement, model)`)."""

    name: str
    x = X
    rebinds = False
    modules: str | None = None  # a path for stx.modules
    scopes: str | None = None  # a scope for stx.scopes

    def selection(self, placement: str, model):
        if self.scopes is not None:
            return stx.scopes(self.scopes)
        if self.modules is None:
            return None
        # (the model named: a loss around it, or a closure, has it as no argument)
        return stx.modules(self.modules, of=model)

    def out(self, o):  # the output's array
        return o

    def fresh(self, model):
        return model


_W = {"w": jnp.linspace(0.5, 1.5, 12, dtype=jnp.float32).reshape(3, 4)}


class Global(Kind):
    """A global array, rebound (`W = W * 3`)."""

    name = "global"

    def make(self):
        _W["w"] = jnp.linspace(0.5, 1.5, 12, dtype=jnp.float32).reshape(3, 4)
        return _W

    def change(self, model):
        model["w"] = model["w"] * 3
        return model

    @staticmethod
    def call(model, x):
        return jnp.tanh(stx.save_inter(x @ model["w"], name="h")) * 2


class Resized(Global):
    """The global array takes another shape: a retrace, not a crash."""

    name = "resized"

    def change(self, model):
        model["w"] = jnp.ones((3, 6), jnp.float32) * 0.25
        return model


class Retyped(Global):
    """The global array takes another dtype: a retrace, not a crash."""

    name = "retyped"

    def change(self, model):
        model["w"] = (model["w"] * 2).astype(jnp.bfloat16)
        return model


class Equinox(Kind):
    name = "equinox"
    modules = "layers[0]"
    rebinds = True

    def make(self):
        return _EqxNet(jax.random.PRNGKey(0))

    def change(self, model):
        return eqx.tree_at(lambda m: m.layers[0].weight, model, model.layers[0].weight * 3)

    def fresh(self, model):
        return jax.tree.map(lambda a: jnp.array(a) if eqx.is_array(a) else a, model)

    @staticmethod
    def call(model, x):
        return model(x)


class _EqxNet(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)]

    def __call__(self, x):
        return jax.vmap(lambda v: self.layers[1](jnp.tanh(self.layers[0](v))))(x)


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(3, 4, rngs=rngs)
        self.second = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


class NNX(Kind):
    """Changed in place: `net.first.kernel[...] *= 3`."""

    name = "nnx"
    modules = "first"

    def make(self):
        return _NNXNet(nnx.Rngs(0))

    def change(self, model):
        model.first.kernel[...] = model.first.kernel[...] * 3
        return model

    def fresh(self, model):
        return nnx.merge(*nnx.split(model))

    @staticmethod
    def call(model, x):
        return model(x)


class NNXOptimizer(NNX):
    """Changed by an optimizer step (`nnx.Optimizer.update`)."""

    name = "nnx-optimizer"

    def change(self, model):
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
        grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
        try:
            optimizer.update(model, grads)
        except TypeError:  # Flax < 0.11: update(grads)
            optimizer.update(grads)
        return model


class Keras(Kind):
    """Changed by `assign`."""

    name = "keras"
    scopes = "net/d1"

    def make(self):
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(2, name="d2")],
            name="net",
        )

    def change(self, model):
        kernel = model.get_layer("d1").kernel
        kernel.assign(kernel.value * 3)
        return model

    def fresh(self, model):
        new = keras.models.clone_model(model)
        for mine, theirs in zip(new.weights, model.weights, strict=True):
            mine.assign(theirs.value)
        return new

    @staticmethod
    def call(model, x):
        return model(x)


class KerasFit(Keras):
    """Changed by a step of `model.fit` (which donates the old variables' buffers)."""

    name = "keras-fit"

    def change(self, model):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.fit(np.asarray(X), np.ones((5, 2), np.float32), epochs=1, verbose=0)
        return model


class HuggingFace(Kind):
    """Hugging Face Flax GPT-2, `model.params` replaced."""

    name = "hf"
    x = IDS
    scopes = "FlaxGPT2Module/h/0"

    def make(self):
        config = transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=8
        )
        return transformers.FlaxGPT2Model(config, seed=0)

    def change(self, model):
        model.params = jax.tree.map(lambda p: p * 1.5, model.params)
        return model

    def fresh(self, model):
        new = transformers.FlaxGPT2Model(model.config, seed=1)
        new.params = jax.tree.map(jnp.array, model.params)
        return new

    def out(self, o):
        return o.last_hidden_state

    @staticmethod
    def call(model, ids):
        return model(ids)


KINDS = [
    Global(),
    Resized(),
    Retyped(),
    Equinox(),
    NNX(),
    NNXOptimizer(),
    Keras(),
    KerasFit(),
    HuggingFace(),
]


# ---- where the model is: the function itself, an argument, or closed over ------------------------


def placed(kind: Kind, placement: str, box: dict):
    """`(fn, args, at)` for the model in `box["m"]` as it is now."""
    model = box["m"]
    at = kind.selection(placement, model)
    if placement == "function":
        return model, (kind.x,), at
    if placement == "argument":
        return kind.call, (model, kind.x), at
    return (lambda x: kind.call(box["m"], x)), (kind.x,), at


PLACEMENTS = {
    "global": ["closed"],
    "resized": ["closed"],
    "retyped": ["closed"],
    # (as an argument, a Hugging Face model is a static leaf: read as closed over, at size)
    "hf": ["function", "closed"],
}


def _placements(kind: Kind) -> list[str]:
    return PLACEMENTS.get(kind.name, ["function", "argument", "closed"])


# ---- the drivers: each returns what a user compares ------------------------------------------


def _leaf(kind, out):
    return kind.out(out)


def d_pull(kind, fn, args, at, _):
    return stx.pull(fn, at=at)(*args)


def d_plant(kind, fn, args, at, _):
    _, inters = stx.pull(fn, at=at)(*args)
    key = next(iter(inters))
    return stx.plant(fn, at=at)({key: jax.tree.map(jnp.zeros_like, inters[key])}, *args)


def d_grad_inters(kind, fn, args, at, _):
    loss = lambda *a: jnp.sum(_leaf(kind, fn(*a)) ** 2)  # noqa: E731
    return stx.grad_inters(loss, at=at)(*args)


def d_sites(kind, fn, args, at, _):
    return [(s.kind, s.place, s.shape, s.dtype, s.calls) for s in stx.sites(fn)(*args)]


def d_first_nonfinite(kind, fn, args, at, _):
    if kind.x.dtype != jnp.float32:  # token ids: the gradient of the sum, with respect to
        return None  # nothing differentiable the user passes (the params are inside)
    loss = lambda *a: jnp.sum(_leaf(kind, fn(*a)) ** 2)  # noqa: E731
    grads, found = stx.first_nonfinite(jax.grad(loss, argnums=len(args) - 1), at=at)(*args)
    assert found is None
    return grads


def d_stateful(kind, fn, args, at, _):
    return stx.stateful(fn)(*args)


def d_sweep(kind, fn, args, at, _):
    metric = lambda out: jnp.mean(_leaf(kind, out))  # noqa: E731
    result = stx.sweep(fn, metric, args, at=at, mode="zero", progress=False)
    return {k: result[k] for k in result.sites}, result.clean


@functools.cache
def _metric_of(kind):  # one object per kind: a repeated sweep starts its program early
    return lambda out: jnp.mean(_leaf(kind, out))


def d_attribution(kind, fn, args, at, _):
    result = stx.sweep(fn, _metric_of(kind), args, at=at, mode="zero", method="attribution")
    return {k: result[k] for k in result.sites}, result.clean


def d_record(kind, fn, args, at, path):
    with stx.record(fn, to=path, at=at, progress=False) as recorder:
        out = recorder(*args)
    store = stx.open_store(path)
    return out, {k: store[k][-store.rows :] for k in store}


DRIVERS = {
    "pull": d_pull,
    "plant": d_plant,
    "grad_inters": d_grad_inters,
    "sites": d_sites,
    "first_nonfinite": d_first_nonfinite,
    "stateful": d_stateful,
    "sweep": d_sweep,
    "attribution": d_attribution,
    "record": d_record,
}


# What a second, cached call goes through: the same wrapper (or recorder) made before.
def cached_wrapper(driver, kind, fn, at, path):  # noqa: C901
    """A wrapper made once, before the change, and called after it; None where the driver
    has no wrapper to keep (a sweep is one call)."""
    loss = lambda *a: jnp.sum(_leaf(kind, fn(*a)) ** 2)  # noqa: E731
    if driver == "pull":
        return stx.pull(fn, at=at)
    if driver == "grad_inters":
        return stx.grad_inters(loss, at=at)
    if driver == "sites":
        wrapped = stx.sites(fn)
        return lambda *a: [(s.kind, s.place, s.shape, s.dtype, s.calls) for s in wrapped(*a)]
    if driver == "stateful":
        return stx.stateful(fn)
    if driver == "record":
        recorder = stx.record(fn, to=path, at=at, progress=False)

        def call(*a):
            out = recorder(*a)
            recorder.flush()
            store = stx.open_store(path)
            rows = store.rows // recorder.batches
            return out, {k: store[k][-rows:] for k in store}

        call.close = recorder.close
        return call
    return None


def _case_marks(kind, placement):
    fast = [  # (in the README's command: one placement of the kinds that differ most)
        ("global", "closed"),
        ("resized", "closed"),
        ("nnx", "function"),
        ("keras-fit", "function"),
    ]
    return () if (kind.name, placement) in fast else (pytest.mark.exhaustive,)


# The fast paths as this run has them; the other way at size (CI runs the suite both ways).
FAST = [
    pytest.param(flag, id=name, marks=() if flag == _fastpaths.on else (pytest.mark.exhaustive,))
    for flag, name in ((True, "fast"), (False, "plain"))
]

CASES = [
    pytest.param(kind, placement, id=f"{kind.name}-{placement}", marks=_case_marks(kind, placement))
    for kind in KINDS
    for placement in _placements(kind)
]


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("kind, placement", CASES)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_changed_model_is_answered_as_it_is_now(driver, kind, placement, fast, tmp_path):
    counter = itertools.count()
    path = lambda: str(tmp_path / f"s{next(counter)}")  # noqa: E731
    run = DRIVERS[driver]
    box = {"m": kind.make()}
    with _fastpaths.enabled(fast):
        fn, args, at = placed(kind, placement, box)
        kept = cached_wrapper(driver, kind, fn, at, path())
        before = run(kind, fn, args, at, path())
        if kept is not None:
            assert_same(kept(*args), before)
        box["m"] = kind.change(box["m"])
        fn, args, at = placed(kind, placement, box)
        now = run(kind, fn, args, at, path())
        if driver in ("pull", "stateful", "record"):  # the function's own output, eager
            eager = fn(*args)
            np.testing.assert_allclose(
                _leaf(kind, now[0]), _leaf(kind, eager), rtol=1e-5, atol=1e-6
            )
        # the same driver on a brand-new model object holding the new state
        new_fn, new_args, new_at = placed(kind, placement, {"m": kind.fresh(box["m"])})
        assert_same(now, run(kind, new_fn, new_args, new_at, path()))
        if kept is not None and driver == "record" and kind.name == "resized":
            with pytest.raises(stx.StoreError, match="does not fit the store"):
                kept(*args)  # a store never takes a batch that does not fit
        elif kept is not None:
            if not (kind.rebinds and placement != "argument"):  # (else it holds the old model)
                assert_same(kept(*args), now)  # the second, cached call of the same wrapper
            getattr(kept, "close", lambda: None)()


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("kind, placement", CASES)
def test_under_the_users_jit_as_jax_jit_does(kind, placement, fast):
    """A jit object kept from before the change keeps its trace, as `jax.jit` of the function
    alone does (the same stale answer, or the same new one where the state is an argument);
    a new jit object answers for the model as it is now."""
    box = {"m": kind.make()}
    with _fastpaths.enabled(fast):
        fn, args, at = placed(kind, placement, box)
        try:
            plain = jax.jit(fn)
            plain(*args)
            jit = jax.jit
        except TypeError:  # not a JAX type (an NNX module or Keras model as an argument)
            plain, jit = eqx.filter_jit(fn), eqx.filter_jit
            plain(*args)
        kept = jit(stx.pull(fn, at=at))
        kept(*args)
        box["m"] = kind.change(box["m"])
        if not kind.rebinds or placement == "closed":
            fn_now, args, _ = placed(kind, placement, box)
            out, _ = kept(*args)
            np.testing.assert_allclose(
                _leaf(kind, out), _leaf(kind, plain(*args)), rtol=1e-5, atol=1e-6
            )
        # A new jit object: as a new `jax.jit` of the function alone (which keeps the trace of
        # an equal function: a model object, or a pull of it, seen before).
        fn, args, at = placed(kind, placement, box)
        out, inters = jit(stx.pull(fn, at=at))(*args)
        want = _leaf(kind, jit(fn)(*args))
        np.testing.assert_allclose(_leaf(kind, out), want, rtol=1e-5, atol=1e-6)
        if np.allclose(want, _leaf(kind, fn(*args)), rtol=1e-5, atol=1e-6):
            assert_same(inters, stx.pull(fn, at=at)(*args)[1])


# ---- random programs: what a kept program computes, as the closed-over arrays change ---------

_CLOSED: dict = {}
_UNJITTED: list = []  # the names read outside any `jax.jit` (which keeps its own trace)


def _random_program(rng, depth=0, jitted=False):
    """A random function of `x` (shape (3,)) reading `_CLOSED[name]` arrays from outside its
    arguments, in random nestings of `scan`, `cond`, `vmap` and `jit`, with marks."""
    kind = rng.choice(["op", "op", "scan", "cond", "vmap", "jit"]) if depth < 3 else "op"
    name = f"w{len(_CLOSED)}"
    _CLOSED[name] = jnp.asarray(rng.normal(size=3), jnp.float32)
    if not jitted and kind != "jit":
        _UNJITTED.append(name)
    jitted = jitted or kind == "jit"
    if kind == "op":
        f = rng.choice([jnp.tanh, jnp.sin, jnp.cos])
        return lambda x: stx.save_inter(f(x * _CLOSED[name]), name=name)
    inner = _random_program(rng, depth + 1, jitted)
    if kind == "scan":
        return lambda x: jax.lax.scan(lambda c, _: (inner(c) + _CLOSED[name], None), x, None, 2)[0]
    if kind == "cond":
        other = _random_program(rng, depth + 1, jitted)
        return lambda x: jax.lax.cond(jnp.sum(x * _CLOSED[name]) > 0, inner, other, x)
    if kind == "vmap":
        return lambda x: jnp.mean(jax.vmap(inner)(x[None] * _CLOSED[name][:, None]), 0)
    return jax.jit(lambda x: inner(x) * _CLOSED[name])


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.exhaustive) for s in (1, 2))]
)
def test_random_programs_kept_by_structure_answer_as_eager_calls(seed):
    """A random program, run through `Programs` (what a sweep, a recorder and `summarize=`
    compile): after its closed-over arrays change values, one program answers for it as an
    eager `pull` does (the very constants passed in, a swapped one would show); after one
    read outside any `jax.jit` changes shape, another program is compiled (inside one,
    `jax.jit` keeps its trace, and so does the answer)."""
    from statax._drivers.programs import Programs

    rng = np.random.default_rng(seed)
    for _ in range(6):
        _CLOSED.clear()
        _UNJITTED.clear()
        fn = stx.pull(_random_program(rng))
        programs = Programs()
        x = jnp.asarray(rng.normal(size=3), jnp.float32)
        for _ in range(3):
            assert_same(programs(fn, x), fn(x))
            for name in _CLOSED:  # new values, the same shapes
                _CLOSED[name] = jnp.asarray(rng.normal(size=3), jnp.float32)
        assert len(programs._programs) <= 2  # (a `cond` branch taken in Python: none here)
        count = len(programs._programs)
        for name in _UNJITTED[:1]:
            _CLOSED[name] = jnp.ones((1,), jnp.float32)  # broadcasts: another shape
            assert_same(programs(fn, x), fn(x))
            assert len(programs._programs) == count + 1

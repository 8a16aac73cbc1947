"""Random programs against an oracle, for the backward pass at a mark.

A seeded generator builds nestings of `scan` (checkpointed or not), `fori_loop`, `lax.map`
(with `batch_size=`), `vmap`, `cond`, `jit`, `checkpoint` (with a policy) and `custom_jvp` /
`custom_vjp` nodes around one to four marks, with repeated names. Each program is run as a
step made with `grad`, `value_and_grad` or `vjp` (with or without a `jit` around it):

* every `.grad` that `pull(step, cotangents=True)` returns is compared with the gradient of the
  loss with respect to a zero perturbation added at the mark (the oracle threads the
  perturbation through the same nesting by hand, one per occurrence, laid out as `pull` lays
  out the value: one axis per enclosing loop or `vmap`, outermost first);
* the same pull called again with the same shapes (its cached path) answers alike, and for a
  quarter of the programs the step under a `vmap` of examples (the other order) gives each
  example's cotangents, example axis first;
* a planted cotangent (a scale, zeros, a clip, an array) at one occurrence is compared with a
  `custom_vjp` identity at that place that does the same to its cotangent.

The README's test command runs 2 programs per step kind; the runs at size (`-m exhaustive`)
another `STATAX_PROPERTY_PROGRAMS` (8 unless set) per kind, e.g.
`STATAX_PROPERTY_PROGRAMS=200 .venv/bin/python -m pytest -q -n auto -m exhaustive
tests/test_property_cotangents.py` is the larger run."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

N = 3  # the width of the state each node maps
PROGRAMS = {"quick": 2, "at size": int(os.environ.get("STATAX_PROPERTY_PROGRAMS", "8"))}
SIZES = ["quick", pytest.param("at size", marks=pytest.mark.exhaustive)]
POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}


# ---- programs ---------------------------------------------------------------------------------


def generate(rng: np.random.Generator, depth: int = 0, budget: list | None = None):
    """A random node: `("mark", name, c)`, `("seq", nodes)`, a leaf custom-derivative node, or a
    construct around a node. `budget` is `[marks left (1 to 4 in all), *one entry per cond]`."""
    budget = [int(rng.integers(1, 5))] if budget is None else budget
    if depth >= 3 or budget[0] <= 0 or rng.random() < 0.25:
        return _marks(rng, budget)
    kind = rng.choice(["scan", "remat_scan", "fori", "map", "vmap", "cond", "jit", "checkpoint"])
    inner = generate(rng, depth + 1, budget)
    if kind in ("scan", "remat_scan", "fori"):
        return (kind, inner, int(rng.integers(2, 4)))
    if kind == "map":
        return ("map", inner, int(rng.choice([1, 2])))  # (4 rows, batch_size 1 or 2)
    if kind == "vmap":
        return ("vmap", inner, 2)
    if kind == "cond":
        other = generate(rng, depth + 1, budget) if budget[0] > 0 else ("seq", [])
        tag = f"f{len(budget)}"  # (one tag per cond: its false branch's names are its own)
        budget.append(None)
        return ("cond", inner, renamed(other, tag), float(rng.choice([-1.0, 0.0, 1.0])))
    if kind == "checkpoint":
        return ("checkpoint", inner, str(rng.choice(sorted(POLICIES))))
    return ("jit", inner)


def _marks(rng, budget) -> tuple:
    nodes = []
    for _ in range(int(rng.integers(1, 3))):
        if budget[0] <= 0:
            break
        budget[0] -= 1
        nodes.append(("mark", str(rng.choice(["a", "b"])), float(rng.uniform(-0.5, 0.5))))
        if rng.random() < 0.4:
            nodes.append((str(rng.choice(["custom_vjp", "custom_jvp"])),))
    return ("seq", nodes)


def renamed(node, tag: str):
    """`node` with its marks' names apart from those of the other branch of a `cond` (marks of
    two branches with one name and occurrence share a key: the value of the branch that ran)."""
    if node[0] == "mark":
        return ("mark", node[1] + tag, node[2])
    if node[0] == "seq":
        return ("seq", [renamed(c, tag) for c in node[1]])
    return tuple(renamed(c, tag) if isinstance(c, tuple) else c for c in node)


def layout(node, axes=(), out=None) -> list:
    """`[(name, shape)]` of every mark in program order, its shape one axis per enclosing loop
    or `vmap`, outermost first (as `pull` lays out the value and its cotangent)."""
    out = [] if out is None else out
    kind = node[0]
    if kind == "mark":
        out.append((node[1], (*axes, N)))
    elif kind == "seq":
        for child in node[1]:
            layout(child, axes, out)
    elif kind in ("scan", "remat_scan", "fori"):
        layout(node[1], (*axes, node[2]), out)
    elif kind == "map":
        bs = node[2]
        layout(node[1], (*axes, 4 // bs, bs) if bs > 1 else (*axes, 4), out)
    elif kind == "vmap":
        layout(node[1], (*axes, node[2]), out)
    elif kind == "cond":  # (the branches in the order of the equation: false, then true)
        layout(node[2], axes, out)
        layout(node[1], axes, out)
    elif kind in ("jit", "checkpoint"):
        layout(node[1], axes, out)
    return out


def keys(marks: list) -> list[str]:
    counts: dict = {}
    out = []
    for name, _ in marks:
        out.append(f"{name}_{counts.get(name, 0)}")
        counts[name] = counts.get(name, 0) + 1
    return out


# ---- one program, run by statax (ds None) or by the oracle (perturbations and plants in ds) ----


@jax.custom_vjp
def _halved(h):
    return jnp.sin(h)


_halved.defvjp(lambda h: (jnp.sin(h), h), lambda h, g: (0.5 * g * jnp.cos(h),))


@jax.custom_jvp
def _softplus(h):
    return jnp.logaddexp(h, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


def run(node, h, w, ds, marks):
    """The program on the state `h` (shape `(N,)`). `ds` is `None` (statax: marks are
    `save_inter`s) or a dict `{key: perturbation, "P:" + key: planted value}` sliced to this
    node; `marks` is an iterator over the program's keys in order, with the plant (if any)."""
    kind = node[0]
    if kind == "mark":
        key, plant = next(marks)
        v = jnp.tanh(h * w + node[2])
        if ds is None:
            return stx.save_inter(v, name=node[1])
        v = v + ds[key]
        if plant is not None and plant[0] == key:
            v = _identity(plant[1])(v, ds["P:" + key])
        return v
    if kind == "seq":
        for child in node[1]:
            h = run(child, h, w, ds, marks)
        return h
    if kind == "custom_vjp":
        return _halved(h)
    if kind == "custom_jvp":
        return _softplus(h)
    inner = node[1]
    if kind in ("scan", "remat_scan"):
        ts = jnp.linspace(0.0, 0.3, node[2])
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)

        def body(c, xs):
            t, d = xs
            return run(inner, c + t, w, d, iter(body_marks)), None

        if kind == "remat_scan":
            body = jax.checkpoint(body)
        return jax.lax.scan(body, h, (ts, sub))[0]
    if kind == "fori":
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)

        def step(i, c):
            d = None if sub is None else jax.tree.map(lambda x: x[i], sub)
            return run(inner, 0.9 * c + 0.1 * i, w, d, iter(body_marks))

        return jax.lax.fori_loop(0, node[2], step, h)
    if kind == "map":
        bs = node[2]
        rows = h[None] * jnp.linspace(0.5, 1.5, 4)[:, None]
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)
        flat = sub  # (one row per example; with batch_size, rows of batches)
        if bs > 1 and sub is not None:
            flat = jax.tree.map(lambda x: x.reshape(4, *x.shape[2:]), sub)
        outs = jax.lax.map(
            lambda a: run(inner, a[0], w, a[1], iter(body_marks)),
            (rows, flat),
            batch_size=bs if bs > 1 else None,
        )
        return jnp.mean(outs, axis=0)
    if kind == "vmap":
        rows = h[None] * jnp.linspace(0.5, 1.5, node[2])[:, None]
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)
        outs = jax.vmap(lambda r, d: run(inner, r, w, d, iter(body_marks)))(rows, sub)
        return jnp.mean(outs, axis=0)
    if kind == "cond":
        false_marks = _recorded(marks, node[2])
        true_marks = _recorded(marks, inner)
        return jax.lax.cond(
            jnp.sum(h) > node[3],
            lambda: run(inner, h, w, _only(ds, true_marks), iter(true_marks)),
            lambda: run(node[2], h, w, _only(ds, false_marks), iter(false_marks)),
        )
    if kind == "jit":
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)
        return jax.jit(lambda h, w, d: run(inner, h, w, d, iter(body_marks)))(h, w, sub)
    if kind == "checkpoint":
        body_marks = _recorded(marks, inner)
        sub = _only(ds, body_marks)
        fn = jax.checkpoint(
            lambda h, w, d: run(inner, h, w, d, iter(body_marks)), policy=POLICIES[node[2]]
        )
        return fn(h, w, sub)
    raise AssertionError(kind)


def _recorded(marks, node) -> list:
    """The next marks of `node`, taken from `marks` once (a body may be traced again)."""
    return [next(marks) for _ in layout(node)]


def _only(ds, body_marks):
    """The perturbations (and planted values) of the marks `body_marks`: what a construct
    passes into its body, sliced as it slices them."""
    if ds is None:
        return None
    names = {k for k, _ in body_marks}
    return {k: v for k, v in ds.items() if k in names or k[2:] in names}


def _identity(kind):
    """A `custom_vjp` identity that does to its cotangent what `plant` is asked to."""

    @jax.custom_vjp
    def identity(v, r):
        return v

    def bwd(r, g):
        new = {
            "scale": lambda: 1.7 * g,
            "clip": lambda: jnp.clip(g, -0.05, 0.05),
            "zeros": lambda: jnp.zeros_like(g),
            "array": lambda: r,
        }[kind]()
        return new, jnp.zeros_like(r)

    identity.defvjp(lambda v, r: (v, r), bwd)
    return identity


# ---- steps ------------------------------------------------------------------------------------

X = jnp.array([0.3, -0.5, 0.8])
W = jnp.float32(0.9)


def loss_of(node, ds=None, plant=None, names=()):
    def loss(w, x):
        marks = iter([(k, plant) for k in names])
        h = run(node, x, w, ds, marks)
        return jnp.sum(jnp.sin(h) * h)

    return loss


def step_of(kind: str, loss):
    if kind == "grad":
        return jax.grad(loss, argnums=(0, 1))
    if kind == "value_and_grad":
        return jax.value_and_grad(loss, argnums=1)
    return lambda w, x: jax.vjp(lambda x: loss(w, x), x)[1](jnp.float32(1.0))


def programs(seed: int, size: str = "quick"):
    rng = np.random.default_rng(seed if size == "quick" else seed + 100)  # (other programs)
    for _ in range(PROGRAMS[size]):
        yield generate(rng), bool(rng.random() < 0.3), rng


def _zeros(marks, names):
    return {k: jnp.zeros(shape) for k, (_, shape) in zip(names, marks, strict=True)}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", ["grad", "value_and_grad", "vjp"])
def test_every_cotangent_is_the_gradient_at_a_zero_perturbation(kind, size):
    seed = {"grad": 0, "value_and_grad": 1, "vjp": 2}[kind]
    for node, jit, rng in programs(seed, size):
        marks = layout(node)
        names = keys(marks)
        step = step_of(kind, loss_of(node, names=names))
        step = jax.jit(step) if jit else step
        pulled = stx.pull(step, cotangents=True)
        out, inters = pulled(W, X)
        assert sorted(inters) == sorted([*names, *(k + ".grad" for k in names)]), node
        for k, (_, shape) in zip(names, marks, strict=True):
            assert inters[k].shape == shape, (node, k)
        want = jax.grad(lambda ds: loss_of(node, ds, names=names)(W, X))(_zeros(marks, names))
        _check_grads(inters, want, names, node)
        # A second call with the same shapes takes the cached path: the same answer.
        _check_grads(pulled(W, X)[1], want, names, node)
        if rng.random() < 0.25:  # the other order: the step under a `vmap` of examples
            _check_per_example(node, kind, marks, names)
        _check_a_plant(node, kind, jit, marks, names, rng)


def _check_grads(inters, want, names, node):
    for k in names:
        np.testing.assert_allclose(
            inters[k + ".grad"], want[k], rtol=1e-4, atol=1e-5, err_msg=f"{k} in {node}"
        )


XS = jnp.stack([X, -0.5 * X])


def _check_per_example(node, kind, marks, names):
    """`vmap(step)` over two examples: each cotangent per example, the example axis first."""
    step = jax.vmap(step_of(kind, loss_of(node, names=names)), in_axes=(None, 0))
    _, inters = stx.pull(step, cotangents=True)(W, XS)

    def one(x):
        return jax.grad(lambda ds: loss_of(node, ds, names=names)(W, x))(_zeros(marks, names))

    want = jax.vmap(one)(XS)
    for k, (_, shape) in zip(names, marks, strict=True):
        assert inters[k + ".grad"].shape == (2, *shape), (node, k)
    _check_grads(inters, want, names, node)


def _check_a_plant(node, kind, jit, marks, names, rng):
    """One occurrence's cotangent planted, against the `custom_vjp` identity there."""
    i = int(rng.integers(len(names)))
    key, shape = names[i], marks[i][1]
    how = str(rng.choice(["scale", "clip", "zeros", "array"]))
    array = jnp.asarray(rng.normal(size=shape), jnp.float32)
    value = {
        "scale": lambda g: 1.7 * g,
        "clip": lambda g: jnp.clip(g, -0.05, 0.05),
        "zeros": jnp.zeros(shape),
        "array": array,
    }[how]
    step = step_of(kind, loss_of(node, names=names))
    planted = lambda w, x: stx.plant(step)({key + ".grad": value}, w, x)  # noqa: E731
    got = (jax.jit(planted) if jit else planted)(W, X)
    ds = _zeros(marks, names)
    ds["P:" + key] = array
    want = step_of(kind, loss_of(node, ds, (key, how), names))(W, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{how} {key} {node}")

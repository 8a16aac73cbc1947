"""`sinking.sink`: work moved into the branch of a `cond` that alone needs it. The moved program
computes what the original computes (random programs of chained conds, each reading what came
before, against the program as traced), work goes where it should (into the one branch that
reads it, nowhere if two branches or anything after the `cond` read it, never an equation with
effects), and a sweep's program (`reuse=True`) runs no layer outside the conds that skip it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex

import statax as stx
from statax._core.sinking import sink
from statax._jax import jaxprs as _jaxprs


def opened(jaxpr):
    return jaxpr.jaxpr if _jaxprs.wraps_jaxpr(jaxpr) else jaxpr


def outside(jaxpr, name: str) -> int:
    """How many equations of primitive `name` run outside every `cond` (inside `jit`s too)."""
    total = 0
    for eqn in opened(jaxpr).eqns:
        if eqn.primitive.name == name:
            total += 1
        if eqn.primitive.name != "cond":
            total += sum(outside(j, name) for j in _jaxprs.jaxprs_in_params(eqn.params))
    return total


def check(fn, *args):
    """`fn`'s trace, moved, computes what the trace computes; returns both."""
    closed = jax.make_jaxpr(fn)(*args)
    moved = sink(closed)
    want = jex.jaxpr_as_fun(closed)(*args)
    got = jex.jaxpr_as_fun(moved)(*args)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return closed, moved


@pytest.mark.parametrize("take", [True, False])
def test_work_only_one_branch_reads_moves_into_it(take):
    def f(take, x):
        y = jnp.sin(x) * 2  # read only by the second branch
        return jax.lax.cond(take, lambda y, x: x, lambda y, x: y + 1, y, x)

    closed, moved = check(f, take, jnp.arange(3.0))
    assert outside(closed, "sin") == 1 and outside(moved, "sin") == 0
    assert outside(moved, "mul") == 0


def test_work_two_branches_or_a_later_equation_read_stays():
    def both(take, x):
        y = jnp.sin(x)
        return jax.lax.cond(take, lambda y: y * 2, lambda y: y + 1, y)

    def later(take, x):
        y = jnp.sin(x)
        return jax.lax.cond(take, lambda y: x, lambda y: y, y) + y

    for f in (both, later):
        for take in (True, False):
            _, moved = check(f, take, jnp.arange(3.0))
            assert outside(moved, "sin") == 1


def test_work_with_effects_stays():
    seen = []

    def f(take, x):
        y = jnp.sin(x)
        jax.debug.callback(lambda v: seen.append(v), y)
        return jax.lax.cond(take, lambda y: x, lambda y: jnp.cos(y), y)

    closed, moved = check(f, True, jnp.arange(3.0))
    assert seen and outside(moved, "sin") == 1


def test_into_conds_inside_jits():
    @jax.jit
    def inner(take, x):
        y = jnp.sin(x)
        return jax.lax.cond(take, lambda y: x, lambda y: y, y)

    _, moved = check(lambda t, x: inner(t, x) * 2, False, jnp.arange(3.0))
    assert outside(moved, "sin") == 0


class Chain:
    """A random program: `n` stages, each a few elementwise and matrix steps from the values
    before it (the last, or an earlier one: not a chain), some behind a `cond` on a traced
    integer that takes a given value instead (as a sweep's skipped site does), some whose
    result is also returned."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.n = int(rng.integers(1, 6))
        self.reads = [int(rng.integers(0, i + 1)) for i in range(self.n)]  # (0: the input)
        self.skips = [bool(rng.random() < 0.7) for _ in range(self.n)]
        self.returned = [bool(rng.random() < 0.2) for _ in range(self.n)]
        self.ops = [rng.choice(["sin", "matmul", "both"]) for _ in range(self.n)]
        self.w = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

    def __call__(self, site, x, given):
        values, extra = [x], []
        for i in range(self.n):
            h = values[self.reads[i]]
            if self.ops[i] in ("sin", "both"):
                h = jnp.sin(h) + h
            if self.ops[i] in ("matmul", "both"):
                h = jnp.tanh(h @ self.w)
            if self.skips[i]:
                h = jax.lax.cond(site >= i, lambda h, g: g, lambda h, g: h, h, given[i])
            if self.returned[i]:
                extra.append(h)
            values.append(h)
        return values[-1], extra


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_compute_what_they_computed(seed):
    program = Chain(seed)
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(3, 4)), jnp.float32)
    given = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(program.n, 3, 4)), jnp.float32)
    for site in range(-1, program.n + 1):
        check(program, jnp.int32(site), x, given)


@pytest.mark.parametrize("layers", ["unrolled", "scan", "reversed scan"])
def test_a_sweep_with_reuse_runs_no_layer_outside_the_conds_that_skip_it(layers):
    """A model whose every layer has two sites (`mid`, `resid`), unrolled or stacked by a
    `scan` (its rows patched one at a time): with `reuse`, each layer's work is inside the
    `cond` of the site after it (in a scan, that row's), so a patch runs only what comes after
    it; without, every layer runs for every patch. (A `cond` batched by the chunk's `vmap`
    would be a select, its work outside.)"""
    from statax._patching import runs as sweep_runs
    from statax._patching import sweep as sweeping

    def block(h, w):
        h = stx.save_inter(jnp.sin(h) * 2, name="mid")
        return stx.save_inter(jnp.tanh(h @ w), name="resid")

    def model(x, ws):
        if layers == "unrolled":
            for w in ws:
                x = block(x, w)
            return x
        body = lambda h, w: (block(h, w), None)  # noqa: E731
        return jax.lax.scan(body, x, ws, reverse=layers == "reversed scan")[0]

    x, ws = jnp.ones((2, 3)), jnp.ones((4, 3, 3)) / 3
    runs = sweep_runs.Runs(model, lambda out: jnp.sum(out, axis=-1), None)
    _, (shapes, _) = runs.shapes((x, ws), None)
    keys = tuple(shapes)
    rows = layers != "unrolled"  # (each row of a stacked site is patched apart)
    plan = sweep_runs.Plan(
        "zero",
        0,
        0,
        keys,
        tuple((k, (("layer", 0),) if rows else ()) for k in keys),
        tuple((k, (4,) if rows else ()) for k in keys),
        tuple(range(len(keys))),
    )
    values = {k: jnp.ones(s.shape) for k, s in shapes.items()}
    program = sweeping._reuse_program(runs, plan)
    args = (jnp.int32(0), jnp.zeros((2,), jnp.int32), (x, ws), values, values)
    closed = jax.make_jaxpr(program)(*args)
    count = 4 if layers == "unrolled" else 1
    assert outside(closed, "tanh") == outside(closed, "sin") == count
    assert outside(sink(closed), "tanh") == outside(sink(closed), "sin") == 0
    for site in range(len(keys)):  # and it computes what it computed
        for chunk in ([0, 1], [2, 3], [3, 0]) if rows else ([0, 0],):
            args = (jnp.int32(site), jnp.asarray(chunk, jnp.int32), *args[2:])
            flat = jax.tree.leaves(args)
            np.testing.assert_allclose(
                jex.jaxpr_as_fun(sink(closed))(*flat)[0], jex.jaxpr_as_fun(closed)(*flat)[0]
            )


def test_a_sweeps_chunks_hold_one_row_of_a_site_a_scan_stacks():
    """With reuse, a site a scan stacks (`rows`: its loop axis, of its value's axes) is swept
    row by row: its patches sorted by row, and one row a chunk where a row's patches fill at
    least half of one; the other sites' patches in order."""
    from statax._patching import chunks
    from statax._patching.runs import Plan

    keys = ("emb", "resid")
    axes = (("emb", (("position", 1),)), ("resid", (("position", 2), ("layer", 0))))
    plan = Plan("zero", 0, 0, keys, axes, (("emb", (4,)), ("resid", (4, 3))), (0, 1))
    rows = {"resid": (0, 4)}  # (a scan's rows along axis 0 of a 4-axis value)
    assert chunks.size_of(plan, 8, True, False, None) == 8
    assert chunks.size_of(plan, 8, True, False, rows) == 4  # one row: the 4 positions
    assert chunks.size_of(plan, 16, True, False, rows) == 12  # (a row fills under half)
    assert chunks.size_of(plan, 8, True, True, rows) == 8  # (sharded: as asked)
    got = chunks.chunked(plan, 4, True, rows)
    assert got[0] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    for layer, chunk in enumerate(got[1:]):  # flat index = position * 3 + layer
        assert chunk == [(1, p * 3 + layer) for p in range(4)]
    assert chunks.chunked(plan, 5, False, None) == [
        [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)],
        [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5)],
        [(1, 6), (1, 7), (1, 8), (1, 9), (1, 10)],
        [(1, 11)],
    ]

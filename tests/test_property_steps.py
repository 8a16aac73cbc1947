"""Random programs with `while_loop`s of data-dependent trip counts inside (and around) `scan`,
`vmap`, `cond`, `jit`, `checkpoint`, `jvp` and `grad` (reverse mode, around code without a
`while_loop`, which JAX cannot reverse), pulled with `steps=`:
every iteration's values, the `.ran` masks, planting by row and by step, and the round trip,
against the same program run by hand in Python (its loops as Python loops, its `vmap` example
by example, its `cond` as an `if`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

N = 4  # rows a `while_loop` keeps: its trip count is the number of positive entries, 0 to 3
KINDS = ["op", "op", "while", "while", "scan", "vmap", "cond", "jit", "checkpoint", "jvp", "grad"]


def _tree(rng, depth=0, names=None, loops=True):
    """A random program: nested tuples `(kind, ...)`; each `op` marks its value, by its name.
    Reverse-mode `grad` holds no `while_loop` (JAX cannot reverse one of unknown length)."""
    names = [] if names is None else names
    kinds = [k for k in KINDS if loops or k != "while"]
    kind = rng.choice(kinds) if depth < 3 else "op"
    if kind == "op":
        names.append(f"m{len(names)}")
        return ("op", names[-1], rng.normal(size=3).astype(np.float32), rng.integers(3))
    loops = loops and kind != "grad"
    if kind == "cond":
        return ("cond", _tree(rng, depth + 1, names, loops), _tree(rng, depth + 1, names, loops))
    return (kind, _tree(rng, depth + 1, names, loops))


_FNS = [jnp.tanh, jnp.sin, jnp.cos]


def _program(tree):
    """The JAX function of `tree`."""
    kind = tree[0]
    if kind == "op":
        _, name, w, f = tree
        return lambda x: stx.save_inter(_FNS[f](x * w), name=name)
    inner = _program(tree[1])
    if kind == "while":

        def loop(x):
            t = jnp.sum(x > 0)
            return jax.lax.while_loop(
                lambda c: c[0] < t, lambda c: (c[0] + 1, 0.5 * inner(c[1]) + 0.1), (0, x)
            )[1]

        return loop
    if kind == "scan":
        return lambda x: jax.lax.scan(lambda c, _: (0.5 * inner(c) - 0.1, None), x, None, 2)[0]
    if kind == "vmap":
        return lambda x: jnp.mean(jax.vmap(inner)(jnp.stack([x, -x[::-1]])), 0)
    if kind == "cond":
        other = _program(tree[2])
        return lambda x: jax.lax.cond(jnp.sum(x) > 0, inner, other, x)
    if kind == "jit":
        return jax.jit(inner)
    if kind == "checkpoint":
        return jax.checkpoint(inner)
    if kind == "grad":
        return lambda x: jax.grad(lambda y: jnp.sum(inner(y)))(x) + 0.1 * x
    return lambda x: sum(jax.jvp(inner, (x,), (jnp.ones(3),)))  # "jvp": primal + tangent


def _axes(tree, outer=(), out=None):
    """Each mark's leading axes, outermost first: 2 per `scan` and `vmap`, `N` per `while`."""
    out = {} if out is None else out
    kind = tree[0]
    if kind == "op":
        out[tree[1]] = outer
        return out
    more = {"while": (N,), "scan": (2,), "vmap": (2,)}.get(kind, ())
    for sub in tree[1:]:
        if isinstance(sub, tuple):
            _axes(sub, outer + more, out)
    return out


def _by_hand(tree, x, record, planted, where=()):
    """`tree` run in Python: marks written to `record` (`{name: (values, ran)}`) at their row
    `where`; a planted value (rows, as `pull` returns them) read at its row instead."""
    kind = tree[0]
    if kind == "op":
        _, name, w, f = tree
        value = _FNS[f](x * w)
        if name in planted:
            value = planted[name](value, where)
        if record is not None:
            record[name][0][where] = value
            record[name][1][where] = True
        return value
    if kind == "while":
        t = int(jnp.sum(x > 0))
        for i in range(t):
            x = 0.5 * _by_hand(tree[1], x, record, planted, (*where, i)) + 0.1
        return x
    if kind == "scan":
        for i in range(2):
            x = 0.5 * _by_hand(tree[1], x, record, planted, (*where, i)) - 0.1
        return x
    if kind == "vmap":
        xs = [x, -x[::-1]]
        return sum(_by_hand(tree[1], xs[b], record, planted, (*where, b)) for b in range(2)) / 2
    if kind == "cond":
        return _by_hand(tree[1] if bool(jnp.sum(x) > 0) else tree[2], x, record, planted, where)
    if kind in ("jit", "checkpoint"):
        return _by_hand(tree[1], x, record, planted, where)
    # jvp, grad: marks recorded from the primal run; derivatives with the same planted values
    value = _by_hand(tree[1], x, record, planted, where)
    if kind == "grad":
        by_hand = lambda y: jnp.sum(_by_hand(tree[1], y, None, planted, where))  # noqa: E731
        return jax.grad(by_hand)(x) + 0.1 * x
    tangent = jax.jvp(lambda y: _by_hand(tree[1], y, None, planted, where), (x,), (jnp.ones(3),))
    return tangent[1] + value


def _recorded(tree, x, planted):
    record = {n: (np.zeros((*a, 3), np.float32), np.zeros(a, bool)) for n, a in _axes(tree).items()}
    out = _by_hand(tree, x, record, planted)
    inters = {f"{n}_0": v for n, (v, _) in record.items()}
    inters.update({f"{n}_0.ran": r for n, (_, r) in record.items()})
    return out, inters


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "seed", [0, 1, *(pytest.param(s, marks=pytest.mark.exhaustive) for s in range(2, 4))]
)
def test_random_programs_every_iteration_against_python_loops(seed):
    rng = np.random.default_rng(seed)
    for _ in range(4):
        tree = _tree(rng)
        f = _program(tree)
        x = jnp.asarray(rng.normal(size=3) + 0.3, jnp.float32)
        out, inters = stx.pull(f, steps=N, ran=True)(x)
        want_out, want = _recorded(tree, x, {})
        np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(out, f(x), rtol=2e-5, atol=2e-6)
        _assert_same(inters, want)
        # under `jit`, the same rows
        _, jitted = jax.jit(stx.pull(f, steps=N, ran=True))(x)
        _assert_same(jitted, want)
        values = {k: v for k, v in inters.items() if not k.endswith(".ran")}
        # the round trip: every row planted back reproduces the run (but for derivatives of a
        # planted value, a constant: zero, as `plant` documents)
        back = stx.plant(f, steps=N)(values, x)
        rows = {k[:-2]: (lambda v, w, k=k: values[k][w]) for k in values}
        np.testing.assert_allclose(back, _recorded(tree, x, rows)[0], rtol=2e-5, atol=2e-6)
        if "jvp" not in str(tree) and "grad" not in str(tree):
            np.testing.assert_allclose(back, f(x), rtol=2e-5, atol=2e-6)
        # planting by row: each row shifted, read by its own iteration
        shift = {k: v + 0.25 for k, v in values.items()}
        by_rows = {k[:-2]: (lambda v, w, k=k: shift[k][w]) for k in values}
        np.testing.assert_allclose(
            stx.plant(f, steps=N)(shift, x),
            _recorded(tree, x, by_rows)[0],
            rtol=2e-5,
            atol=2e-6,
        )
        # planting by step: a hook given the innermost loop's step (no `steps=` needed)
        hook = lambda v, step: v + 0.1 * step  # noqa: E731
        by_step = {k[:-2]: (lambda v, w: v + 0.1 * (w[-1] if w else 0)) for k in values}
        want_out = _recorded(tree, x, _innermost(tree, by_step))[0]
        for planted in (stx.plant(f), eqx.filter_jit(stx.plant(f))):
            got = planted({k[:-2]: hook for k in values}, x)
            np.testing.assert_allclose(got, want_out, rtol=2e-5, atol=2e-6)


def _innermost(tree, by_step):
    """`by_step` with each mark's step taken along its innermost loop axis (a `vmap` axis is
    not a loop's: the step is the loop's around it)."""
    loops = _loop_axes(tree)
    return {
        n: (
            lambda v, w, n=n: (
                v + 0.1 * next((w[i] for i in reversed(range(len(w))) if loops[n][i]), 0)
            )
        )
        for n in by_step
    }


def _loop_axes(tree, outer=(), out=None):
    """Per mark, for each leading axis, whether a loop (not a `vmap`) made it."""
    out = {} if out is None else out
    if tree[0] == "op":
        out[tree[1]] = outer
        return out
    more = {"while": (True,), "scan": (True,), "vmap": (False,)}.get(tree[0], ())
    for sub in tree[1:]:
        if isinstance(sub, tuple):
            _loop_axes(sub, outer + more, out)
    return out

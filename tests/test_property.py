"""Random nestings of jit, vmap, grad, scan, cond, while and checkpoint around bodies that save
one to three values: `pull` against a hand-threaded reference that returns them explicitly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax import lax

import statax as stx
from statax.testing import assert_tree_allclose

OPS = {
    "sin": jnp.sin,
    "tanh": jnp.tanh,
    "double": lambda x: x * 2,
    "shift": lambda x: x + 1,
}
X = jnp.array([0.3, -0.5, 0.8])

# ---- programs -------------------------------------------------------------------------------

leaves = st.tuples(
    st.just("leaf"),
    st.lists(
        st.tuples(st.sampled_from("ab"), st.sampled_from(sorted(OPS))), min_size=1, max_size=3
    ).map(tuple),
)


def _extend(children):
    wrappers = st.tuples(st.sampled_from(["jit", "checkpoint", "vmap", "grad"]), children)
    return st.one_of(
        wrappers,
        wrappers,
        st.tuples(st.just("scan"), children, st.integers(1, 3)),
        st.tuples(st.just("while"), children, st.integers(0, 2)),
        st.tuples(st.just("cond"), children, children),
    )


programs = st.recursive(leaves, _extend, max_leaves=4)


def _has_while(node):
    return node[0] == "while" or any(isinstance(c, tuple) and _has_while(c) for c in node[1:])


def _valid(node):
    # JAX cannot reverse-differentiate a while loop.
    if node[0] == "grad" and _has_while(node[1]):
        return False
    return all(_valid(c) for c in node[1:] if isinstance(c, tuple) and c and c[0] in KINDS)


LEAF = ("leaf", (("a", "sin"), ("b", "double"), ("a", "tanh")))
KINDS = {"leaf", "jit", "checkpoint", "vmap", "grad", "scan", "while", "cond"}


def build(node):
    """The program, with `save_inter`s."""
    kind = node[0]
    if kind == "leaf":
        ops = node[1]

        def leaf(x):
            for name, op in ops:
                x = x + 0.1 * stx.save_inter(OPS[op](x), name=name)
            return jnp.tanh(x)

        return leaf
    child = build(node[1])
    if kind == "jit":
        return jax.jit(child)
    if kind == "checkpoint":
        return jax.checkpoint(child)
    if kind == "vmap":
        return lambda x: jnp.mean(jax.vmap(child)(jnp.stack([x, x * 0.5 - 0.1])), axis=0)
    if kind == "grad":
        return lambda x: jax.grad(lambda y: jnp.sum(child(y)))(x)
    if kind == "scan":
        return lambda x: lax.scan(lambda c, _: (child(c), None), x, None, length=node[2])[0]
    if kind == "while":
        n = node[2]
        return lambda x: lax.while_loop(
            lambda s: s[0] < n, lambda s: (s[0] + 1, child(s[1])), (0, x)
        )[1]
    other = build(node[2])
    return lambda x: lax.cond(jnp.sum(x) > 0, child, other, x)


# ---- the hand-threaded reference --------------------------------------------------------------


class Mismatch(Exception):
    pass


def slots(node):
    """The names of the intermediates, in order (statax's cond slot order)."""
    if node[0] == "leaf":
        return [name for name, _ in node[1]]
    if node[0] == "cond":
        return [name for name, _ in _merge(slots(node[2]), slots(node[1]))]
    return slots(node[1])


def _keys(names):
    counts, keys = {}, []
    for name in names:
        keys.append((name, counts.get(name, 0)))
        counts[name] = counts.get(name, 0) + 1
    return keys


def _merge(false_names, true_names):
    merged = list(_keys(false_names))
    merged += [k for k in _keys(true_names) if k not in merged]
    return merged


def reference(node):
    """`x -> (out, [values in slot order])`, with no `save_inter` anywhere."""
    kind = node[0]
    if kind == "leaf":

        def leaf(x):
            values = []
            for _, op in node[1]:
                values.append(OPS[op](x))
                x = x + 0.1 * values[-1]
            return jnp.tanh(x), values

        return leaf
    child = reference(node[1])
    if kind in ("jit", "checkpoint"):
        return child
    if kind == "vmap":

        def vmapped(x):
            out, values = jax.vmap(child)(jnp.stack([x, x * 0.5 - 0.1]))
            return jnp.mean(out, axis=0), values

        return vmapped
    if kind == "grad":
        return lambda x: jax.grad(lambda y: (jnp.sum(child(y)[0]), child(y)[1]), has_aux=True)(x)
    if kind == "scan":

        def scanned(x):
            history = []
            for _ in range(node[2]):
                x, values = child(x)
                history.append(values)
            return x, [jnp.stack(v) for v in zip(*history)]

        return scanned
    if kind == "while":

        def looped(x):
            _, last = jax.eval_shape(child, x)
            last = [jnp.zeros(v.shape, v.dtype) for v in last]
            for _ in range(node[2]):
                x, last = child(x)
            return x, last

        return looped
    other = reference(node[2])

    def branched(x):
        pred = jnp.sum(x) > 0
        (a_out, a_vals), (b_out, b_vals) = child(x), other(x)
        a = dict(zip(_keys(slots(node[1])), a_vals))
        b = dict(zip(_keys(slots(node[2])), b_vals))
        values = []
        for key in _merge(slots(node[2]), slots(node[1])):
            if key in a and key in b and a[key].shape != b[key].shape:
                raise Mismatch
            like = a.get(key, b.get(key))
            values.append(
                jnp.where(pred, a.get(key, jnp.zeros_like(like)), b.get(key, jnp.zeros_like(like)))
            )
        return jnp.where(pred, a_out, b_out), values

    return branched


def named(names, values):
    counts, out = {}, {}
    for name, value in zip(names, values):
        n = counts.get(name, 0)
        counts[name] = n + 1
        out[f"{name}_{n}"] = value
    return out


def sized(check, strategy, examples, quick: int, at_size: int):
    """Two tests of `check(program)` on random programs from `strategy`, derandomized: `quick`
    programs and the `examples` in the README's test command, `at_size` in the runs at size
    (`-m exhaustive`)."""

    def test(n):
        run = given(strategy)(check)
        for program in examples:
            run = example(program)(run)
        return settings(
            max_examples=n,
            derandomize=True,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )(run)

    return test(quick), pytest.mark.exhaustive(test(at_size))


PULL_EXAMPLES = [
    ("vmap", ("cond", ("scan", ("jit", LEAF), 2), LEAF)),  # jit in scan in cond in vmap
    ("while", ("scan", LEAF, 2), 2),  # scan in while
    ("grad", ("scan", ("checkpoint", LEAF), 3)),  # scan over rematerialised layers
    ("vmap", ("while", ("cond", LEAF, ("vmap", LEAF)), 1)),
    ("checkpoint", ("grad", ("vmap", ("cond", LEAF, LEAF)))),
]


def check_pull_matches_hand_threaded_reference(program):
    f, ref, names = build(program), reference(program), slots(program)
    try:
        ref_out, ref_values = ref(X)
    except Mismatch:
        with pytest.raises(stx.BranchMismatchError):
            stx.pull(f)(X)
        return
    expected = (ref_out, named(names, ref_values))

    out, inters = stx.pull(f)(X)
    assert_tree_allclose((out, inters), expected, rtol=1e-4, atol=1e-5)
    assert list(inters) == list(expected[1])  # program order
    assert_tree_allclose(jax.jit(stx.pull(f))(X), expected, rtol=1e-4, atol=1e-5)

    xs = jnp.stack([X, -X])
    batched_out, batched_values = jax.vmap(ref)(xs)
    batched = (batched_out, named(names, batched_values))
    assert_tree_allclose(stx.pull(jax.vmap(f))(xs), batched, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(jax.vmap(stx.pull(f))(xs), batched, rtol=1e-4, atol=1e-5)


def _round_trippable(node):
    # Under an inner grad a planted value is a constant, so derivatives through it vanish; in a
    # while loop one value is planted in every iteration. Elsewhere the round trip is exact.
    if node[0] == "grad" or (node[0] == "while" and node[2] > 1):
        return False
    return all(
        _round_trippable(c) for c in node[1:] if isinstance(c, tuple) and c and c[0] in KINDS
    )


def check_plant_round_trip(program):
    """Planting every value that pull returns gives back the function's own output: exactly,
    eagerly; under `jit`, to the last bit on CPU, and within a rounding on GPU, where XLA fuses
    the planted program (its values come in) and the function's own differently."""
    f = build(program)
    try:
        out, inters = stx.pull(f)(X)
    except stx.BranchMismatchError:
        return
    np.testing.assert_array_equal(stx.plant(f)(inters, X), f(X))
    jitted, own = jax.jit(stx.plant(f))(inters, X), jax.jit(f)(X)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(jitted, own)
    else:
        np.testing.assert_allclose(jitted, own, rtol=1e-6, atol=1e-7)


test_pull_matches_hand_threaded_reference, test_pull_matches_at_size = sized(
    check_pull_matches_hand_threaded_reference,
    programs.filter(_valid),
    PULL_EXAMPLES,
    quick=3,
    at_size=40,
)
test_plant_round_trip, test_plant_round_trip_at_size = sized(
    check_plant_round_trip,
    programs.filter(_valid).filter(_round_trippable),
    [
        ("vmap", ("cond", ("scan", ("jit", LEAF), 2), LEAF)),
        ("while", ("scan", LEAF, 2), 1),
        ("scan", ("checkpoint", ("vmap", LEAF)), 3),
    ],
    quick=2,
    at_size=15,
)

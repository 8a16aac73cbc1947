"""The composition matrix: `pull`, `plant` and `stateful`, alone and together, over every
construct, under `jit`, `vmap` and `grad` applied inside and outside, with the fast paths on
and off, against the same programs written by hand.

Every construct marks a value `h` and, given `state=True`, adds `sum(h)` to the state `s`.
Its reference returns, by hand, the output, the marks `pull` returns and the final `s`, with
`h` scaled by `scale` (what the plant below does to it). A transformation applied inside
(`pull(jit(f))`) and the same applied outside (`jit(pull(f))`) must give the reference under
that transformation: values compared numerically, keys exactly.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import statax as stx
from statax._core import fastpaths as _fastpaths
from statax.testing import assert_tree_allclose

X = jnp.array([0.3, -0.5, 0.8, 0.1])
XS = jnp.stack([X, X * 2.0 - 0.2])
HALF = 0.5
HOOK = {"h": lambda v: v * HALF}  # plant: every occurrence of h, halved


def mark(h, state):
    h = stx.save_inter(h, name="h")
    if state:
        s = stx.get_state("s", init=lambda: jnp.zeros((), jnp.float32))
        stx.set_state(s + jnp.sum(h), "s")
    return h


# ---- constructs and their references: ref(x, scale) -> (out, marks, s) -----------------------


def line(x, state):
    return jnp.cos(mark(jnp.sin(x), state)) * 2.0


def line_ref(x, scale):
    h = jnp.sin(x)
    return jnp.cos(h * scale) * 2.0, {"h_0": h}, jnp.sum(h * scale)


def in_jit(x, state):
    return jax.jit(lambda x: line(x, state))(x)


def scanned(x, state):
    def body(c, a):
        return mark(jnp.sin(c) + a, state), None

    return lax.scan(body, x, jnp.arange(2.0))[0]


def scanned_ref(x, scale):
    c, hs, s = x, [], 0.0
    for a in range(2):
        h = jnp.sin(c) + a
        hs.append(h)
        c = h * scale
        s = s + jnp.sum(c)
    return c, {"h_0": jnp.stack(hs)}, s


def while_loop(x, state):
    def body(carry):
        i, c = carry
        return i + 1, mark(jnp.sin(c) + 1.0, state)

    return lax.while_loop(lambda carry: carry[0] < 2, body, (0, x))[1]


def while_ref(x, scale):
    c, s = x, 0.0
    for _ in range(2):
        h = jnp.sin(c) + 1.0
        c = h * scale
        s = s + jnp.sum(c)
    return c, {"h_0": h}, s  # the last iteration's value


def equinox_loop(x, state):
    def body(carry):
        i, c = carry
        return i + 1, mark(jnp.sin(c) + 1.0, state)

    cond = lambda carry: carry[0] < 2  # noqa: E731
    return eqx.internal.while_loop(cond, body, (0, x), max_steps=4, kind="checkpointed")[1]


def branch(x, state):
    take = jnp.float32(1.0) > 0  # one predicate for every example
    if state:  # a value before the cond, for the branch that does not set it
        stx.set_state(stx.get_state("s", init=lambda: jnp.zeros((), jnp.float32)), "s")
    return lax.cond(take, lambda v: mark(jnp.sin(v), state) * 3.0, lambda v: v, x)


def branch_ref(x, scale):
    h = jnp.sin(x)
    return h * scale * 3.0, {"h_0": h}, jnp.sum(h * scale)


def checkpointed(x, state):
    return jax.checkpoint(lambda x: line(x, state))(x)


def with_custom_jvp(x, state):
    @jax.custom_jvp
    def f(x):
        return line(x, state)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), -jnp.sin(jnp.sin(x)) * jnp.cos(x) * 2.0 * t

    return f(x)


def with_custom_vjp(x, state):
    @jax.custom_vjp
    def f(x):
        return line(x, state)

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (-jnp.sin(jnp.sin(x)) * jnp.cos(x) * 2.0 * g,)

    f.defvjp(fwd, bwd)
    return f(x)


def sharded(x, state):
    mesh = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda x: line(x, state), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return f(x)


def sharded_ref(x, scale):
    out, marks, _ = line_ref(x, scale)
    h = marks["h_0"]
    return out, {"h_0": h.reshape(4, 1)}, h * scale  # one row per shard


CONSTRUCTS = {
    "line": (line, line_ref, True),
    "jit": (in_jit, line_ref, True),
    "scan": (scanned, scanned_ref, True),
    "while": (while_loop, while_ref, False),  # JAX's reverse mode refuses a while loop
    "equinox_loop": (equinox_loop, while_ref, True),
    "cond": (branch, branch_ref, True),
    "checkpoint": (checkpointed, line_ref, True),
    "custom_jvp": (with_custom_jvp, line_ref, True),
    "custom_vjp": (with_custom_vjp, line_ref, True),
    "shard_map": (sharded, sharded_ref, True),
}


# ---- compositions: run(F)(x) -> (out, aux), and the same by hand from a reference -----------


def _pull(f):
    return lambda x: (lambda out, marks: (out, {"marks": marks}))(*stx.pull(f)(x))


def _plant(f):
    return lambda x: (stx.plant(f)(HOOK, x), {})


def _stateful(f):
    return lambda x: (lambda out, state: (out, {"state": state}))(*stx.stateful(f)(x))


def _pull_stateful(f):
    def run(x):
        (out, state), marks = stx.pull(stx.stateful(f))(x)
        return out, {"marks": marks, "state": state}

    return run


def _stateful_pull(f):
    def run(x):
        (out, marks), state = stx.stateful(stx.pull(f))(x)
        return out, {"marks": marks, "state": state}

    return run


# name -> (run, uses state, what the reference returns of (marks, state), scale)
COMPOSITIONS = {
    "pull": (_pull, False, ("marks",), 1.0),
    "plant": (_plant, False, (), HALF),
    "stateful": (_stateful, True, ("state",), 1.0),
    "pull_stateful": (_pull_stateful, True, ("marks", "state"), 1.0),
    "stateful_pull": (_stateful_pull, True, ("marks", "state"), 1.0),
}


def expected_of(ref, parts, scale):
    def run(x):
        out, marks, s = ref(x, scale)
        aux = {}
        if "marks" in parts:
            aux["marks"] = marks
        if "state" in parts:
            aux["state"] = {"s": s}
        return out, aux

    return run


def total(run):
    """`run` as a scalar function with its aux, for `grad(..., has_aux=True)`."""
    return lambda x: (lambda out, aux: (jnp.sum(out), aux))(*run(x))


# Corners JAX itself refuses.
_AS_WRITTEN = (
    "differentiated as written (a planted or stateful custom-derivative function), JAX refuses "
    "reverse mode through the while loop inside equinox's checkpointed loop"
)
REFUSED = {
    ("equinox_loop", "state", "grad_out"): _AS_WRITTEN,
    ("equinox_loop", "plant", "grad_out"): _AS_WRITTEN,
}
# plant(grad(f)) of a custom_jvp/custom_vjp function: `grad` has put the rule in place of the
# function's derivative before `plant` sees the program, so the planted value changes the
# primal and the derivative is the rule's, at the input: the unplanted function's derivative
# (grad(plant(f)) differentiates the planted function as written).
RULE_GOVERNS = {("custom_jvp", "plant", "grad_in"), ("custom_vjp", "plant", "grad_in")}

TRANSFORMS = ["plain", "jit_in", "jit_out", "vmap_in", "vmap_out", "grad_in", "grad_out"]


def apply(transform, compose, f):
    """`compose(f)` with `transform` inside or outside, and its input."""
    if transform == "plain":
        return compose(f), X
    kind, where = transform.split("_")
    if kind == "jit":
        return (compose(jax.jit(f)) if where == "in" else jax.jit(compose(f))), X
    if kind == "vmap":
        return (compose(jax.vmap(f)) if where == "in" else jax.vmap(compose(f))), XS
    if where == "in":
        return compose(jax.grad(lambda x: jnp.sum(f(x)))), X
    return jax.grad(total(compose(f)), has_aux=True), X


def reference(transform, ref_run, construct=None, parts=()):
    if construct == "equinox_loop" and transform == "grad_in":
        # Under grad(f) equinox's checkpointed loop recomputes its iterations in its backward
        # pass, last to first: that ran (see the semantics page). Their marks come back too, as
        # a while loop's, the last one run: the first iteration's, by hand; and their sets are
        # threaded, each adding its h to the sum once more.
        value, aux = reference(transform, ref_run)
        if "marks" in parts:
            aux = dict(aux, marks=dict(aux["marks"], h_1=jnp.sin(X) + 1.0))
        if "state" in parts:
            aux = dict(aux, state={"s": 2.0 * aux["state"]["s"]})
        return value, aux
    if transform.startswith("vmap"):
        return jax.vmap(ref_run)(XS)
    if transform.startswith("grad"):
        return jax.grad(total(ref_run), has_aux=True)(X)
    return ref_run(X)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("construct", CONSTRUCTS)
def test_composition_matrix(construct, composition, transform, fast):
    body, ref, differentiable = CONSTRUCTS[construct]
    if transform.startswith("grad") and not differentiable:
        pytest.skip("JAX cannot differentiate this construct in reverse mode")
    compose, state, parts, scale = COMPOSITIONS[composition]
    refused = REFUSED.get((construct, composition if composition in ("pull", "plant") else "state",
                           transform))  # fmt: skip
    if refused is not None:
        pytest.skip(refused)
    f = lambda x: body(x, state)  # noqa: E731
    with _fastpaths.enabled(fast):
        run, x = apply(transform, compose, f)
        got = run(x)
    if (construct, composition, transform) in RULE_GOVERNS:
        scale = 1.0
    want = reference(transform, expected_of(ref, parts, scale), construct, parts)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_switch_turns_the_fast_paths_off():
    # The plain paths do run where the switch is off: an unpulled mark is an identity with
    # outputs, where the fast path stages one that only reads.
    with _fastpaths.enabled(False):
        (eqn,) = jax.make_jaxpr(lambda x: stx.save_inter(x, name="h"))(X).eqns
        assert eqn.params["status"] == "unpulled" and len(eqn.outvars) == 1
    if _fastpaths.MISSING is None:
        with _fastpaths.enabled(True):
            (eqn,) = jax.make_jaxpr(lambda x: stx.save_inter(x, name="h"))(X).eqns
            assert eqn.params["status"] == "idle" and eqn.outvars == []


def test_a_missing_jax_internal_turns_the_fast_paths_off_and_changes_nothing(monkeypatch):
    from jax._src.interpreters import partial_eval as pe

    monkeypatch.setattr(_fastpaths, "REQUIRED", [*_fastpaths.REQUIRED, (pe, "NoSuchInternal")])
    reason = _fastpaths.probe()
    assert reason == "partial_eval.NoSuchInternal is missing" or "NoSuchInternal" in reason
    monkeypatch.setattr(_fastpaths, "MISSING", reason)
    with _fastpaths.enabled(True):  # asked for, but not there: off
        assert not _fastpaths.on
        for name, (body, ref, _) in CONSTRUCTS.items():
            out, marks = stx.pull(jax.jit(lambda x: body(x, False)))(X)  # noqa: B023
            want_out, want_marks, _ = ref(X, 1.0)
            assert_tree_allclose((out, marks), (want_out, want_marks), rtol=1e-5, atol=1e-6)

"""The composition matrix: `pull`, `plant` and `stateful`, alone and together, with marks
written by hand and with selections (`at=`: scopes, primitives, lines, modules) and `reduce=`,
over every construct, under `jit`, `vmap` and `grad` applied inside and outside, with the fast
paths on and off, against the same programs written by hand.

Every construct marks a value `h` and, given `state=True`, adds `sum(h)` to the state `s`.
Its reference returns, by hand, the output, the marks `pull` returns and the final `s`, with
`h` scaled by `scale` (what the plant below does to it). A transformation applied inside
(`pull(jit(f))`) and the same applied outside (`jit(pull(f))`) must give the reference under
that transformation: values compared numerically, keys exactly.

Under a selection, `mark` writes no `save_inter`: it calls a module (`MARKER`) whose call is a
named scope `h` holding one `reduce_precision` (an identity for float32) on one line, which
each kind of selection selects, and the keys are the selection's. Where a selection of a
place in the program cannot reach (a transformation applied inside, a `shard_map`, Python
functions a primitive runs), the case checks the error (`selection_refused`).
"""

import functools
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import statax as stx
from statax._core import fastpaths as _fastpaths
from statax.extend import HI_PRIMITIVE
from statax.testing import assert_tree_allclose

X = jnp.array([0.3, -0.5, 0.8, 0.1])
XS = jnp.stack([X, X * 2.0 - 0.2])
HALF = 0.5
HOOK = {"h": lambda v: v * HALF}  # plant: every occurrence of h, halved


class Marker(eqx.Module):
    def __call__(self, h):
        with jax.named_scope("h"):
            return lax.reduce_precision(h, exponent_bits=8, mantissa_bits=23)  # the line


class Holder(eqx.Module):
    marker: Marker


HOLDER = Holder(Marker())
LINE = f"test_composition.py:{inspect.getsourcelines(Marker.__call__)[1] + 2}"
SELECTING = [False]  # while a selection composition runs: mark by the selected places
REDUCE = [None]  # the reduce= of the marks, while `pull_sum` runs


def mark(h, state):
    h = HOLDER.marker(h) if SELECTING[0] else stx.save_inter(h, name="h", reduce=REDUCE[0])
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


def solved(x, state):
    def solve(matvec, b):
        return mark(b * 0.5, state)

    return lax.custom_linear_solve(lambda v: 2.0 * v, x, solve, symmetric=True)


def halved_ref(x, scale):
    h = x * 0.5
    return h * scale, {"h_0": h}, jnp.sum(h * scale)


def rooted(x, state):  # a hijax primitive in JAX 0.11+, custom derivatives before
    def solve(f, y):
        return mark(y * 0.5, state)

    return lax.custom_root(lambda y: 2.0 * y - x, x, solve, lambda g, y: y / 2.0)


def lineax_solved(x, state):  # an equinox filter primitive, running the operator's matvec
    import lineax as lx

    struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
    op = lx.FunctionLinearOperator(lambda v: mark(2.0 * v, state), struct, lx.diagonal_tag)
    return lx.linear_solve(op, x, lx.Diagonal()).value


def _lineax_too_old() -> str | None:
    import lineax as lx

    if tuple(map(int, lx.__version__.split(".")[:3])) < (0, 1, 1):
        # lineax 0.1.0 (the newest for JAX 0.8) takes the diagonal of the whole matrix, which
        # it materialises: its matvec runs on every basis vector, not once.
        return "lineax < 0.1.1 runs the matvec on every basis vector"
    return None


def lineax_ref(x, scale):
    h = jnp.full_like(x, 2.0)  # the diagonal solver's one matvec, of ones: the diagonal
    return x / (h * scale), {"h_0": h}, jnp.sum(h * scale)


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
    "linear_solve": (solved, halved_ref, True),
    "hijax": (rooted, halved_ref, True),
    "equinox_primitive": (lineax_solved, lineax_ref, True),
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


def _selecting(run):
    """`run` with `mark` marking by the places the selections select."""

    def selecting(x):
        SELECTING[0] = True
        try:
            return run(x)
        finally:
            SELECTING[0] = False

    return selecting


def _pull_at(at):
    def compose(f):
        return _selecting(lambda x: (lambda out, m: (out, {"marks": m}))(*stx.pull(f, at=at)(x)))

    return compose


def _plant_at(at):
    def compose(f, key="h"):
        return _selecting(lambda x: (stx.plant(f, at=at)({key: HOOK["h"]}, x), {}))

    return compose


def _pull_stateful_at(at):
    def compose(f):
        def run(x):
            (out, state), marks = stx.pull(stx.stateful(f), at=at)(x)
            return out, {"marks": marks, "state": state}

        return _selecting(run)

    return compose


def _stateful_pull_at(at):
    def compose(f):
        def run(x):
            (out, marks), state = stx.stateful(stx.pull(f, at=at))(x)
            return out, {"marks": marks, "state": state}

        return _selecting(run)

    return compose


def _pull_summed(f):  # every occurrence of h folded into one: save_inter's reduce="sum"
    def run(x):
        REDUCE[0] = "sum"
        try:
            out, marks = stx.pull(f)(x)
        finally:
            REDUCE[0] = None
        return out, {"marks": marks}

    return run


SCOPES = stx.scopes("*h")  # (equinox's checkpointed loop runs its body in a scope of its own)
# The key a selection of the scope gives, where it is not "h"
SCOPE_KEYS = {"equinox_loop": "checkpointed-no-vjp/h"}
# name -> (run, uses state, what the reference returns of (marks, state), scale, keys' name)
COMPOSITIONS = {
    "pull": (_pull, False, ("marks",), 1.0, "h"),
    "plant": (_plant, False, (), HALF, "h"),
    "stateful": (_stateful, True, ("state",), 1.0, "h"),
    "pull_stateful": (_pull_stateful, True, ("marks", "state"), 1.0, "h"),
    "stateful_pull": (_stateful_pull, True, ("marks", "state"), 1.0, "h"),
    "pull_sum": (_pull_summed, False, ("summed",), 1.0, "h"),
    "pull_scopes": (_pull_at(SCOPES), False, ("marks",), 1.0, "h"),
    "pull_primitives": (
        _pull_at(stx.primitives("reduce_precision")),
        False,
        ("marks",),
        1.0,
        "reduce_precision",
    ),
    "pull_lines": (_pull_at(stx.lines(LINE)), False, ("marks",), 1.0, LINE),
    "pull_modules": (_pull_at(stx.modules("marker", of=HOLDER)), False, ("marks",), 1.0, "marker"),
    "plant_scopes": (_plant_at(SCOPES), False, (), HALF, "h"),
    "pull_stateful_scopes": (_pull_stateful_at(SCOPES), True, ("marks", "state"), 1.0, "h"),
    "stateful_pull_scopes": (_stateful_pull_at(SCOPES), True, ("marks", "state"), 1.0, "h"),
}


def _iterated(x):
    """Both iterations' h of `while_loop` and `equinox_loop` (their reference keeps the last)."""
    h1 = jnp.sin(x) + 1.0
    return [h1, jnp.sin(h1) + 1.0]


# construct -> the sum of every occurrence of h, from x and the reference's marks (reduce="sum")
SUMMED = {
    "scan": lambda x, marks: jnp.sum(marks["h_0"], axis=0),
    "while": lambda x, marks: sum(_iterated(x)),
    "equinox_loop": lambda x, marks: sum(_iterated(x)),
    "shard_map": lambda x, marks: jnp.sum(marks["h_0"], axis=0),  # over the shards' rows
}


def expected_of(ref, parts, scale, name="h", construct=None):
    def run(x):
        out, marks, s = ref(x, scale)
        marks = {name + key[1:]: value for key, value in marks.items()}  # "h_0" -> name_0
        aux = {}
        if "summed" in parts:
            total = SUMMED.get(construct, lambda x, marks: marks["h_0"])(x, marks)
            aux["marks"] = {"h": total}
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
RULE_GOVERNS = {
    ("custom_jvp", "plant", "grad_in"),
    ("custom_vjp", "plant", "grad_in"),
    ("hijax", "plant", "grad_in"),  # (`lax.custom_root`: its rule is the derivative)
}
# A mark whose value does not depend on the batch stays unbatched under an inner vmap (see
# the semantics page): the diagonal solver's matvec of ones.
UNBATCHED = {"equinox_primitive"}

# Selections of places in the program (not of modules, which mark where they run) are an
# error, which says what to do, where the program is already transformed around the place (a
# vmap or grad applied inside the pulled function), and where the place is inside Python
# functions a primitive runs (an equinox filter primitive's) or in an object's params (a hijax
# primitive's), which no jaxpr in the program shows.
PROGRAM_LEVEL = {
    "pull_scopes",
    "pull_primitives",
    "pull_lines",
    "plant_scopes",
    "pull_stateful_scopes",
    "stateful_pull_scopes",
}


@functools.cache
def _root_is_hijax() -> bool:
    """Whether `lax.custom_root` is a hijax primitive here (JAX 0.11+; custom derivatives
    before, which selections reach into)."""
    eqns = jax.make_jaxpr(lambda x: rooted(x, False))(X).eqns
    return HI_PRIMITIVE is not None and any(e.primitive is HI_PRIMITIVE for e in eqns)


def selection_refused(construct, composition, transform) -> str | None:
    """The error a selection gives, as a pattern, or `None`."""
    if composition not in PROGRAM_LEVEL:
        return None
    # Where `stateful` threads state through a primitive that runs Python functions or an
    # expansion of its own, it runs them as a call: a selection sees inside.
    threaded = composition == "pull_stateful_scopes"
    if construct == "hijax" and _root_is_hijax() and not threaded:
        return "no (scope|primitive|line) .* in the program"
    if construct == "shard_map":  # its body is traced only inside its mesh's axes
        return "inside `shard_map`.*does not reach into"
    if transform in ("vmap_in", "grad_in"):
        return "applied inside it"
    if construct == "equinox_primitive" and not threaded:  # Python functions it runs
        return "inside `linear_solve`.*does not reach into"
    return None


EXHAUSTIVE = pytest.mark.exhaustive
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


def reference(transform, ref_run, construct=None, parts=(), name="h"):
    if construct == "equinox_loop" and transform == "grad_in":
        # Under grad(f) equinox's checkpointed loop recomputes its iterations in its backward
        # pass, last to first: that ran (see the semantics page). Their marks come back too, as
        # a while loop's, the last one run: the first iteration's, by hand; and their sets are
        # threaded, each adding its h to the sum once more.
        value, aux = reference(transform, ref_run)
        if "marks" in parts:
            aux = dict(aux, marks={**aux["marks"], f"{name}_1": jnp.sin(X) + 1.0})
        if "summed" in parts:  # every iteration again
            aux = dict(aux, marks={"h": 2.0 * aux["marks"]["h"]})
        if "state" in parts:
            aux = dict(aux, state={"s": 2.0 * aux["state"]["s"]})
        return value, aux
    if construct == "linear_solve" and transform == "grad_in":
        # Under grad(f) the solve's derivative rule runs the transposed solve (`symmetric`:
        # the solve itself) on the cotangent, ones, in the backward pass: that ran, so its mark
        # comes back and its set adds its sum, as for equinox's checkpointed loop.
        value, aux = reference(transform, ref_run)
        if "marks" in parts:
            aux = dict(aux, marks={**aux["marks"], f"{name}_1": jnp.full_like(X, 0.5)})
        if "summed" in parts:
            aux = dict(aux, marks={"h": aux["marks"]["h"] + 0.5})
        if "state" in parts:
            aux = dict(aux, state={"s": aux["state"]["s"] + 0.5 * X.size})
        return value, aux
    if construct in UNBATCHED and transform == "vmap_in" and {"marks", "summed"} & set(parts):
        value, aux = jax.vmap(ref_run)(XS)
        return value, dict(aux, marks=jax.tree.map(lambda m: m[0], aux["marks"]))
    if transform.startswith("vmap"):
        return jax.vmap(ref_run)(XS)
    if transform.startswith("grad"):
        return jax.grad(total(ref_run), has_aux=True)(X)
    return ref_run(X)


# Both ways: the fast paths on, and (at size) off.
@pytest.mark.parametrize(
    "fast", [pytest.param(True, id="fast"), pytest.param(False, id="plain", marks=EXHAUSTIVE)]
)
# Each transformation inside and outside; the README's test command runs one of each pair
# (and `plain`), the runs at size the other too.
@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(t, marks=EXHAUSTIVE) if t in ("jit_out", "vmap_in", "grad_out") else t
        for t in TRANSFORMS
    ],
)
@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("construct", CONSTRUCTS)
def test_composition_matrix(construct, composition, transform, fast):
    body, ref, differentiable = CONSTRUCTS[construct]
    if transform.startswith("grad") and not differentiable:
        pytest.skip("JAX cannot differentiate this construct in reverse mode")
    compose, state, parts, scale, name = COMPOSITIONS[composition]
    refused = REFUSED.get((construct, composition if composition in ("pull", "plant") else "state",
                           transform))  # fmt: skip
    if refused is not None:
        pytest.skip(refused)
    if construct == "equinox_primitive" and _lineax_too_old():
        pytest.skip(_lineax_too_old())
    if composition == "plant_scopes":  # the scope's key, as the hook's
        compose = functools.partial(compose, key=SCOPE_KEYS.get(construct, "h"))
    f = lambda x: body(x, state)  # noqa: E731
    error = selection_refused(construct, composition, transform)
    with _fastpaths.enabled(fast):
        run, x = apply(transform, compose, f)
        if error is not None:
            with pytest.raises(stx.SelectionError, match=error):
                run(x)
            return
        got = run(x)
    if (construct, composition, transform) in RULE_GOVERNS:
        scale = 1.0
    if composition in (
        "pull_scopes",
        "plant_scopes",
        "pull_stateful_scopes",
        "stateful_pull_scopes",
    ):
        name = SCOPE_KEYS.get(construct, name)
    run_ref = expected_of(ref, parts, scale, name, construct)
    want = reference(transform, run_ref, construct, parts, name)
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
            if name == "equinox_primitive" and _lineax_too_old():
                continue
            out, marks = stx.pull(jax.jit(lambda x: body(x, False)))(X)  # noqa: B023
            want_out, want_marks, _ = ref(X, 1.0)
            assert_tree_allclose((out, marks), (want_out, want_marks), rtol=1e-5, atol=1e-6)

"""Selections (`at=`): marks where none were written, checked against the same models with the
marks written by hand (keys exactly, values numerically), under `jit`, `grad`, `vmap` and
`scan` in both orders, with the real libraries."""

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statax as stx
from statax.testing import assert_tree_allclose

X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)  # two examples of width 4
XS = jnp.stack([X, X * 0.5 - 0.1, -X])  # three steps (scan) or three batches (vmap)


# ---- three models, each as its library writes one, and the same with marks by hand ----------


class LinenBlock(nn.Module):
    marked: bool = False

    @nn.compact
    def __call__(self, x):
        y = x + nn.gelu(nn.Dense(4)(nn.LayerNorm()(x)))
        if self.marked:  # what stx.scopes("Model/Block_*") selects: the block's output
            y = stx.save_inter(y, name="Model/" + "/".join(self.scope.path))
        return y


class Model(nn.Module):  # (named Model: its scope path starts "Model/")
    marked: bool = False

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = LinenBlock(self.marked, name=f"Block_{i}")(x)
        return nn.Dense(2)(x)


LINEN = Model()
LINEN_PARAMS = LINEN.init(jax.random.PRNGKey(0), X)


class EqxBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    lin: eqx.nn.Linear
    name: str = eqx.field(static=True, default="")

    def __init__(self, key, name=""):
        self.norm, self.lin, self.name = eqx.nn.LayerNorm(4), eqx.nn.Linear(4, 4, key=key), name

    def __call__(self, x):
        y = x + jax.nn.gelu(self.lin(self.norm(x)))
        return stx.save_inter(y, name=self.name) if self.name else y


class EqxModel(eqx.Module):
    blocks: tuple
    head: eqx.nn.Linear

    def __init__(self, key, marked=False):
        keys = jax.random.split(key, 4)
        self.blocks = tuple(
            EqxBlock(k, f"blocks[{i}]" if marked else "") for i, k in enumerate(keys[:3])
        )
        self.head = eqx.nn.Linear(4, 2, key=keys[3])

    def __call__(self, x):  # one example; vmapped over a batch by the caller
        for block in self.blocks:
            x = block(x)
        return self.head(x)


EQX, EQX_MARKED = EqxModel(jax.random.PRNGKey(1)), EqxModel(jax.random.PRNGKey(1), marked=True)


class NNXBlock(nnx.Module):
    def __init__(self, rngs, name=""):
        self.norm, self.lin, self.name = (
            nnx.LayerNorm(4, rngs=rngs),
            nnx.Linear(4, 4, rngs=rngs),
            name,
        )

    def __call__(self, x):
        y = x + nnx.gelu(self.lin(self.norm(x)))
        return stx.save_inter(y, name=self.name) if self.name else y


class NNXModel(nnx.Module):
    def __init__(self, rngs, marked=False):
        self.blocks = nnx.List([NNXBlock(rngs, f"blocks[{i}]" if marked else "") for i in range(3)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def nnx_models():
    return NNXModel(nnx.Rngs(2)), NNXModel(nnx.Rngs(2), marked=True)


# Each case: (selected, by_hand, args): two functions of the same arguments.
def linen_case():
    sel = stx.scopes("Model/Block_*")
    apply = LINEN.apply
    return (
        lambda wrap, p, x: wrap(apply, sel)(p, x),
        lambda wrap, p, x: wrap(Model(marked=True).apply, None)(p, x),
        (LINEN_PARAMS,),
    )


def eqx_case():
    sel = stx.modules("blocks[*]")
    batched = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    return (
        lambda wrap, m, x: wrap(batched, sel)(EQX if m is None else m, x),
        lambda wrap, m, x: wrap(batched, None)(EQX_MARKED, x),
        (None,),
    )


def pulled(fn, at):
    return stx.pull(fn, at=at)


# ---- pull, in every order --------------------------------------------------------------------


def orders(case):
    """`name -> (selected run, by-hand run, input)` for one case; each run returns what pull
    does, transformed."""
    selected, by_hand, extra = case()

    def run(f):
        return lambda x: f(pulled, *extra, x)

    def grad_out(f):  # grad(pull(f)): derivative of the output, and the marks
        def loss(x):
            out, inters = f(pulled, *extra, x)
            return jnp.sum(out**2), inters

        return lambda x: jax.grad(loss, has_aux=True)(x)

    return {
        "plain": (run(selected), run(by_hand), X),
        "jit_out": (jax.jit(run(selected)), jax.jit(run(by_hand)), X),
        "vmap_out": (jax.vmap(run(selected)), jax.vmap(run(by_hand)), XS),
        "grad_out": (grad_out(selected), grad_out(by_hand), X),
        "scan_in": (
            lambda xs: run(selected)(xs.reshape(-1, 4)),
            lambda xs: run(by_hand)(xs.reshape(-1, 4)),
            XS,
        ),
        "scan_out": (
            lambda xs: jax.lax.scan(lambda c, x: (c, run(selected)(x)), 0.0, xs)[1],
            lambda xs: jax.lax.scan(lambda c, x: (c, run(by_hand)(x)), 0.0, xs)[1],
            XS,
        ),
    }


ORDERS = ["plain", "jit_out", "vmap_out", "grad_out", "scan_in", "scan_out"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", [linen_case, eqx_case], ids=["linen_scopes", "eqx_modules"])
def test_a_selection_is_the_marks_written_by_hand(case, order):
    selected, by_hand, x = orders(case)[order]
    got, want = selected(x), by_hand(x)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(jax.tree.leaves(want)) >= 4  # the output and three blocks, at least


def test_linen_scopes_inside_vmap_grad_jit_and_scan():
    # A Linen module's scope is marked where the module runs (Flax's method interceptor): in
    # pull(vmap(f)) and pull(grad(f)) too, as the marks by hand.
    sel = stx.scopes("Model/Block_*")
    marked = Model(marked=True)
    f, g = jax.vmap(LINEN.apply, in_axes=(None, 0)), jax.vmap(marked.apply, in_axes=(None, 0))
    got = stx.pull(f, at=sel)(LINEN_PARAMS, XS)
    assert_tree_allclose(got, stx.pull(g)(LINEN_PARAMS, XS), rtol=1e-6)
    assert got[1]["Model/Block_0_0"].shape == (3, 2, 4)  # batch first
    hook = {"Model/Block_1_0": lambda v: v * 0.5}
    assert_tree_allclose(
        stx.plant(f, at=sel)(hook, LINEN_PARAMS, XS), stx.plant(g)(hook, LINEN_PARAMS, XS)
    )
    loss = lambda model: lambda p, x: jnp.sum(model.apply(p, x) ** 2)  # noqa: E731
    got = stx.pull(jax.grad(loss(LINEN)), at=sel)(LINEN_PARAMS, X)
    assert_tree_allclose(got, stx.pull(jax.grad(loss(marked)))(LINEN_PARAMS, X), rtol=1e-5)
    # Inside `jit` and `scan`, the same.
    xs_loop = lambda p, xs: jax.lax.scan(lambda c, x: (c, LINEN.apply(p, x)), 0.0, xs)[1]  # noqa: E731
    _, inters = stx.pull(jax.jit(xs_loop), at=sel)(LINEN_PARAMS, XS)
    _, by_hand = stx.pull(
        lambda p, xs: jax.lax.scan(lambda c, x: (c, Model(marked=True).apply(p, x)), 0.0, xs)[1]
    )(LINEN_PARAMS, XS)
    assert_tree_allclose(inters, by_hand, rtol=1e-6)
    assert inters["Model/Block_0_0"].shape == (3, 2, 4)  # stacked per step


@pytest.mark.parametrize("order", ["plain", "vmap_in", "grad_in", "jit_in", "scan_in"])
def test_eqx_modules_in_every_order(order):
    # A module selection marks where the submodule runs: inside the transformations too.
    sel = stx.modules("blocks[*]")
    if order == "vmap_in":
        f, g, x = jax.vmap(EQX), jax.vmap(EQX_MARKED), X
    elif order == "grad_in":
        f = jax.grad(lambda m, x: jnp.sum(m(x) ** 2))
        g = lambda m, x: jax.grad(lambda m, x: jnp.sum(m(x) ** 2))(EQX_MARKED, x)  # noqa: E731
        got, want = stx.pull(f, at=sel)(EQX, X[0]), stx.pull(g)(EQX, X[0])
        assert_tree_allclose(got[1], want[1], rtol=1e-6)
        return
    elif order == "jit_in":  # the model an argument of the jitted function: found there
        f = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
        got, want = stx.pull(f, at=sel)(EQX, X), stx.pull(f)(EQX_MARKED, X)
        assert_tree_allclose(got, want, rtol=1e-6)
        return
    elif order == "scan_in":

        def f(m, xs):
            return jax.lax.scan(lambda c, x: (c, jax.vmap(m)(x)), 0.0, xs)[1]

        got, want = stx.pull(f, at=sel)(EQX, XS), stx.pull(f)(EQX_MARKED, XS)
        assert_tree_allclose(got, want, rtol=1e-6)
        assert got[1]["blocks[0]_0"].shape == (3, 2, 4)
        return
    else:
        f, g, x = EQX, EQX_MARKED, X[0]
    got = stx.pull(f, at=stx.modules("blocks[*]", of=EQX))(x)
    assert_tree_allclose(got, stx.pull(g)(x), rtol=1e-6)
    assert type(EQX.blocks[0]) is EqxBlock  # the class is put back


def test_a_submodule_a_cached_jit_does_not_call_again():
    # A jit whose cached trace holds the marks (the selection's class is in its key) does not
    # call the submodule again: the marks are there, and come back.
    f = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    want = stx.pull(f)(EQX_MARKED, X)
    for _ in range(2):  # a new pull each time: the second finds filter_jit's trace cached
        assert_tree_allclose(stx.pull(f, at=stx.modules("blocks[*]"))(EQX, X), want, rtol=1e-6)
    # A jit that closes over the model and traced it before: pull traces in a context of its
    # own, which is part of jit's key, so the jit traces again, and the marks are made.
    closed_over = jax.jit(lambda x: jax.vmap(EQX)(x))
    closed_over(X)
    got = stx.pull(closed_over, at=stx.modules("blocks[*]", of=EQX))(X)
    assert_tree_allclose(got, stx.pull(jax.jit(lambda x: jax.vmap(EQX_MARKED)(x)))(X), rtol=1e-6)


def test_a_selected_submodule_that_never_runs_is_an_error():
    def f(m, x):
        return m.head(x[0])  # the blocks never run

    with pytest.raises(stx.SelectionError, match="did not call while pull traced it"):
        stx.pull(f, at=stx.modules("blocks[1]"))(EQX, X)
    assert list(stx.pull(f, at=stx.modules("head"))(EQX, X)[1]) == ["head_0"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_nnx_modules(jit):
    model, marked = nnx_models()
    call = (lambda m, x: nnx.jit(lambda m, x: m(x))(m, x)) if jit else (lambda m, x: m(x))
    got = stx.pull(call, at=stx.modules("blocks[*]"))(model, X)
    assert_tree_allclose(got, stx.pull(call)(marked, X), rtol=1e-6)
    assert type(model.blocks[1]) is NNXBlock
    # A block's inputs too, where asked; and a path into a block.
    _, inters = stx.pull(model, at=stx.modules("blocks[1]", "blocks[2].lin", inputs=True))(X)
    assert list(inters) == [
        "blocks[1].in_0",
        "blocks[1]_0",
        "blocks[2].lin.in_0",
        "blocks[2].lin_0",
    ]
    np.testing.assert_allclose(
        inters["blocks[1].in_0"], stx.pull(call)(marked, X)[1]["blocks[0]_0"], rtol=1e-6
    )
    # Gradients at the selection, with the model an argument (split into its state for
    # JAX's grad, as nnx.grad does), against the marks by hand.
    loss = lambda m, x: jnp.mean(call(m, x) ** 2)  # noqa: E731
    got = stx.grad_inters(loss, at=stx.modules("blocks[*]"))(model, X)
    assert_tree_allclose(got, stx.grad_inters(loss)(marked, X), rtol=1e-5)
    with pytest.raises(TypeError, match="nnx.grad"):
        stx.grad_inters(loss, argnums=0)(model, X)


def test_a_jax_jit_of_pull_of_an_nnx_model_that_closes_over_it():
    """`jax.jit(stx.pull(model))`: the call changes no state, so nothing is written back into
    the model from inside the trace (which NNX refuses)."""
    model, marked = nnx_models()
    got = jax.jit(stx.pull(model, at=stx.modules("blocks[*]")))(X)
    assert_tree_allclose(got, stx.pull(marked)(X), rtol=1e-6)


@pytest.mark.parametrize("order", ["nnx_vmap", "nnx_grad", "nnx_scan"])
def test_nnx_modules_inside_nnx_transforms(order):
    model, marked = nnx_models()
    if order == "nnx_vmap":
        f, x = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0)), XS
    elif order == "nnx_grad":
        f, x = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)), X
    else:

        @nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def steps(m, c, x):
            return c, m(x)

        f, x = (lambda m, xs: steps(m, 0.0, xs)[1]), XS
    got = stx.pull(f, at=stx.modules("blocks[*]"))(model, x)
    want = stx.pull(f)(marked, x)
    assert_tree_allclose(got[1], want[1], rtol=1e-6)
    if order != "nnx_grad":
        assert_tree_allclose(got[0], want[0], rtol=1e-6)
        assert got[1]["blocks[0]_0"].shape == (3, 2, 4)  # per batch, or per step


# ---- a transformer whose blocks run under lax.scan over stacked parameters ------------------


class Stacked(eqx.Module):
    blocks: EqxBlock  # one block whose arrays have a leading axis: one row per layer
    head: eqx.nn.Linear

    def __init__(self, key, name=""):
        keys = jax.random.split(key, 4)
        self.blocks = eqx.filter_vmap(lambda k: EqxBlock(k, name))(keys[:3])
        self.head = eqx.nn.Linear(4, 2, key=keys[3])

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, block_arrays):
            return eqx.combine(block_arrays, static)(h), None

        return self.head(jax.lax.scan(layer, x, arrays)[0])


def test_a_scope_in_the_program_under_a_transform_inside_says_where_to_put_it():
    # A scope that is no Flax module's is found in the program, where a transformation applied
    # inside the function has already been applied: its values there are batched along
    # whichever axis the batching rules chose, or stand beside their tangents.
    def f(x):
        with jax.named_scope("block"):
            h = jnp.sin(x) @ jnp.ones((4, 3))
        return jnp.sum(h**2)

    with pytest.raises(stx.SelectionError, match=r"under `vmap`.*jax.vmap\(stx.pull"):
        stx.pull(jax.vmap(f), at=stx.scopes("block"))(XS)
    with pytest.raises(stx.SelectionError, match="under `jvp`"):
        stx.pull(jax.grad(f), at=stx.scopes("block"))(X)
    with pytest.raises(stx.SelectionError, match="under `vmap`"):
        stx.pull(jax.vmap(f), at=stx.primitives("sin"))(XS)
    # Outside, as a mark written there.
    by_hand = lambda x: jnp.sum((stx.save_inter(jnp.sin(x) @ jnp.ones((4, 3)), name="block")) ** 2)  # noqa: E731
    got = jax.vmap(stx.pull(f, at=stx.scopes("block")))(XS)
    assert_tree_allclose(got, jax.vmap(stx.pull(by_hand))(XS), rtol=1e-6)
    grads = jax.grad(lambda x: stx.pull(f, at=stx.scopes("block"))(x), has_aux=True)(X)
    assert_tree_allclose(
        grads, jax.grad(lambda x: stx.pull(by_hand)(x), has_aux=True)(X), rtol=1e-6
    )


def test_a_scope_a_library_differentiates_is_an_error_that_says_to_mark_it():
    # optimistix's Newton differentiates the residual to solve: its scope is under `jvp` there.
    import optimistix as optx

    def residual(y, a):
        with jax.named_scope("residual"):
            return jnp.tanh(y) - a

    def newton(a):
        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        return optx.root_find(residual, solver, jnp.zeros_like(a), args=a).value

    with pytest.raises(stx.SelectionError, match="under `jvp`.*a library applies it"):
        stx.pull(newton, at=stx.scopes("residual"))(X[0])


def test_scanned_blocks_come_back_stacked():
    model, marked = Stacked(jax.random.PRNGKey(3)), Stacked(jax.random.PRNGKey(3), "blocks")
    for f, g in [(model, marked), (jax.vmap(model), jax.vmap(marked))]:
        x = X[0] if f is model else X
        got = stx.pull(f, at=stx.modules("blocks", of=model))(x)
        assert_tree_allclose(got, stx.pull(g)(x), rtol=1e-6)
        assert got[1]["blocks_0"].shape[-2:] == (3, 4)  # one row per layer (batch first)

    # The same by scope: a plain function with a named scope in the scan body.
    def transformer(ws, x):
        def layer(h, w):
            with jax.named_scope("block"):
                h = h + jnp.tanh(h @ w)
            return h, None

        return jax.lax.scan(layer, x, ws)[0]

    def by_hand(ws, x):
        def layer(h, w):
            return stx.save_inter(h + jnp.tanh(h @ w), name="block"), None

        return jax.lax.scan(layer, x, ws)[0]

    ws = jnp.stack([jnp.eye(4) * s for s in (0.5, -1.0, 2.0)])
    got = stx.pull(transformer, at=stx.scopes("block"))(ws, X)
    assert_tree_allclose(got, stx.pull(by_hand)(ws, X), rtol=1e-6)
    assert got[1]["block_0"].shape == (3, 2, 4)


# ---- interventions at the same places ----------------------------------------------------------


@pytest.mark.parametrize("case", ["linen", "eqx"])
def test_plant_and_grad_inters_at_a_selection(case):
    if case == "linen":
        f, marked, args, sel = (
            LINEN.apply,
            Model(marked=True).apply,
            (LINEN_PARAMS, X),
            stx.scopes("Model/Block_*"),
        )
        key = "Model/Block_1_0"
    else:
        f = lambda m, x: jax.vmap(m)(x)  # noqa: E731
        marked = lambda m, x: jax.vmap(EQX_MARKED)(x)  # noqa: E731
        args, sel, key = (EQX, X), stx.modules("blocks[*]"), "blocks[1]_0"
    out, inters = stx.pull(f, at=sel)(*args)
    # Planting what pull returned changes nothing; a patch is the hand-marked patch.
    assert_tree_allclose(stx.plant(f, at=sel)(inters, *args), out, rtol=1e-6)
    patch = {key: jnp.zeros_like(inters[key])}
    assert_tree_allclose(stx.plant(f, at=sel)(patch, *args), stx.plant(marked)(patch, *args))
    hook = {key: lambda v: v * 2.0}
    assert_tree_allclose(stx.plant(f, at=sel)(hook, *args), stx.plant(marked)(hook, *args))
    # Gradients at the selection: the hand-marked gradients, under jit too.
    loss = lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    loss_marked = lambda *a: jnp.sum(marked(*a) ** 2)  # noqa: E731
    got = stx.grad_inters(loss, at=sel)(*args)
    assert_tree_allclose(got, stx.grad_inters(loss_marked)(*args), rtol=1e-5)
    jitted = jax.jit(lambda *a: stx.grad_inters(loss, at=sel)(*a)) if case == "linen" else None
    if jitted is not None:
        assert_tree_allclose(jitted(*args), got, rtol=1e-5)


def test_selections_mix_with_marks_by_hand_only_reduce_and_summarize():
    def f(x):
        h = stx.save_inter(jnp.sin(x), name="h")
        with jax.named_scope("block"):
            y = h * 2.0
        return jnp.cos(y)

    _, inters = stx.pull(f, at=stx.scopes("block"))(X)
    assert list(inters) == ["h_0", "block_0"]
    _, inters = stx.pull(f, at=stx.scopes("block"), only="block")(X)
    assert list(inters) == ["block_0"]
    _, inters = stx.pull(f, at=[stx.scopes("block", reduce="sum"), stx.primitives("cos")])(X)
    assert list(inters) == ["h_0", "block", "cos_0"]
    np.testing.assert_allclose(inters["cos_0"], jnp.cos(2.0 * jnp.sin(X)), rtol=1e-6)
    _, summary = stx.pull(f, at=stx.scopes("block"), summarize=jnp.mean)(X)
    np.testing.assert_allclose(summary["block_0"], jnp.mean(2.0 * jnp.sin(X)), rtol=1e-6)


def test_a_selection_in_a_branch_and_a_custom_rule():
    def f(x, take):
        def branch(v):
            with jax.named_scope("inside"):
                return jnp.sin(v) * 3.0

        @jax.custom_jvp
        def g(v):
            with jax.named_scope("rule_fn"):
                return jnp.exp(v)

        g.defjvp(lambda p, t: (g(p[0]), g(p[0]) * t[0]))
        return g(jax.lax.cond(take, branch, lambda v: v, x))

    def by_hand(x, take):
        def branch(v):
            return stx.save_inter(jnp.sin(v) * 3.0, name="inside")

        @jax.custom_jvp
        def g(v):
            return stx.save_inter(jnp.exp(v), name="rule_fn")

        g.defjvp(lambda p, t: (g(p[0]), g(p[0]) * t[0]))
        return g(jax.lax.cond(take, branch, lambda v: v, x))

    sel = stx.scopes("inside", "rule_fn")
    for take in (True, False):
        for wrap in (lambda h: h, jax.jit):
            for ran in (False, True):  # (marks put into the jaxpr; the program evaluated again)
                got = wrap(stx.pull(f, at=sel, ran=ran))(X, take)
                want = wrap(stx.pull(by_hand, ran=ran))(X, take)
                assert_tree_allclose(got, want, rtol=1e-6)
    # Planted there, and differentiated there, as by hand.
    patch = {"inside_0": lambda v: v * 0.5, "rule_fn_0": lambda v: v + 1.0}
    got = stx.plant(f, at=sel)(patch, X, True)
    assert_tree_allclose(got, stx.plant(by_hand)(patch, X, True), rtol=1e-6)
    loss = lambda g: lambda x, take: jnp.sum(g(x, take))  # noqa: E731
    got = stx.grad_inters(loss(f), at=sel)(X, True)
    assert_tree_allclose(got, stx.grad_inters(loss(by_hand))(X, True), rtol=1e-6)


def test_a_selection_under_checkpoint_is_marked_once():
    def f(x):
        def block(x):
            with jax.named_scope("block"):
                return jnp.sin(x) * 2.0

        return jnp.sum(jax.checkpoint(block)(x) ** 2)

    def by_hand(x):
        block = lambda x: stx.save_inter(jnp.sin(x) * 2.0, name="block")  # noqa: E731
        return jnp.sum(jax.checkpoint(block)(x) ** 2)

    sel = stx.scopes("block")
    assert_tree_allclose(stx.pull(f, at=sel)(X), stx.pull(by_hand)(X), rtol=1e-6)

    def outside(g, **kwargs):  # grad(pull(f)): the recomputation in the backward pass
        return jax.grad(lambda x: stx.pull(g, **kwargs)(x), has_aux=True)(X)

    got = outside(f, at=sel)
    assert_tree_allclose(got, outside(by_hand), rtol=1e-6)
    assert list(got[1]) == ["block_0"]  # once


def test_primitives_and_lines():
    def f(w, x):
        h = jnp.tanh(x @ w)  # the line selected below
        return jnp.sum(h @ w.T)

    line = f.__code__.co_firstlineno + 1
    lines = stx.lines(f"test_select.py:{line}")
    _, inters = stx.pull(f, at=lines)(jnp.eye(4), X)
    assert list(inters) == [f"test_select.py:{line}_0"]
    np.testing.assert_allclose(inters[f"test_select.py:{line}_0"], jnp.tanh(X), rtol=1e-6)
    _, inters = stx.pull(f, at=stx.primitives("dot_general"))(jnp.eye(4), X)
    assert list(inters) == ["dot_general_0", "dot_general_1"]
    np.testing.assert_allclose(inters["dot_general_1"], jnp.tanh(X) @ jnp.eye(4), rtol=1e-6)


# ---- never a silent {} -------------------------------------------------------------------------


def test_a_selection_that_matches_nothing_lists_what_there_is():
    with pytest.raises(
        stx.SelectionError, match=r"no scope 'Model/Blok_1'.*closest first: 'Model/Block_1'"
    ):
        stx.pull(LINEN.apply, at=stx.scopes("Model/Blok_1"))(LINEN_PARAMS, X)
    with pytest.raises(stx.SelectionError, match=r"no primitive 'dot'.*'dot_general'"):
        stx.pull(LINEN.apply, at=stx.primitives("dot"))(LINEN_PARAMS, X)
    with pytest.raises(stx.SelectionError, match=r"no line 'nowhere.py:3'"):
        stx.pull(LINEN.apply, at=stx.lines("nowhere.py:3"))(LINEN_PARAMS, X)
    with pytest.raises(stx.SelectionError, match=re.escape("has no '7'. There is: 'blocks[0]'")):
        stx.pull(jax.vmap(EQX), at=stx.modules("blocks[7]"))(X)
    with pytest.raises(stx.SelectionError, match=re.escape("has no 'blokcs'. There is: 'blocks'")):
        stx.pull(jax.vmap(EQX), at=stx.modules("blokcs[0]"))(X)
    with pytest.raises(stx.SelectionError, match="no model to start its paths from"):
        stx.pull(lambda x: x, at=stx.modules("blocks"))(X)


def test_only_that_selects_nothing_says_so():
    def f(x):
        return stx.save_inter(jnp.sin(stx.save_inter(x, name="hidden")), name="out")

    with pytest.raises(stx.SelectionError, match=r"'hiden' selects no mark.*'hidden', 'out'"):
        stx.pull(f, only="hiden")(X)
    with pytest.raises(stx.SelectionError, match=r"'hidden_0' is a key: only= takes names"):
        jax.jit(stx.pull(f, only="hidden_0"))(X)
    with pytest.raises(stx.SelectionError, match="selects no mark"):
        stx.pull(f, only=re.compile("nothing.*"))(X)
    assert list(stx.pull(f, only=[])(X)[1]) == []  # asked for nothing: nothing


# ---- cost: the same program as the marks by hand -----------------------------------------------


def hlo_ops(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"^\s+\S+ = ", text, flags=re.M))


def test_a_selection_compiles_to_the_hand_marked_program():
    selected = stx.pull(LINEN.apply, at=stx.scopes("Model/Block_*"))
    by_hand = stx.pull(Model(marked=True).apply)
    assert hlo_ops(selected, LINEN_PARAMS, X) == hlo_ops(by_hand, LINEN_PARAMS, X)
    f = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    selected = stx.pull(f, at=stx.modules("blocks[*]"))
    assert hlo_ops(selected, EQX, X) == hlo_ops(stx.pull(f), EQX_MARKED, X)
    # Unselected, nothing changes.
    assert hlo_ops(stx.pull(LINEN.apply), LINEN_PARAMS, X) == hlo_ops(LINEN.apply, LINEN_PARAMS, X)


# ---- nested scopes in one selection (issue 34, item 3) -----------------------------------------


def test_nested_scopes_in_one_selection_mark_both():
    def f(x, marked=False):
        with jax.named_scope("outer"):
            with jax.named_scope("inner"):
                h = jnp.sin(x)
            if marked:
                h = stx.save_inter(h, name="outer/inner")
            y = h * 2
        if marked:
            y = stx.save_inter(y, name="outer")
        return y + 1

    want = stx.pull(lambda x: f(x, marked=True))(X)
    for at in (stx.scopes("outer", "outer/inner"), stx.scopes("outer/inner", "outer")):
        got = stx.pull(f, at=at)(X)
        assert list(got[1]) == list(want[1]) == ["outer/inner_0", "outer_0"]
        assert_tree_allclose(got, want)
        assert_tree_allclose(jax.jit(stx.pull(f, at=at))(X), want, rtol=1e-6)


def test_a_linen_block_and_its_layer_in_one_selection():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(4, name="dense")(x)

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = Block(name=f"block_{i}")(x)
            return x

    model = Encoder()
    params = model.init(jax.random.PRNGKey(0), X)
    one = stx.pull(model.apply, at=stx.scopes("Encoder/block_1", "Encoder/block_1/dense"))
    two = stx.pull(
        model.apply, at=[stx.scopes("Encoder/block_1"), stx.scopes("Encoder/block_1/dense")]
    )
    got = one(params, X)
    assert list(got[1]) == ["Encoder/block_1/dense_0", "Encoder/block_1_0"]
    assert_tree_allclose(got, two(params, X))
    # by hand: the layer's output, then the block's
    _, state = model.apply(params, X, capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]["block_1"]
    assert_tree_allclose(got[1]["Encoder/block_1/dense_0"], inter["dense"]["__call__"][0])
    assert_tree_allclose(got[1]["Encoder/block_1_0"], inter["__call__"][0])


# ---- Linen blocks made in setup(), and under nn.remat (issue 34, items 2 and 4) ----------------


class SetupBlock(nn.Module):
    def setup(self):
        self.dense = nn.Dense(4)

    def __call__(self, x):
        return (x + self.dense(x),)  # a tuple, as Hugging Face's blocks return


class SetupEncoder(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(SetupBlock) if self.remat else SetupBlock
        for i in range(2):
            (x,) = block(name=f"block_{i}")(x)
        return x


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_linen_blocks_made_in_setup_and_under_remat_as_flax_captures_them(remat):
    model = SetupEncoder(remat=remat)
    params = model.init(jax.random.PRNGKey(0), X)
    _, state = model.apply(params, X, capture_intermediates=True, mutable=["intermediates"])
    captured = state["intermediates"]
    want = {f"SetupEncoder/block_{i}_0": captured[f"block_{i}"]["__call__"][0] for i in range(2)}
    for run in (stx.pull(model.apply, at=stx.scopes("SetupEncoder/block_*")),):
        for got in (run(params, X)[1], jax.jit(run)(params, X)[1]):
            assert list(got) == list(want)  # no "block_0.setup" key
            assert_tree_allclose(got, want)  # each the block's own (y,): structure kept
            assert isinstance(got["SetupEncoder/block_0_0"], tuple)
    # and the same values under grad outside
    loss = lambda p, x: jnp.sum(model.apply(p, x))  # noqa: E731
    grads, got = jax.grad(stx.pull(loss, at=stx.scopes("SetupEncoder/block_*")), has_aux=True)(
        params, X
    )
    assert_tree_allclose(got, want)
    assert_tree_allclose(grads, jax.grad(loss)(params, X))


class HelperNet(nn.Module):
    """Its `setup` calls a helper method that builds a submodule (issue 39, item 11)."""

    def setup(self):
        self.body = nn.Dense(4)
        self.head = self._make_head()

    def _make_head(self):
        return nn.Dense(2)

    def __call__(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("jit", [False, True])
def test_a_helper_that_setup_calls_gives_no_key(jit):
    model = HelperNet()
    params = model.init(jax.random.PRNGKey(0), X)
    _, state = model.apply(params, X, capture_intermediates=True, mutable=["intermediates"])
    captured = state["intermediates"]
    run = stx.pull(model.apply, at=stx.scopes("HelperNet*"))
    _, got = (jax.jit(run) if jit else run)(params, X)
    assert list(got) == ["HelperNet_0"]
    assert_tree_allclose(got["HelperNet_0"], captured["__call__"][0])
    _, got = stx.pull(model.apply, at=stx.scopes("HelperNet/*"))(params, X)
    assert list(got) == ["HelperNet/body_0", "HelperNet/head_0"]
    assert_tree_allclose(got["HelperNet/head_0"], captured["head"]["__call__"][0])


# ---- Linen nn.scan (issue 34, item 1) ------------------------------------------------------------


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(4, name="dense")(x)), None


class ScanNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )(name="layers")
        x, _ = layers(x, None)
        return x


def test_linen_nn_scan_gives_each_iterations_values_stacked():
    model = ScanNet()
    params = model.init(jax.random.PRNGKey(0), X)
    dense = params["params"]["layers"]["dense"]
    x, pre, post = X, [], []
    for i in range(3):  # the scan by hand
        h = x @ dense["kernel"][i] + dense["bias"][i][None]
        x = jax.nn.relu(h)
        pre.append(h)
        post.append(x)
    for run in (
        stx.pull(model.apply, at=stx.scopes("ScanNet/layers/dense", "ScanNet/layers")),
        jax.jit(stx.pull(model.apply, at=stx.scopes("ScanNet/layers/dense", "ScanNet/layers"))),
    ):
        out, got = run(params, X)
        assert list(got) == ["ScanNet/layers/dense_0", "ScanNet/layers_0"]
        assert_tree_allclose(got["ScanNet/layers/dense_0"], jnp.stack(pre), rtol=1e-5)
        carry, ys = got["ScanNet/layers_0"]  # the body's (carry, y) of each iteration
        assert ys is None
        assert_tree_allclose(carry, jnp.stack(post), rtol=1e-5)
        assert_tree_allclose(out, x, rtol=1e-5)


# ---- of= models that a transformation rebuilds (issue 34, item 6) ------------------------------


class ArrayNet(eqx.Module):  # every leaf an array: jax.jit and jax.grad take it as it is
    layers: tuple
    marked: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.marked and i == 1:
                x = stx.save_inter(x, name="layers[1]")
            x = jnp.tanh(x)
        return x


def test_an_of_model_rebuilt_by_jit_and_grad_is_found_by_its_structure():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    net = ArrayNet(tuple(eqx.nn.Linear(4, 4, key=k) for k in keys))
    by_hand = ArrayNet(net.layers, marked=True)
    x = X[0]
    f = stx.pull(lambda n, x: n(x), at=stx.modules("layers[1]", of=net))
    want = stx.pull(lambda n, x: n(x))(by_hand, x)
    assert list(want[1]) == ["layers[1]_0"]
    assert_tree_allclose(f(net, x), want)
    assert_tree_allclose(jax.jit(f)(net, x), want, rtol=1e-6)

    def loss(f):
        return lambda n, x: (lambda out, inters: (jnp.sum(out), inters))(*f(n, x))

    grads, inters = jax.grad(loss(f), has_aux=True)(net, x)
    want_grads, want_inters = jax.grad(loss(stx.pull(lambda n, x: n(x))), has_aux=True)(by_hand, x)
    assert_tree_allclose((grads.layers, inters), (want_grads.layers, want_inters))

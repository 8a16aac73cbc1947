"""A mark nobody pulls changes nothing a library can observe.

Each library below runs a function of the user's inside a transform of its own (Flax's
`nn.scan`, `nn.remat`, `nn.vmap`, `nnx.scan`, equinox's `filter_vmap`, a diffrax solve, an
optimistix root find). Some of them look at the program they are given: Flax's `nn.scan` traces
its body and eliminates dead code to check that a broadcast variable does not depend on the
carry. The same code with and without `save_inter` (not pulled) must give the same values and
derivatives, and the same program once marks are taken out.
"""

import diffrax
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optimistix as optx
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval as pe  # what Flax's `nn.scan` calls

import statax as stx
from statax.testing import assert_tree_allclose


def mark(value, name, marked):
    return stx.save_inter(value, name=name) if marked else value


def program(fn, *args) -> list[str]:
    """The primitives of `fn`'s program, at every depth, after dead-code elimination, marks
    left out: what a library that looks at the program sees of it."""
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return [
        eqn.primitive.name
        for eqn in stx.extend.equations(jaxpr)
        if eqn.primitive is not stx.extend.save_inter_p
    ]


def assert_unobservable(make, *args):
    """`make(marked)` returns a function of `args`: marked or not, the same values, gradients
    (of the sum of its float outputs) and program."""
    plain, marked = make(False), make(True)
    assert_tree_allclose(marked(*args), plain(*args))

    def loss(fn):
        def total(*args):
            leaves = jax.tree_util.tree_leaves(fn(*args))
            return sum(jnp.sum(x) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))

        return total

    assert_tree_allclose(jax.grad(loss(marked))(*args), jax.grad(loss(plain))(*args))
    assert program(marked, *args) == program(plain, *args)


class Cell(nn.Module):
    marked: bool

    @nn.compact
    def __call__(self, h, x):
        h = jnp.tanh(nn.Dense(3)(h) + x)
        return mark(h, "h", self.marked), h


class Scanned(nn.Module):
    marked: bool

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(
            Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=0, out_axes=0
        )
        return scan(self.marked)(jnp.zeros(3), xs)


class Remat(nn.Module):
    marked: bool

    @nn.compact
    def __call__(self, x):
        return nn.remat(Cell)(self.marked)(x, x)[0]


class Vmapped(nn.Module):
    marked: bool

    @nn.compact
    def __call__(self, xs):
        vmap = nn.vmap(Cell, variable_axes={"params": None}, split_rngs={"params": False})
        return vmap(self.marked)(xs, xs)[0]


XS = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


@pytest.mark.parametrize("module", [Scanned, Remat, Vmapped], ids=lambda m: m.__name__)
def test_flax_linen_transforms(module):
    params = module(False).init(jax.random.PRNGKey(0), XS)
    assert_tree_allclose(module(True).init(jax.random.PRNGKey(0), XS), params)
    assert_unobservable(lambda marked: module(marked).apply, params, XS)


class NNXCell(nnx.Module):
    def __init__(self, marked, rngs):
        self.marked = marked
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, h, x):
        h = jnp.tanh(self.lin(h) + x)
        return mark(h, "h", self.marked), h


@nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
def nnx_steps(cell, h, x):
    return cell(h, x)


def test_flax_nnx_scan():
    def make(marked):
        def run(xs):  # the cell made in the trace, as NNX's functional examples make it
            return nnx_steps(NNXCell(marked, nnx.Rngs(0)), jnp.zeros(3), xs)

        return run

    assert_unobservable(make, XS)


def test_equinox_filter_vmap():
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))

    def make(marked):
        @eqx.filter_vmap
        def run(x):
            return mark(mlp(mark(x, "x", marked)), "y", marked)

        return run

    assert_unobservable(make, XS)


def test_diffrax_solve():
    def make(marked):
        def solve(y0):
            term = diffrax.ODETerm(lambda t, y, k: mark(-k * jnp.sin(y), "vf", marked))
            controller = diffrax.PIDController(rtol=1e-5, atol=1e-5)
            sol = diffrax.diffeqsolve(
                term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=3.0,
                stepsize_controller=controller,
            )  # fmt: skip
            return sol.ys

        return solve

    assert_unobservable(make, jnp.array([1.0, 2.0]))


def test_optimistix_root_find():
    def make(marked):
        def root(a):
            fn = lambda y, a: mark(jnp.tanh(y) - a, "r", marked)  # noqa: E731
            solver = optx.Newton(rtol=1e-6, atol=1e-6)
            return optx.root_find(fn, solver, jnp.zeros_like(a), args=a).value

        return root

    assert_unobservable(make, jnp.linspace(-0.5, 0.5, 4))

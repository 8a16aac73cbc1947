"""Marks in library code: a diffrax solve and an optimistix root find, pulled.

1. A 500-step Tsit5 solve of a 64x32 system (`dy/dt = -tanh(y @ W)`, constant step), the
   vector field's output marked; with diffrax's default adjoint and with `BacksolveAdjoint`.
2. A Newton root find of `tanh(y) = a` on 256 values, the residual marked.

Each row is `jax.jit(stx.pull(f))` against `jax.jit(f_hand)`, where `f_hand` is the same code
without marks and without `pull` (the least any way of getting the values could cost: diffrax
and optimistix give no way to return a vector-field or residual evaluation by hand). Medians of
interleaved runs; the number of `while` loops in the compiled HLO, and of equations of the
marked op in the program handed to XLA (XLA's fusion may copy a cheap elementwise op into
several fusions), which must be equal.

Run: `python benchmarks/bench_libraries.py` (about a minute on 2 CPU cores).
"""

import re

import diffrax
import jax
import jax.numpy as jnp
import optimistix as optx
from _timing import interleaved_ratio, report

import statax as stx

ROWS, COLS, STEPS, ROOTS = 64, 32, 500, 256


def make_solve(marked, adjoint):
    def vector_field(t, y, w):
        dy = -jnp.tanh(y @ w)
        return stx.save_inter(dy, name="vf") if marked else dy

    def solve(y0, w):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field),
            diffrax.Tsit5(),
            0.0,
            1.0,
            1.0 / STEPS,
            y0,
            args=w,
            adjoint=adjoint,
            saveat=diffrax.SaveAt(t1=True),
            max_steps=STEPS + 1,
        )
        return sol.ys

    return solve


def make_root(marked):
    def residual(y, a):
        r = jnp.tanh(y) - a
        return stx.save_inter(r, name="r") if marked else r

    def root(a):
        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        return optx.root_find(residual, solver, jnp.zeros_like(a), args=a).value

    return root


def ops(compiled, op):
    return len(re.findall(rf" {op}\(", compiled.as_text()))


def eqns(fn, args, primitive):
    return len(re.findall(rf"= {primitive}\b", str(jax.make_jaxpr(fn)(*args))))


def row(label, pulled, hand, args, op):
    pulled_c = jax.jit(pulled).lower(*args).compile()
    hand_c = jax.jit(hand).lower(*args).compile()
    loops = f"while {ops(pulled_c, 'while')} vs {ops(hand_c, 'while')}"
    marked_op = f"{op} {eqns(pulled, args, op)} vs {eqns(hand, args, op)}"
    ratio, cand, base = interleaved_ratio(
        lambda: jax.block_until_ready(pulled_c(*args)),
        lambda: jax.block_until_ready(hand_c(*args)),
        repeats=21,
    )
    report(f"{label} ({loops}, {marked_op})", "<= 1.05", ratio, cand, base)


def main():
    print(f"JAX {jax.__version__}, {jax.devices()[0].platform}")
    key = jax.random.PRNGKey(0)
    y0 = jax.random.normal(key, (ROWS, COLS))
    w = jax.random.normal(jax.random.fold_in(key, 1), (COLS, COLS)) / COLS**0.5
    for adjoint in (diffrax.RecursiveCheckpointAdjoint(), diffrax.BacksolveAdjoint()):
        name = type(adjoint).__name__
        pulled = stx.pull(make_solve(True, adjoint))
        row(f"diffrax Tsit5, {name}", pulled, make_solve(False, adjoint), (y0, w), "tanh")
    a = jnp.linspace(-0.9, 0.9, ROOTS)
    row("optimistix Newton", stx.pull(make_root(True)), make_root(False), (a,), "tanh")


if __name__ == "__main__":
    main()

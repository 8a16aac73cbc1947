"""Handlers at work: a transformer-like stack run by `lax.scan`, and rewrite-time scaling.

1. Eight blocks (layernorm, single-head attention with sequence 128 and width 256, MLP with
   hidden 1024), batch 2, run by `lax.scan` over stacked parameters, saving the attention output
   and the MLP hidden of every block; with and without `jax.checkpoint` around the block; as a
   forward pass and as `value_and_grad` of a loss. Runtime of `jit(pull(f))` against the same
   function written by hand to return those values as scan outputs (median ratio over
   interleaved runs), and temp memory from `compiled.memory_analysis()`.
2. Trace-and-rewrite time (`make_jaxpr` + `pull_jaxpr`) per equation for programs of 1,000,
   10,000 and 50,000 equations, one mark every 10 equations.

Run: `python benchmarks/bench_handlers.py` (about a minute and a half on 2 CPU cores).
"""

import time

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report
from jax import lax

import statax as stx

BLOCKS, BATCH, SEQ, DIM, HIDDEN = 8, 2, 128, 256, 1024


def init(key):
    k = jax.random.split(key, 4)
    scale = DIM**-0.5
    return {
        "qkv": jax.random.normal(k[0], (BLOCKS, DIM, 3 * DIM)) * scale,
        "out": jax.random.normal(k[1], (BLOCKS, DIM, DIM)) * scale,
        "up": jax.random.normal(k[2], (BLOCKS, DIM, HIDDEN)) * scale,
        "down": jax.random.normal(k[3], (BLOCKS, HIDDEN, DIM)) * HIDDEN**-0.5,
    }


def layernorm(x):
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def block(x, p, mark):
    q, k, v = jnp.split(layernorm(x) @ p["qkv"], 3, axis=-1)
    weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / DIM**0.5, axis=-1)
    attn = mark((weights @ v) @ p["out"], "attn")
    x = x + attn
    hidden = mark(jax.nn.gelu(layernorm(x) @ p["up"]), "mlp_hidden")
    return x + hidden @ p["down"], (attn, hidden)


def make(remat, marked):
    def mark(value, name):
        return stx.save_inter(value, name=name) if marked else value

    def step(x, p):
        x, saved = block(x, p, mark)
        return x, (None if marked else saved)

    step = jax.checkpoint(step) if remat else step

    def forward(params, x):
        x, saved = lax.scan(step, x, params)
        return (x, saved) if not marked else x

    return forward


def loss_of(forward, marked):
    def loss(params, x):
        out = forward(params, x)
        if marked:
            return jnp.mean(out**2)
        y, saved = out
        return jnp.mean(y**2), saved

    return loss


def block_all(tree):
    jax.block_until_ready(tree)


def transformer():
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, DIM))
    print(
        f"Transformer-like stack: {BLOCKS} blocks, batch {BATCH}, seq {SEQ}, width {DIM}, "
        f"MLP {HIDDEN}; attention output and MLP hidden of every block saved"
    )
    for remat in (False, True):
        for mode in ("forward", "value_and_grad"):
            fwd_m, fwd_h = make(remat, True), make(remat, False)
            if mode == "forward":
                pulled, hand = jax.jit(stx.pull(fwd_m)), jax.jit(fwd_h)
            else:
                pulled = jax.jit(stx.pull(jax.value_and_grad(loss_of(fwd_m, True))))
                hand = jax.jit(jax.value_and_grad(loss_of(fwd_h, False), has_aux=True))
            _, inters = pulled(params, x)
            assert inters["attn_0"].shape == (BLOCKS, BATCH, SEQ, DIM)
            label = f"{mode}{' + checkpoint' if remat else ''}"
            report(
                f"runtime  jit(pull(f)) / by hand, {label}",
                "<= 1.05",
                *interleaved_ratio(
                    lambda: block_all(pulled(params, x)),
                    lambda: block_all(hand(params, x)),
                    repeats=9,
                ),
            )
            mem_p = pulled.lower(params, x).compile().memory_analysis().temp_size_in_bytes
            mem_h = hand.lower(params, x).compile().memory_analysis().temp_size_in_bytes
            print(
                f"{'temp mem ' + label:<58} {mem_p / 2**20:8.2f} MiB vs {mem_h / 2**20:8.2f} "
                f"MiB (goal: equal)  ratio {mem_p / mem_h:.3f}"
            )


def chain(n_eqns):
    def f(x):
        for i in range(n_eqns // 2):
            x = jnp.sin(x) * 1.0001
            if i % 5 == 0:
                x = stx.save_inter(x, name="v")
        return x

    return f


def scaling():
    print("Trace-and-rewrite time per equation (goal: within 2x across sizes)")
    per_eqn = {}
    for n in (1_000, 10_000, 50_000):
        f = chain(n)
        start = time.perf_counter()
        closed = jax.make_jaxpr(f)(1.0)
        traced = time.perf_counter()
        _, metas, _ = stx.extend.pull_jaxpr(closed)
        done = time.perf_counter()
        count = len(closed.jaxpr.eqns)
        per_eqn[n] = (done - start) / count
        print(
            f"  {count:>6} equations, {len(metas):>5} marks: make_jaxpr {traced - start:6.2f} s, "
            f"pull_jaxpr {done - traced:6.3f} s, total {per_eqn[n] * 1e6:6.1f} us/equation"
        )
    spread = max(per_eqn.values()) / min(per_eqn.values())
    print(f"  largest / smallest time per equation: {spread:.2f}")


if __name__ == "__main__":
    transformer()
    scaling()

"""Cost of reading the backward pass: a jitted training step with the cotangent of every block
summarized in-graph, against the same step not reading it.

A 16-block MLP (width 512, batch 256), a training step of `value_and_grad` and an SGD update.
With `stx.pull(step, cotangents=True, summarize=...)`, each block's output and its cotangent
are reduced in the program to a gradient-health row (L2 norm, RMS, all finite), the table
Levanter writes by hand; against the step without it. Median ratio over interleaved runs
(goal <= 1.1); and with `stx.stats`, whose exponent histogram costs more (no goal). Then the
HLO: a step whose marks are pulled with `cotangents=True` but not read
(`only=` selects none) compiles to exactly the plain step's program.

Run: `python benchmarks/bench_cotangents.py`.
"""

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report

import statax as stx
from statax.testing import hlo_ops

DEPTH, WIDTH, BATCH = 16, 512, 256


def loss(params, x, marked=True):
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if marked:
            x = stx.save_inter(x, name=f"block{i}")
    return jnp.mean(x**2)


def health(x):
    """A gradient-health row from one pass over the array: L2 norm, RMS, and whether every entry
    is finite (a NaN or an Inf makes the sum of squares non-finite)."""
    square = jnp.sum(jnp.square(x.astype(jnp.float32)))
    return {
        "norm": jnp.sqrt(square),
        "rms": jnp.sqrt(square / x.size),
        "finite": jnp.isfinite(square),
    }


def make_step(read):
    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value

    def plain(params, x):
        value, grads = jax.value_and_grad(lambda p, x: loss(p, x, marked=False))(params, x)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value

    if read == "summaries":
        return jax.jit(stx.pull(step, cotangents=True, summarize=health))
    if read == "values":
        return jax.jit(stx.pull(step, summarize=health))
    if read == "stats":
        return jax.jit(stx.pull(step, cotangents=True, summarize=stx.stats))
    if read == "unread":
        return jax.jit(stx.pull(step, cotangents=True, only=lambda meta: False))
    return jax.jit(lambda params, x: (plain(params, x), {}))


def main():
    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, DEPTH + 1)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:DEPTH]]
    x = jax.random.normal(keys[-1], (BATCH, WIDTH))
    read, plain = make_step("summaries"), make_step("plain")
    (_, _), table = read(params, x)
    assert len(table) == 2 * DEPTH and "block0_0.grad" in table

    def run(step):
        return lambda: jax.block_until_ready(step(params, x))

    print(f"JAX {jax.__version__}, {jax.devices()[0].platform}")
    ratio, cand, base = interleaved_ratio(run(read), run(plain), repeats=21)
    report(
        "runtime, step + cotangent health of 16 blocks / plain step", "<= 1.1", ratio, cand, base
    )
    ratio, cand, base = interleaved_ratio(run(make_step("values")), run(plain), repeats=21)
    report("  the blocks' values' health only (no cotangents)", "-", ratio, cand, base)
    ratio, cand, base = interleaved_ratio(run(make_step("stats")), run(plain), repeats=21)
    report("  cotangents and values with stx.stats (exponent histogram)", "-", ratio, cand, base)
    unread, plain_ops = hlo_ops(make_step("unread"), params, x), hlo_ops(plain, params, x)
    same = "equal" if unread == plain_ops else "DIFFERENT"
    print(
        f"HLO, step pulled with cotangents=True, none read / plain step: {same} "
        f"({len(unread)} / {len(plain_ops)} ops)"
    )


if __name__ == "__main__":
    main()

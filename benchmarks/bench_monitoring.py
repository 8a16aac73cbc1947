"""Cost of tracking `stx.stats` of every layer in a jitted training step.

A 16-layer MLP (width 512, batch 256), a training step of `value_and_grad` and an SGD update,
with the statistics (`stx.stats`: moments, extremes, NaN/Inf counts, exponent histogram) of
all 16 activations computed in-graph by `stx.pull(..., summarize=stx.stats)`, against the
same step without tracking. Median ratio over interleaved runs (goal <= 1.15).

Run: `python benchmarks/bench_monitoring.py`.
"""

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report

import statax as stx

DEPTH, WIDTH, BATCH = 16, 512, 256


def loss(params, x):
    for i, w in enumerate(params):
        x = stx.save_inter(jnp.tanh(x @ w), name=f"layer{i}")
    return jnp.mean(x**2)


def make_step(track):
    @jax.jit
    def step(params, x):
        grad_fn = jax.value_and_grad(loss)
        if track:
            (value, grads), summaries = stx.pull(grad_fn, summarize=stx.stats)(params, x)
        else:
            (value, grads), summaries = grad_fn(params, x), {}
        params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
        return params, value, summaries

    return step


def main():
    keys = jax.random.split(jax.random.key(0), DEPTH)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys]
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    tracked, plain = make_step(True), make_step(False)
    _, _, summaries = tracked(params, x)
    assert len(summaries) == DEPTH
    print(f"16-layer MLP training step, width {WIDTH}, batch {BATCH}; JAX {jax.__version__}")
    report(
        "step with stats of every layer / without",
        "<= 1.15",
        *interleaved_ratio(
            lambda: jax.block_until_ready(tracked(params, x)),
            lambda: jax.block_until_ready(plain(params, x)),
            repeats=31,
        ),
    )


if __name__ == "__main__":
    main()

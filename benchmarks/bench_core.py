"""Core overheads of statax on a 16-layer MLP (width 512, batch 256) saving every activation.

Each figure is a median ratio over interleaved runs against a hand-written baseline:

* runtime of `jit(pull(f))` vs `f` written by hand to return its activations, jitted;
* compile time (lower + compile) of the same two;
* HLO op count of `jit(f)` with unpulled `save_inter`s vs without any;
* trace-and-rewrite time (`make_jaxpr` + `pull_jaxpr`) vs `jax.make_jaxpr` alone;
* second-call time of `pull(jax.jit(f))` vs `jax.jit(f)`, on the MLP and on a tiny function
  (where dispatch overhead is all there is).

Run: `python benchmarks/bench_core.py` (about two minutes on 2 CPU cores).
"""

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report

import statax as stx
from statax.testing import hlo_ops

DEPTH, WIDTH, BATCH = 16, 512, 256


def init(key, width=WIDTH):
    keys = jax.random.split(key, DEPTH)
    return [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]


def marked(params, x):
    for i, w in enumerate(params):
        x = stx.save_inter(jnp.tanh(x @ w), name=f"layer{i}")
    return jnp.sum(x)


def unmarked(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x)


def by_hand(params, x):
    acts = {}
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        acts[f"layer{i}_0"] = x
    return jnp.sum(x), acts


def block(tree):
    jax.block_until_ready(tree)


def main():
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    print(
        f"16-layer MLP, width {WIDTH}, batch {BATCH}, every activation saved; "
        f"JAX {jax.__version__}, {jax.devices()[0].platform}"
    )

    pulled, hand = jax.jit(stx.pull(marked)), jax.jit(by_hand)
    out, acts = pulled(params, x)
    ref_out, ref_acts = hand(params, x)
    assert list(acts) == list(ref_acts) and jnp.allclose(out, ref_out, rtol=1e-4)
    report(
        "runtime  jit(pull(f)) / by hand",
        "<= 1.05",
        *interleaved_ratio(
            lambda: block(pulled(params, x)), lambda: block(hand(params, x)), repeats=31
        ),
    )

    def compile_pulled():
        jax.jit(stx.pull(lambda p, x: marked(p, x))).lower(params, x).compile()

    def compile_hand():
        jax.jit(lambda p, x: by_hand(p, x)).lower(params, x).compile()

    report(
        "compile  jit(pull(f)) / by hand (lower + compile)",
        "<= 1.15",
        *interleaved_ratio(compile_pulled, compile_hand, repeats=11),
    )

    n_marked, n_plain = len(hlo_ops(marked, params, x)), len(hlo_ops(unmarked, params, x))
    same = hlo_ops(marked, params, x) == hlo_ops(unmarked, params, x)
    print(
        f"{'HLO ops  unpulled save_inter / none':<58} {n_marked}/{n_plain}  (goal: equal)   "
        f"identical programs: {same}"
    )

    # Fresh function objects each time, so that no trace or rewrite cache is hit.
    def trace_and_rewrite():
        stx.extend.pull_jaxpr(jax.make_jaxpr(lambda p, x: marked(p, x))(params, x))

    def trace_only():
        jax.make_jaxpr(lambda p, x: marked(p, x))(params, x)

    report(
        "trace    make_jaxpr + pull_jaxpr / make_jaxpr",
        "<= 1.5",
        *interleaved_ratio(trace_and_rewrite, trace_only, repeats=31),
    )

    jitted = jax.jit(marked)
    pulled_jit = stx.pull(jitted)
    report(
        "call     pull(jit(f)) / jit(f), second and later calls",
        "<= 1.3",
        *interleaved_ratio(
            lambda: block(pulled_jit(params, x)), lambda: block(jitted(params, x)), repeats=31
        ),
    )

    def tiny(x):
        return stx.save_inter(x + 1.0, name="y") * 2.0

    small = jnp.ones(4)
    tiny_jit = jax.jit(tiny)
    tiny_pulled = stx.pull(tiny_jit)
    report(
        "call     pull(jit(f)) / jit(f), tiny f (dispatch only)",
        "(info)",
        *interleaved_ratio(
            lambda: block(tiny_pulled(small)), lambda: block(tiny_jit(small)), repeats=201
        ),
        unit="us",
        scale=1e6,
    )


if __name__ == "__main__":
    main()

"""Interventions on a 16-layer MLP (width 512, batch 256) with every activation marked.

Each figure is a median ratio over interleaved runs against a hand-written baseline:

* `jit(grad_inters(loss))` vs `jax.jit(jax.value_and_grad)` of the same loss written by hand to
  take a perturbation at each activation, with respect to zero perturbations (goal <= 1.1);
* `jit(plant(f))` replacing one layer's activation vs `f` written by hand to take it;
* the same two, first call (trace, rewrite and compile: what a user pays once per shape).

Run: `python benchmarks/bench_interventions.py` (about a minute on 2 CPU cores).
"""

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report
from bench_core import BATCH, DEPTH, WIDTH, block, init

import statax as stx


def loss(params, x):
    for i, w in enumerate(params):
        x = stx.save_inter(jnp.tanh(x @ w), name=f"layer{i}")
    return jnp.mean(x**2)


def loss_by_hand(perturbations, params, x):
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w) + perturbations[f"layer{i}_0"]
    return jnp.mean(x**2)


def patched_by_hand(h, params, x):
    for i, w in enumerate(params):
        x = h if i == DEPTH // 2 else jnp.tanh(x @ w)
    return jnp.mean(x**2)


def main():
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    zeros = {f"layer{i}_0": jnp.zeros((BATCH, WIDTH)) for i in range(DEPTH)}
    print(
        f"16-layer MLP, width {WIDTH}, batch {BATCH}, every activation marked; "
        f"JAX {jax.__version__}, {jax.devices()[0].platform}"
    )

    ours = jax.jit(stx.grad_inters(loss))
    hand = jax.jit(jax.value_and_grad(loss_by_hand))
    (value, grads), (ref_value, ref_grads) = ours(params, x), hand(zeros, params, x)
    assert list(grads) == list(ref_grads) and jnp.allclose(value, ref_value)
    assert all(jnp.allclose(grads[k], ref_grads[k], atol=1e-6) for k in grads)
    report(
        "runtime  jit(grad_inters(loss)) / value_and_grad by hand",
        "<= 1.1",
        *interleaved_ratio(
            lambda: block(ours(params, x)), lambda: block(hand(zeros, params, x)), repeats=31
        ),
    )

    h = jnp.ones((BATCH, WIDTH)) * 0.1
    key = f"layer{DEPTH // 2}_0"
    planted = jax.jit(stx.plant(loss))
    patched = jax.jit(patched_by_hand)
    assert jnp.allclose(planted({key: h}, params, x), patched(h, params, x))
    report(
        "runtime  jit(plant(f)) / f taking the value by hand",
        "<= 1.05",
        *interleaved_ratio(
            lambda: block(planted({key: h}, params, x)),
            lambda: block(patched(h, params, x)),
            repeats=31,
        ),
    )

    # First calls: fresh function objects, so that no cache is hit.
    def first_ours():
        block(jax.jit(stx.grad_inters(lambda p, x: loss(p, x)))(params, x))

    def first_hand():
        block(jax.jit(jax.value_and_grad(lambda d, p, x: loss_by_hand(d, p, x)))(zeros, params, x))

    report(
        "first call  grad_inters / by hand (trace + compile + run)",
        "(info)",
        *interleaved_ratio(first_ours, first_hand, repeats=7),
    )


if __name__ == "__main__":
    main()

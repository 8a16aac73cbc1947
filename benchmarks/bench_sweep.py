"""What `stx.sweep` saves: activation patching over a GPT-2-shaped model's residual stream,
12 layers x 16 positions (192 patches), in one compiled program.

1. The sweep against the loop it replaces, 192 jitted `stx.plant` calls (one compiled
   program per layer, as a loop over keys compiles), compilation included on both sides, with
   their results compared (goal >= 10x faster on CPU, equal results).
2. Attribution patching against the exact sweep (goal >= 50x faster).
3. The steady state: the next prompt pair, of the same shapes, through programs compiled
   before; the model jitted (`jax.jit` keeps its trace, so the sweep's program is not traced
   again), and plain (traced again at each sweep, as statax traces any function it was not
   told it may keep the trace of).
4. The compiled chunk program's memory as `batch_size` grows (`memory_analysis()`).

Interleaved runs, medians of REPEATS; each run traces and compiles afresh (new functions, and
`jax.clear_caches()` drops what was compiled before), as a user's first sweep does. Run:
`python benchmarks/bench_sweep.py` (`--gpu` for GPT-2 small's width).
"""

import sys
import time

import _models
import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_medians

import statax as stx

GPU = "--gpu" in sys.argv
LAYERS, POSITIONS, VOCAB = 12, 16, 64
WIDTH, HEADS, BATCH, REPEATS = (768, 12, 8, 3) if GPU else (int(__import__("os").environ.get("W", 64)), 4, 4, 3)


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (VOCAB, WIDTH)),
        "blocks": _models.init_blocks(k2, LAYERS, WIDTH),
        "unembed": jax.random.normal(k3, (WIDTH, VOCAB)) * WIDTH**-0.5,
    }


def gpt(params, ids):
    x = _models.blocks(params["blocks"], params["embed"][ids], HEADS)
    return _models.norm(x) @ params["unembed"]


def metric(logits):  # the logit of token 1 minus token 2 at the last position, per example
    return logits[:, -1, 1] - logits[:, -1, 2]


def inputs():
    rng = np.random.default_rng(0)
    clean = jnp.asarray(rng.integers(0, VOCAB, (BATCH, POSITIONS)))
    corrupted = clean.at[:, 3].set((clean[:, 3] + 7) % VOCAB)  # one token changed
    return clean, corrupted


def main():
    params = init(jax.random.PRNGKey(0))
    clean, corrupted = inputs()

    def fresh():  # a new function each run, traced and compiled afresh: what was compiled
        jax.clear_caches()  # before (programs kept by what they compute) is dropped
        return lambda params, ids: gpt(params, ids)

    def sweep(method="exact", batch_size=64):
        return stx.sweep(
            fresh(),
            metric,
            (params, clean),
            (params, corrupted),
            axes={"position": 1},
            method=method,
            batch_size=batch_size,
            progress=False,
        )

    def loop():
        fn = fresh()
        _, clean_acts = stx.pull(fn)(params, clean)
        _, base_acts = stx.pull(fn)(params, corrupted)
        out = np.zeros((LAYERS, POSITIONS))
        for layer in range(LAYERS):
            key = f"resid_{layer}"
            run = jax.jit(
                lambda value, key=key: jnp.mean(
                    metric(stx.plant(fn)({key: value}, params, corrupted))
                )
            )
            for t in range(POSITIONS):
                patched = base_acts[key].at[:, t].set(clean_acts[key][:, t])
                out[layer, t] = float(run(patched))
        return out

    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}: {LAYERS} layers of width "
        f"{WIDTH}, {POSITIONS} positions, batch {BATCH}: {LAYERS * POSITIONS} patches"
    )
    exact = sweep()
    np.testing.assert_allclose(exact.array(), loop(), rtol=1e-4, atol=1e-4)
    print(f"sweep and loop agree: max |difference| {np.abs(exact.array() - loop()).max():.2e}")
    runs = {"sweep": sweep, "loop": loop, "attribution": lambda: sweep("attribution")}
    t = interleaved_medians(runs, REPEATS, warmup=False)  # (each run compiles afresh)
    print(
        f"{'loop of 192 jitted plant calls / sweep':<44} {t['loop'] / t['sweep']:7.2f}x  "
        f"(goal >= 10)   {t['loop']:.2f} s vs {t['sweep']:.2f} s"
    )
    print(
        f"{'exact sweep / attribution':<44} {t['sweep'] / t['attribution']:7.2f}x  "
        f"(goal >= 50)   {t['sweep']:.2f} s vs {t['attribution']:.2f} s"
    )
    print(f"attribution against exact, correlation {exact.correlation(sweep('attribution')):.3f}")

    # Steady state: the next prompt pair, of the same shapes, through programs compiled before
    # (the sweep keeps them; the loop keeps its jitted functions, one per layer).
    fn = fresh()
    cached_loop = {
        f"resid_{layer}": jax.jit(
            lambda value, key=f"resid_{layer}": jnp.mean(
                metric(stx.plant(fn)({key: value}, params, corrupted))
            )
        )
        for layer in range(LAYERS)
    }

    def loop_again():
        _, clean_acts = stx.pull(jax.jit(fn))(params, clean)
        _, base_acts = stx.pull(jax.jit(fn))(params, corrupted)
        for key, run in cached_loop.items():
            for t in range(POSITIONS):
                float(run(base_acts[key].at[:, t].set(clean_acts[key][:, t])))

    jitted = jax.jit(fn)

    def sweep_again(method="exact", fn=jitted):
        stx.sweep(
            fn,
            metric,
            (params, clean),
            (params, corrupted),
            axes={"position": 1},
            method=method,
            progress=False,
        )

    steady = {
        "loop": loop_again,
        "sweep": sweep_again,
        "attribution": lambda: sweep_again("attribution"),
        "sweep, plain function": lambda: sweep_again(fn=fn),
        "attribution, plain function": lambda: sweep_again("attribution", fn=fn),
    }
    a = interleaved_medians(steady, 2 * REPEATS + 1)  # (the first round compiles)
    print(
        f"{'steady state: loop / sweep':<44} {a['loop'] / a['sweep']:7.2f}x  "
        f"            {a['loop'] * 1e3:.0f} ms vs {a['sweep'] * 1e3:.0f} ms"
    )
    print(
        f"{'steady state: exact sweep / attribution':<44} {a['sweep'] / a['attribution']:7.2f}x  "
        f"            {a['sweep'] * 1e3:.0f} ms vs {a['attribution'] * 1e3:.0f} ms"
    )

    print(
        f"{'steady state, fn not jitted (traced each sweep)':<44} "
        f"exact {a['sweep, plain function'] * 1e3:.0f} ms, "
        f"attribution {a['attribution, plain function'] * 1e3:.0f} ms"
    )

    def loop_of_hooks():  # as a loop over hooks is written: each call traced and compiled
        fn = fresh()
        _, clean_acts = stx.pull(fn)(params, clean)
        out = np.zeros((LAYERS, POSITIONS))
        for layer in range(LAYERS):
            key = f"resid_{layer}"
            for t in range(POSITIONS):
                src = clean_acts[key][:, t]
                hook = lambda v, t=t, src=src: v.at[:, t].set(src)  # noqa: E731
                planted = jax.jit(
                    lambda ids, hook=hook, key=key: stx.plant(fn)({key: hook}, params, ids)
                )
                out[layer, t] = float(jnp.mean(metric(planted(corrupted))))
        return out

    start = time.perf_counter()
    np.testing.assert_allclose(loop_of_hooks(), exact.array(), rtol=1e-4, atol=1e-4)
    hooks = time.perf_counter() - start
    print(
        f"{'loop of 192 hooks, each traced and compiled / sweep':<44} {hooks / t['sweep']:7.2f}x  "
        f"(one run)   {hooks:.2f} s vs {t['sweep']:.2f} s"
    )
    print("memory of one chunk's compiled program as batch_size grows:")
    for batch_size in (1, 8, 32, 64, 192):
        memory = sweep(batch_size=batch_size).memory_analysis()
        print(
            f"  batch_size {batch_size:4d}: temporaries {memory.temp_size_in_bytes / 1e6:8.1f} MB, "
            f"arguments {memory.argument_size_in_bytes / 1e6:6.1f} MB"
        )


if __name__ == "__main__":
    main()

"""What `stx.sweep` saves: activation patching over a GPT-2-shaped model's residual stream,
12 layers x 16 positions (192 patches), in one compiled program.

1. The sweep against the loop it replaces, 192 jitted `stx.plant` calls (one compiled
   program per layer, as a loop over keys compiles), compilation included on both sides, with
   their results compared (goal >= 10x faster on CPU, equal results).
2. Attribution patching against the exact sweep (goal >= 50x faster).
3. The compiled chunk program's memory as `batch_size` grows (`memory_analysis()`).

Interleaved runs, medians of REPEATS; each run traces and compiles afresh (new functions), as
a user's first sweep does. Run: `python benchmarks/bench_sweep.py` (`--gpu` for GPT-2 small's
width).
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import statax as stx

GPU = "--gpu" in sys.argv
LAYERS, POSITIONS, VOCAB = 12, 16, 64
WIDTH, HEADS, BATCH, REPEATS = (768, 12, 8, 3) if GPU else (64, 4, 4, 3)


def init(key):
    keys = jax.random.split(key, LAYERS * 4 + 2)
    s = WIDTH**-0.5
    blocks = [
        {
            "qkv": jax.random.normal(keys[4 * i], (WIDTH, 3 * WIDTH)) * s,
            "proj": jax.random.normal(keys[4 * i + 1], (WIDTH, WIDTH)) * s,
            "up": jax.random.normal(keys[4 * i + 2], (WIDTH, 4 * WIDTH)) * s,
            "down": jax.random.normal(keys[4 * i + 3], (4 * WIDTH, WIDTH)) * s * 0.5,
        }
        for i in range(LAYERS)
    ]
    embed = jax.random.normal(keys[-2], (VOCAB, WIDTH))
    return {
        "embed": embed,
        "blocks": blocks,
        "unembed": jax.random.normal(keys[-1], (WIDTH, VOCAB)) * s,
    }


def norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def block(p, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    attn = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
    x = x + attn @ p["proj"]
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]


def gpt(params, ids):
    x = params["embed"][ids]
    for p in params["blocks"]:
        x = stx.save_inter(block(p, x), name="resid")
    return norm(x) @ params["unembed"]


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

    def fresh():  # a new function each run: traced and compiled afresh
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
    times = {"sweep": [], "loop": [], "attribution": []}
    runs = {"sweep": sweep, "loop": loop, "attribution": lambda: sweep("attribution")}
    for r in range(REPEATS):
        for name in list(runs)[r % 3 :] + list(runs)[: r % 3]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    t = {name: statistics.median(v) for name, v in times.items()}
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

    def sweep_again(method="exact"):
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
    }
    for run in steady.values():
        run()  # compile
    again = {name: [] for name in steady}
    for r in range(2 * REPEATS + 1):
        for name in list(steady)[r % 3 :] + list(steady)[: r % 3]:
            start = time.perf_counter()
            steady[name]()
            again[name].append(time.perf_counter() - start)
    a = {name: statistics.median(v) for name, v in again.items()}
    print(
        f"{'steady state: loop / sweep':<44} {a['loop'] / a['sweep']:7.2f}x  "
        f"            {a['loop'] * 1e3:.0f} ms vs {a['sweep'] * 1e3:.0f} ms"
    )
    print(
        f"{'steady state: exact sweep / attribution':<44} {a['sweep'] / a['attribution']:7.2f}x  "
        f"            {a['sweep'] * 1e3:.0f} ms vs {a['attribution'] * 1e3:.0f} ms"
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

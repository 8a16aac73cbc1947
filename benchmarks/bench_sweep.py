"""What `stx.sweep` costs against the limits: activation patching over a GPT-2-shaped model's
residual stream, every block's output at every position, against the same experiments written
by hand in JAX.

1. The exact sweep against the hand-written batched program (one `jit`: the two runs, then
   `vmap` over chunks of patches, each patch a `where` after the right block): `reuse=False`
   (goal <= 1.05 steady, <= 1.2 with compilation).
2. The sweep with reuse (the default) against the hand-written prefix-reuse program (one
   program per layer that runs only the blocks after its patch, from the base run's value
   there; goal <= 1.1 steady).
3. Attribution against a hand-written `jax.value_and_grad` of the metric with respect to zero
   perturbations at the blocks, plus the clean run (goal <= 1.05 steady).
4. First calls: each of the above traced and compiled afresh (`jax.clear_caches()`), and what
   statax adds to compilation against compiling the model's forward pass and its `grad`
   alone; the loop of jitted `stx.plant` calls, as a figure.
5. A scan over layers (the same blocks stacked): the sweep with reuse against `reuse=False`,
   the prefix-reuse program by hand and the unrolled model's sweep, steady and first call.
6. The persistent compilation cache: a second process's first sweep, the cache filled by a
   first (`jax_compilation_cache_dir`).

Steady state is the next prompt pair of the same shapes (programs compiled before; the model a
`jax.jit`, whose trace JAX keeps). Interleaved runs, medians of REPEATS. Every program is
checked against the others' results first. Run: `python benchmarks/bench_sweep.py` (`--gpu`
for GPT-2 small's width; `--save DIR` writes the weights and inputs for
`envs/transformer_lens/bench_transformer_lens.py`).
"""

import os
import subprocess
import sys
import tempfile
import time

import _models
import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_medians

import statax as stx

GPU = "--gpu" in sys.argv
LAYERS, VOCAB = 12, 64
WIDTH, HEADS, POSITIONS, BATCH, REPEATS = (768, 12, 32, 8, 5) if GPU else (256, 4, 32, 4, 5)
CHUNK = 64  # patches at a time, in the sweep and by hand


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


# ---- the same experiments, by hand ------------------------------------------------------------


def blocks_from(params, x, start, adds=None):
    """Blocks `start...` from `x`, each output plus `adds[i]` where given; their outputs."""
    outs = []
    for i in range(start, LAYERS):
        x = _models.block(params["blocks"][i], x, HEADS)
        if adds is not None:
            x = x + adds[i]
        outs.append(x)
    return x, outs


def head(params, x):
    return jnp.mean(metric(_models.norm(x) @ params["unembed"]))


def acts(params, ids):
    return blocks_from(params, params["embed"][ids], 0)[1]


def positions_mask(t):
    return (jnp.arange(POSITIONS) == t)[None, :, None]


@jax.jit
def by_hand_batched(params, clean, corrupted, layers, positions):
    """The exact sweep in one program: the two runs, then each patch (a block and a position)
    as a `where` after every block, on where it is its own, over a chunk under `vmap`."""
    source = jnp.stack(acts(params, clean))

    def one(layer, t):
        x = params["embed"][corrupted]
        for i in range(LAYERS):
            x = _models.block(params["blocks"][i], x, HEADS)
            x = jnp.where((layer == i) & positions_mask(t), source[i], x)
        return head(params, x)

    return jax.vmap(one)(layers, positions)


def by_hand_prefix(layer):
    """The program of one layer's patches: only the blocks after it, from the base run's value
    there (computed once, by `acts`)."""

    @jax.jit
    def run(params, source, base, positions):
        def one(t):
            x = jnp.where(positions_mask(t), source, base)
            return head(params, blocks_from(params, x, layer + 1)[0])

        return jax.vmap(one)(positions)

    return run


@jax.jit
def by_hand_attribution(params, clean, corrupted):
    """Attribution patching: the clean run, and the metric's gradient with respect to zero
    perturbations added after each block of the corrupted run (its values the aux)."""
    source = acts(params, clean)

    def loss(adds):
        x, outs = blocks_from(params, params["embed"][corrupted], 0, adds)
        return head(params, x), outs

    zeros = [jnp.zeros((*corrupted.shape, WIDTH))] * LAYERS
    (value, base), grads = jax.value_and_grad(loss, has_aux=True)(zeros)
    return jnp.stack(
        [value + jnp.sum((s - b) * g, axis=(0, 2)) for s, b, g in zip(source, base, grads)]
    )


def ratios(times: dict, rows: list) -> None:
    """One line per `(a, b, goal)`: the ratio of the two runs' times, the goal, the times."""
    for a, b, goal in rows:
        print(
            f"  {f'{a} / {b}':<44} {times[a] / times[b]:6.2f}  (goal {goal or '-':>7})   "
            f"{times[a]:.3f} s vs {times[b]:.3f} s"
        )


def main():
    params = init(jax.random.PRNGKey(0))
    clean, corrupted = inputs()
    if "--save" in sys.argv:  # the weights and inputs, for TransformerLens
        folder = sys.argv[sys.argv.index("--save") + 1]
        flat = {
            f"blocks.{i}.{k}": np.asarray(v)
            for i, b in enumerate(params["blocks"])
            for k, v in b.items()
        }
        np.savez(
            os.path.join(folder, "gpt.npz"),
            embed=np.asarray(params["embed"]),
            unembed=np.asarray(params["unembed"]),
            clean=np.asarray(clean),
            corrupted=np.asarray(corrupted),
            heads=HEADS,
            **flat,
        )
    patches = [(layer, t) for layer in range(LAYERS) for t in range(POSITIONS)]
    layers = jnp.asarray([p[0] for p in patches], jnp.int32)
    positions = jnp.asarray([p[1] for p in patches], jnp.int32)

    def sweep(fn, method="exact", reuse=True):
        return stx.sweep(
            fn,
            metric,
            (params, clean),
            (params, corrupted),
            axes={"position": 1},
            method=method,
            reuse=reuse,
            batch_size=CHUNK,
            progress=False,
        )

    def batched():
        out = [
            by_hand_batched(
                params, clean, corrupted, layers[i : i + CHUNK], positions[i : i + CHUNK]
            )
            for i in range(0, len(patches), CHUNK)
        ]
        return np.concatenate([np.asarray(o) for o in out]).reshape(LAYERS, POSITIONS)

    prefix_programs = [by_hand_prefix(layer) for layer in range(LAYERS)]

    def prefix():
        source, base = acts(params, clean), acts(params, corrupted)
        t = jnp.arange(POSITIONS, dtype=jnp.int32)
        out = [p(params, s, b, t) for p, s, b in zip(prefix_programs, source, base)]
        return np.stack([np.asarray(o) for o in out])

    def attribution():
        return np.asarray(by_hand_attribution(params, clean, corrupted))

    jitted = jax.jit(lambda p, i: gpt(p, i))
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}: {LAYERS} layers of width "
        f"{WIDTH}, {POSITIONS} positions, batch {BATCH}: {len(patches)} patches, "
        f"{CHUNK} at a time"
    )
    exact = sweep(jitted).array()
    for name, got in [
        ("sweep, reuse=False", sweep(jitted, reuse=False).array()),
        ("by hand, batched", batched()),
        ("by hand, prefix reuse", prefix()),
    ]:
        print(f"  {name} agrees with the sweep to {np.abs(got - exact).max():.1e}")
        np.testing.assert_allclose(got, exact, rtol=1e-3, atol=1e-3)
    estimate = sweep(jitted, "attribution").array()
    if "--save" in sys.argv:  # statax's results, for TransformerLens's to be checked against
        folder = sys.argv[sys.argv.index("--save") + 1]
        np.savez(os.path.join(folder, "sweep.npz"), exact=exact, attribution=estimate)
    np.testing.assert_allclose(attribution(), estimate, rtol=1e-3, atol=1e-3)
    print(f"  attribution by hand agrees to {np.abs(attribution() - estimate).max():.1e}")

    steady = {
        "sweep": lambda: sweep(jitted),
        "sweep, reuse=False": lambda: sweep(jitted, reuse=False),
        "by hand, batched": batched,
        "by hand, prefix reuse": prefix,
        "attribution": lambda: sweep(jitted, "attribution"),
        "attribution by hand": attribution,
    }
    t = interleaved_medians(steady, REPEATS)
    print("steady state (the next prompt pair):")
    ratios(
        t,
        [
            ("sweep, reuse=False", "by hand, batched", "<= 1.05"),
            ("sweep", "by hand, prefix reuse", "<= 1.1"),
            ("sweep", "sweep, reuse=False", ""),
            ("attribution", "attribution by hand", "<= 1.05"),
        ],
    )

    # Attribution at 4 times the batch: the host's work per call (tracing the two runs, which
    # keeps every answer fresh) is the same, and the program is longer.
    big = [jnp.tile(x, (4, 1)) for x in (clean, corrupted)]
    a = interleaved_medians(
        {
            "attribution, 4x the batch": lambda: stx.sweep(
                jitted,
                metric,
                (params, big[0]),
                (params, big[1]),
                axes={"position": 1},
                method="attribution",
                progress=False,
            ).array(),
            "attribution by hand, 4x the batch": lambda: np.asarray(
                by_hand_attribution(params, *big)
            ),
        },
        REPEATS,
    )
    ratios(a, [("attribution, 4x the batch", "attribution by hand, 4x the batch", "<= 1.05")])

    # A scan over layers (the blocks' weights stacked), each row (layer) and position patched:
    # with reuse, a chunk holds one row's patches (32 of the 64 asked), and starts the loop's
    # work at that row.
    stacked = {
        "embed": params["embed"],
        "unembed": params["unembed"],
        "blocks": jax.tree.map(lambda *a: jnp.stack(a), *params["blocks"]),
    }

    def scan_model():
        def scanned(p, ids):
            def body(x, w):
                return stx.save_inter(_models.block(w, x, HEADS), name="resid"), None

            x, _ = jax.lax.scan(body, p["embed"][ids], p["blocks"])
            return _models.norm(x) @ p["unembed"]

        return jax.jit(scanned)

    scanned = scan_model()

    def scan_sweep(fn, reuse=True):
        return stx.sweep(
            fn,
            metric,
            (stacked, clean),
            (stacked, corrupted),
            axes={"layer": 0, "position": 2},
            reuse=reuse,
            batch_size=CHUNK,
            progress=False,
        )

    np.testing.assert_allclose(scan_sweep(scanned).array()[0], exact, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(scan_sweep(scanned, False).array()[0], exact, rtol=1e-3, atol=1e-3)
    s = interleaved_medians(
        {
            "sweep, a scan": lambda: scan_sweep(scanned),
            "sweep, a scan, reuse=False": lambda: scan_sweep(scanned, False),
            "sweep": lambda: sweep(jitted),
            "by hand, prefix reuse": prefix,
        },
        REPEATS,
    )
    print("a scan over layers, steady state:")
    ratios(
        s,
        [
            ("sweep, a scan", "sweep, a scan, reuse=False", ""),
            ("sweep, a scan", "by hand, prefix reuse", "<= 1.1"),
            ("sweep, a scan", "sweep", ""),
        ],
    )

    # First calls: traced and compiled afresh.
    def fresh(run):
        def first():
            jax.clear_caches()
            return run()

        return first

    def fresh_model():
        return jax.jit(lambda p, i: gpt(p, i))

    def loop():  # the loop of jitted plant calls it replaces (one program per layer)
        fn = fresh_model()
        _, clean_acts = stx.pull(fn)(params, clean)
        _, base_acts = stx.pull(fn)(params, corrupted)
        for layer in range(LAYERS):
            key = f"resid_{layer}"
            run = jax.jit(
                lambda value, key=key: jnp.mean(
                    metric(stx.plant(fn)({key: value}, params, corrupted))
                )
            )
            for p in range(POSITIONS):
                float(run(base_acts[key].at[:, p].set(clean_acts[key][:, p])))

    def prefix_fresh():
        prefix_programs[:] = [by_hand_prefix(layer) for layer in range(LAYERS)]
        return prefix()

    def compile_forward():
        jax.jit(gpt).lower(params, corrupted).compile()

    def compile_grad():
        jax.jit(jax.grad(lambda p, i: jnp.mean(metric(gpt(p, i))))).lower(
            params, corrupted
        ).compile()

    first = {
        "sweep": fresh(lambda: sweep(fresh_model())),
        "sweep, reuse=False": fresh(lambda: sweep(fresh_model(), reuse=False)),
        "by hand, batched": fresh(batched),
        "by hand, prefix reuse": fresh(prefix_fresh),
        "attribution": fresh(lambda: sweep(fresh_model(), "attribution")),
        "attribution by hand": fresh(attribution),
        "compile the forward pass": fresh(compile_forward),
        "compile its grad": fresh(compile_grad),
        "loop of jitted plant calls": fresh(loop),
        "sweep, a scan": fresh(lambda: scan_sweep(scan_model())),
        "sweep, a scan, reuse=False": fresh(lambda: scan_sweep(scan_model(), False)),
    }
    f = interleaved_medians(first, max(1, REPEATS // 2), warmup=False)
    print("first calls (traced and compiled afresh):")
    for name, seconds in f.items():
        print(f"  {name:<44} {seconds:6.2f} s")
    ratios(
        f,
        [
            ("sweep, reuse=False", "by hand, batched", "<= 1.2"),
            ("sweep", "by hand, batched", "<= 1.2"),
            ("sweep", "by hand, prefix reuse", ""),
            ("attribution", "attribution by hand", ""),
            ("loop of jitted plant calls", "sweep", ""),
            ("sweep, a scan", "sweep", ""),
            ("sweep, a scan", "sweep, a scan, reuse=False", ""),
        ],
    )

    # The persistent compilation cache: a fresh process's first sweep, twice.
    with tempfile.TemporaryDirectory() as cache:
        script = os.path.abspath(__file__)
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            subprocess.run([sys.executable, script, "--first-sweep", cache], check=True)
            runs.append(time.perf_counter() - start)
        print(
            f"a new process's first sweep (import, trace, compile, run): {runs[0]:.2f} s with an "
            f"empty persistent cache, {runs[1]:.2f} s with the first one's "
            f"({runs[1] / runs[0]:.2f})"
        )


def first_sweep(cache):
    """One sweep in a new process, with JAX's persistent compilation cache in `cache`."""
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    params = init(jax.random.PRNGKey(0))
    clean, corrupted = inputs()
    stx.sweep(
        jax.jit(gpt),
        metric,
        (params, clean),
        (params, corrupted),
        axes={"position": 1},
        progress=False,
    )


if __name__ == "__main__":
    if "--first-sweep" in sys.argv:
        first_sweep(sys.argv[sys.argv.index("--first-sweep") + 1])
    else:
        main()

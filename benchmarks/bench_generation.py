"""What reading and steering a generation costs: a GPT-2-shaped decoder (12 layers, a KV cache,
greedy, one token per `while_loop` iteration) generating 64 tokens after a 16-token prompt.

1. Steered generation (`stx.plant` with a hook adding a vector to every block's output, at every
   generated token) / plain generation (goal <= 1.05), and the same steering written into the
   model by hand / plain, for reference.
2. Capturing every generated token's output of every block (`stx.pull(generate, steps=64)`, the
   rows left on the device) / plain generation (goal <= 1.15).
3. Compile time of each / plain (goal <= 1.2): a new `jax.jit(...)` traced, lowered and
   compiled, medians of 5 interleaved.
4. Peak memory of the capturing program against plain generation plus the rows it returns
   (`compiled.memory_analysis()`): the bound is what the rows cost, `steps` x layers x batch x
   width x 4 bytes.

Interleaved runs, medians of REPEATS, each run a compiled call on device arrays (what a user
pays per generation once compiled). Run: `python benchmarks/bench_generation.py` (the width is
for CPU; `--gpu` for GPT-2 small's).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_medians

import statax as stx

GPU = "--gpu" in sys.argv
LAYERS, WIDTH, VOCAB = 12, (768 if GPU else 256), 512
BATCH, PROMPT, NEW, REPEATS = (8 if GPU else 4), 16, 64, 31
MAX = PROMPT + NEW


def init(key):
    keys = iter(jax.random.split(key, 3 + 5 * LAYERS))
    normal = lambda *s: jax.random.normal(next(keys), s) / np.sqrt(s[0])  # noqa: E731
    layers = [
        dict(q=normal(WIDTH, WIDTH), k=normal(WIDTH, WIDTH), v=normal(WIDTH, WIDTH),
             o=normal(WIDTH, WIDTH), mlp=normal(WIDTH, WIDTH))
        for _ in range(LAYERS)
    ]  # fmt: skip
    return dict(embed=normal(VOCAB, WIDTH), pos=normal(MAX, WIDTH), layers=layers,
                out=normal(WIDTH, VOCAB))  # fmt: skip


def forward(params, tokens, start, cache, steer=None):
    """The decoder on `tokens` (B, T) at positions `start..`: logits and the new cache. Each
    block's output is marked `block`; `steer`, a vector added to it (the edit by hand)."""
    T = tokens.shape[1]
    positions = start + jnp.arange(T)
    h = params["embed"][tokens] + params["pos"][positions]
    new = []
    for p, (keys, values) in zip(params["layers"], cache, strict=True):
        keys = jax.lax.dynamic_update_slice_in_dim(keys, h @ p["k"], start, 1)
        values = jax.lax.dynamic_update_slice_in_dim(values, h @ p["v"], start, 1)
        scores = jnp.einsum("btd,bsd->bts", h @ p["q"], keys) / np.sqrt(WIDTH)
        scores = jnp.where(jnp.arange(MAX) <= positions[:, None], scores, -1e9)
        h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), values) @ p["o"]
        h = h + jnp.tanh(h @ p["mlp"])
        if steer is not None:
            h = h + steer
        h = stx.save_inter(h, name="block")
        new.append((keys, values))
    return h @ params["out"], new


def generate(params, prompt, steer=None):
    cache = [(jnp.zeros((BATCH, MAX, WIDTH)),) * 2 for _ in range(LAYERS)]
    logits, cache = forward(params, prompt, 0, cache)  # (the prompt's call: not steered)
    tokens = jnp.zeros((BATCH, MAX), jnp.int32).at[:, :PROMPT].set(prompt)
    tokens = tokens.at[:, PROMPT].set(jnp.argmax(logits[:, -1], -1))

    def step(c):
        n, tokens, cache = c
        last = jax.lax.dynamic_slice_in_dim(tokens, n - 1, 1, 1)
        logits, cache = forward(params, last, n - 1, cache, steer)
        return n + 1, tokens.at[:, n].set(jnp.argmax(logits[:, 0], -1)), cache

    return jax.lax.while_loop(lambda c: c[0] < MAX, step, (PROMPT + 1, tokens, cache))[1]


def generate_captured_by_hand(params, prompt):
    """`generate` returning what `stx.pull(generate, steps=NEW)` returns, written by hand: the
    prompt's block outputs, and every loop iteration's in rows carried through the loop."""
    cache = [(jnp.zeros((BATCH, MAX, WIDTH)),) * 2 for _ in range(LAYERS)]
    (logits, cache), first = stx.pull(forward)(params, prompt, 0, cache)
    tokens = jnp.zeros((BATCH, MAX), jnp.int32).at[:, :PROMPT].set(prompt)
    tokens = tokens.at[:, PROMPT].set(jnp.argmax(logits[:, -1], -1))
    rows = jnp.zeros((LAYERS, NEW, BATCH, 1, WIDTH))

    def step(c):
        n, tokens, cache, rows = c
        last = jax.lax.dynamic_slice_in_dim(tokens, n - 1, 1, 1)
        (logits, cache), inters = stx.pull(forward)(params, last, n - 1, cache)
        h = jnp.stack([inters[f"block_{i}"] for i in range(LAYERS)])
        rows = jax.lax.dynamic_update_index_in_dim(rows, h, n - PROMPT - 1, 1)
        return n + 1, tokens.at[:, n].set(jnp.argmax(logits[:, 0], -1)), cache, rows

    _, tokens, _, rows = jax.lax.while_loop(
        lambda c: c[0] < MAX, step, (PROMPT + 1, tokens, cache, rows)
    )
    return tokens, first, rows


def main():
    params = init(jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, VOCAB)
    d = 0.1 * jax.random.normal(jax.random.key(2), (WIDTH,))
    # The loop's marks are `block_12` .. `block_23` (the prompt's call made `block_0` .. `_11`).
    loop_keys = [f"block_{LAYERS + i}" for i in range(LAYERS)]

    def steered(params, prompt, d):  # one hook, at every block's mark in the loop
        steer = lambda h: h + d  # noqa: E731
        return stx.plant(generate)(dict.fromkeys(loop_keys, steer), params, prompt)

    programs = {
        "plain": jax.jit(generate),
        "steered by hand": jax.jit(generate),
        "stx.plant steering": jax.jit(steered),
        "stx.pull(steps=NEW) every block, every token": jax.jit(
            lambda params, prompt: stx.pull(generate, steps=NEW)(params, prompt)
        ),
        "the same captures by hand": jax.jit(generate_captured_by_hand),
    }
    inputs = {
        "the same captures by hand": (params, prompt),
        "plain": (params, prompt),
        "steered by hand": (params, prompt, d),
        "stx.plant steering": (params, prompt, d),
        "stx.pull(steps=NEW) every block, every token": (params, prompt),
    }
    compiled = {name: program.lower(*inputs[name]).compile() for name, program in programs.items()}
    # Compile time as a user pays it: a new `jax.jit` traced, lowered and compiled, interleaved.
    fresh = {
        "plain": lambda: jax.jit(lambda params, prompt: generate(params, prompt)),
        "steered by hand": lambda: jax.jit(lambda params, p, d: generate(params, p, d)),
        "stx.plant steering": lambda: jax.jit(lambda params, p, d: steered(params, p, d)),
        "stx.pull(steps=NEW) every block, every token": lambda: jax.jit(
            lambda params, prompt: stx.pull(generate, steps=NEW)(params, prompt)
        ),
        "the same captures by hand": lambda: jax.jit(
            lambda params, prompt: generate_captured_by_hand(params, prompt)
        ),
    }
    compile_s = interleaved_medians(
        {n: (lambda n=n: fresh[n]().lower(*inputs[n]).compile()) for n in fresh}, 5, warmup=False
    )
    # The steered generations agree with the model edited by hand.
    by_hand = compiled["steered by hand"](*inputs["steered by hand"])
    assert np.array_equal(compiled["stx.plant steering"](*inputs["stx.plant steering"]), by_hand)
    rows = compiled["stx.pull(steps=NEW) every block, every token"](*inputs[
        "stx.pull(steps=NEW) every block, every token"])[1]  # fmt: skip
    assert rows["block_12"].shape == (NEW, BATCH, 1, WIDTH)
    runs = {
        name: (lambda c=c, a=inputs[name]: jax.block_until_ready(c(*a)))
        for name, c in compiled.items()
    }
    times = interleaved_medians(runs, REPEATS)
    base = times["plain"]
    platform = jax.devices()[0].platform
    print(f"{LAYERS} layers, width {WIDTH}, batch {BATCH}, {PROMPT}-token prompt, {NEW} new "
          f"tokens; medians of {REPEATS} interleaved runs ({platform})")  # fmt: skip
    print(f"{'':<48} {'run / plain':>12} {'compile / plain':>16}")
    goals = {"stx.plant steering": "<= 1.05", "stx.pull(steps=NEW) every block, every token":
             "<= 1.15"}  # fmt: skip
    for name in programs:
        print(
            f"{name:<48} {times[name] / base:12.3f} {compile_s[name] / compile_s['plain']:16.3f}"
            f"   ({times[name] * 1e3:.1f} ms, compile {compile_s[name]:.2f} s)"
            + (f"  goal {goals[name]}, compile <= 1.2" if name in goals else "")
        )
    pulled = times["stx.pull(steps=NEW) every block, every token"]
    by_hand = times["the same captures by hand"]
    print(f"capturing: stx.pull / the same captures by hand {pulled / by_hand:.3f}")
    plain_mem = compiled["plain"].memory_analysis()
    pulled_mem = compiled["stx.pull(steps=NEW) every block, every token"].memory_analysis()
    bound = NEW * LAYERS * BATCH * WIDTH * 4  # the rows of the loop's marks
    prompt_rows = LAYERS * BATCH * PROMPT * WIDTH * 4  # (the prompt's call, also returned)

    def peak(m):
        return m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes

    extra = peak(pulled_mem) - peak(plain_mem)
    print(
        f"peak memory: plain {peak(plain_mem) / 2**20:.1f} MiB, capturing "
        f"{peak(pulled_mem) / 2**20:.1f} MiB: {extra / 2**20:.1f} MiB more, against the rows' "
        f"{(bound + prompt_rows) / 2**20:.1f} MiB ({extra / (bound + prompt_rows):.2f}x)"
    )


if __name__ == "__main__":
    main()

"""Generation read and steered step by step: Hugging Face Flax GPT-2's `generate` (a
`while_loop`) and hand-written KV-cache decoders (`scan` and `while_loop`), each against a
Python loop that calls the model on the whole sequence, one token at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

# ---- a hand-written decoder with a KV cache ---------------------------------------------------

D, V, L, MAX = 16, 23, 2, 12  # width, vocabulary, layers, cache length


def _params(seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * L))
    normal = lambda *s: jax.random.normal(next(keys), s) * 0.3  # noqa: E731
    layers = [
        dict(q=normal(D, D), k=normal(D, D), v=normal(D, D), o=normal(D, D)) for _ in range(L)
    ]
    return dict(embed=normal(V, D), pos=normal(MAX, D), layers=layers, out=normal(D, V))


def _block(p, h, keys, values, positions):
    """One layer on new positions `h` (T, D), attending to the cache `keys`/`values` (MAX, D)
    up to each position; marks its output `block`."""
    q = h @ p["q"]
    scores = q @ keys.T / jnp.sqrt(D)
    scores = jnp.where(jnp.arange(MAX)[None] <= positions[:, None], scores, -1e9)
    h = h + jax.nn.softmax(scores) @ values @ p["o"]
    return stx.save_inter(jnp.tanh(h), name="block")


def _forward(params, tokens, start, cache):
    """The model on `tokens` (T,) at positions `start..`: logits (T, V) and the new cache."""
    positions = start + jnp.arange(tokens.shape[0])
    h = params["embed"][tokens] + params["pos"][positions]
    new = []
    for p, (keys, values) in zip(params["layers"], cache, strict=True):
        keys = jax.lax.dynamic_update_slice_in_dim(keys, h @ p["k"], start, 0)
        values = jax.lax.dynamic_update_slice_in_dim(values, h @ p["v"], start, 0)
        h = _block(p, h, keys, values, positions)
        new.append((keys, values))
    return h @ params["out"], new


def _empty_cache():
    return [(jnp.zeros((MAX, D)), jnp.zeros((MAX, D))) for _ in range(L)]


EOS = 3


def decode_while(params, prompt, new_tokens):
    """Greedy decoding with a cache in a `while_loop` that stops at EOS: the prompt (P,) in
    one call, then one token per iteration. Returns the tokens (MAX,) and how many."""
    P = prompt.shape[0]
    logits, cache = _forward(params, prompt, 0, _empty_cache())
    tokens = jnp.zeros(MAX, jnp.int32).at[:P].set(prompt).at[P].set(jnp.argmax(logits[-1]))

    def go_on(c):
        n, tokens, _ = c
        return (n < P + new_tokens) & (tokens[n - 1] != EOS) & (n < MAX)

    def step(c):
        n, tokens, cache = c
        logits, cache = _forward(params, tokens[n - 1][None], n - 1, cache)
        return n + 1, tokens.at[n].set(jnp.argmax(logits[0])), cache

    n, tokens, _ = jax.lax.while_loop(go_on, step, (P + 1, tokens, cache))
    return tokens, n


def decode_scan(params, prompt, new_tokens: int):
    """The same, `new_tokens` tokens without stopping, in a `scan`."""
    P = prompt.shape[0]
    logits, cache = _forward(params, prompt, 0, _empty_cache())
    first = jnp.argmax(logits[-1])

    def step(c, n):
        token, cache = c
        logits, cache = _forward(params, token[None], n, cache)
        nxt = jnp.argmax(logits[0])
        return (nxt, cache), nxt

    _, rest = jax.lax.scan(step, (first, cache), P + jnp.arange(new_tokens - 1))
    return jnp.concatenate([prompt, first[None], rest])


def by_hand(params, prompt, new_tokens, edit=None, stop=True):
    """A Python loop: the whole sequence through the model (no cache) for each new token; the
    last position's block outputs per layer, per step. `edit(h, layer)` changes a layer's block
    output over all positions (pulled once, outside any loop: `plant` of one forward)."""
    tokens, rows = list(map(int, prompt)), []
    f = lambda seq: _forward(params, seq, 0, _empty_cache())[0]  # noqa: E731
    for _ in range(new_tokens):
        seq = jnp.asarray(tokens, jnp.int32)
        if edit is None:
            logits, inters = stx.pull(f)(seq)
        else:
            logits = stx.plant(f)(edit(len(tokens)), seq)
            inters = stx.pull(f)(seq)[1]
        rows.append([inters[f"block_{i}"][-1] for i in range(L)])
        tokens.append(int(jnp.argmax(logits[-1])))
        if stop and tokens[-1] == EOS:
            break
    return tokens, rows


PROMPTS = [jnp.array([1, 5, 7]), jnp.array([2, 9, 4]), jnp.array([6, 1, 8])]


@pytest.mark.parametrize(
    "prompt", [0, *(pytest.param(i, marks=pytest.mark.exhaustive) for i in (1, 2))]
)
def test_while_decoder_every_token_as_the_python_loop(prompt):
    params, prompt = _params(), PROMPTS[prompt]
    P, new = prompt.shape[0], 6
    (tokens, n), inters = stx.pull(decode_while, steps=8, ran=True)(params, prompt, new)
    want, rows = by_hand(params, prompt, new)
    assert list(map(int, tokens[: int(n)])) == want
    # Keys: the prompt's call (block_0, block_1), then the loop's (rows of every step).
    steps = int(n) - P - 1  # the tokens after the first come from the loop
    assert inters["block_2"].shape == (8, 1, D)
    np.testing.assert_array_equal(inters["block_2.ran"], np.arange(8) < steps)
    for s in range(steps):  # step s feeds position P + s: its row is that position's
        for i in range(L):
            np.testing.assert_allclose(inters[f"block_{2 + i}"][s, 0], rows[s + 1][i], atol=2e-5)
    for i in range(L):  # and the prompt's call, the last prompt position
        np.testing.assert_allclose(inters[f"block_{i}"][-1], rows[0][i], atol=2e-5)
    # The round trip: every row planted back.
    values = {k: v for k, v in inters.items() if not k.endswith(".ran")}
    np.testing.assert_array_equal(
        stx.plant(decode_while, steps=8)(values, params, prompt, new)[0], tokens
    )


def test_scan_decoder_stacks_every_step():
    params, prompt = _params(), PROMPTS[0]
    tokens, inters = stx.pull(decode_scan)(params, prompt, 6)
    want, rows = by_hand(params, prompt, 6, stop=False)
    assert list(map(int, tokens)) == want
    for s in range(5):
        np.testing.assert_allclose(inters["block_2"][s, 0], rows[s + 1][0], atol=2e-5)


def _add_from(position, d):
    """By hand: `d` added to layer 0's block output from `position` on (the plain forward)."""
    return lambda length: {"block_0": lambda h: h.at[position:].add(d)}


@pytest.mark.parametrize("decode", ["while", pytest.param("scan", marks=pytest.mark.exhaustive)])
def test_steering_and_one_step_edits_as_the_python_loop(decode):
    params, prompt = _params(1), PROMPTS[1]
    P = prompt.shape[0]
    d = 2.0 * jax.random.normal(jax.random.key(5), (D,))
    run = (
        (lambda v, p, x: stx.plant(decode_while)(v, p, x, 6)[0])
        if decode == "while"
        else (lambda v, p, x: stx.plant(decode_scan)(v, p, x, 6))
    )
    # Steering every generated token: the loop's layer-0 mark, every step.
    steer = lambda h: h + d  # noqa: E731
    got = run({"block_2": steer}, params, prompt)
    want, _ = by_hand(params, prompt, 6, edit=_add_from(P, d), stop=decode == "while")
    assert list(map(int, got[: len(want)])) == want
    # From the third generated token on (loop step 1 feeds position P + 1), and one step only.
    later = lambda h, step: jnp.where(step >= 1, h + d, h)  # noqa: E731
    got = run({"block_2": later}, params, prompt)
    want, _ = by_hand(params, prompt, 6, edit=_add_from(P + 1, d), stop=decode == "while")
    assert list(map(int, got[: len(want)])) == want

    def only(length):  # by hand: position P + 2 alone
        return {"block_0": lambda h: h.at[P + 2 : P + 3].add(d)}

    once = lambda h, step: jnp.where(step == 2, h + d, h)  # noqa: E731
    got = run({"block_2": once}, params, prompt)
    want, _ = by_hand(params, prompt, 6, edit=only, stop=decode == "while")
    assert list(map(int, got[: len(want)])) == want


# ---- Hugging Face Flax GPT-2 `generate` ---------------------------------------------------------

transformers = pytest.importorskip("transformers")
BLOCK = "FlaxGPT2LMHeadModule/transformer/h/1"


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=32,
        eos_token_id=0, pad_token_id=49, bos_token_id=49,
    )  # fmt: skip
    with jax.numpy_rank_promotion("allow"):
        return transformers.FlaxGPT2LMHeadModel(config, seed=0)


IDS = jnp.array([[1, 2, 3, 4], [5, 6, 8, 9]])  # the first prompt reaches EOS (0) early


@pytest.fixture(scope="module")
def greedy(gpt2):
    """`generate`'s greedy tokens, unpulled (made once: each eager `generate` compiles)."""
    with jax.numpy_rank_promotion("allow"):
        return gpt2.generate(IDS, max_new_tokens=6).sequences


def _full(model, ids):
    """The block's output on whole sequences, one forward without a cache."""
    f = lambda ids: model(ids).logits  # noqa: E731
    return stx.pull(f, at=stx.scopes(BLOCK))(ids)


# (Hugging Face's generate compiles for seconds: at size; the docs' page runs it by default.)
@pytest.mark.exhaustive
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_gpt2_generate_every_token(gpt2, greedy, sample):
    key = jax.random.key(3)

    def gen(ids):
        options = {"do_sample": True, "prng_key": key, "top_k": 0} if sample else {}
        return gpt2.generate(ids, max_new_tokens=6, **options).sequences

    out, inters = stx.pull(gen, at=stx.scopes(BLOCK), steps=8, ran=True)(IDS)
    np.testing.assert_array_equal(out, gen(IDS) if sample else greedy)
    # the cache's dummy call, the prompt, then every step of the loop
    assert sorted(k for k in inters if not k.endswith(".ran")) == [f"{BLOCK}_{i}" for i in range(3)]
    (rows,), ran = inters[f"{BLOCK}_2"], np.asarray(inters[f"{BLOCK}_2.ran"])  # (hidden,)
    assert rows.shape == (8, 2, 1, 32)
    if not sample:  # greedy: a Python loop of whole-sequence calls makes the same tokens
        np.testing.assert_array_equal(out, _greedy_by_hand(gpt2, lambda ids: gpt2(ids).logits))
        assert bool(jnp.any(out[0, 4:] == 0)) and not bool(jnp.any(out[1, 4:] == 0))
    # Each step's block output is the whole-sequence forward's at the position it fed.
    _, full = _full(gpt2, out)
    (full,) = full[f"{BLOCK}_0"]
    for s in np.nonzero(ran)[0]:
        np.testing.assert_allclose(rows[s, :, 0], full[:, 4 + s], atol=1e-4)
    assert ran.sum() == 5 if not sample else ran.sum() <= 5  # (the prompt's call gave one)
    # The round trip, every row planted back.
    values = {k: v for k, v in inters.items() if not k.endswith(".ran")}
    np.testing.assert_array_equal(stx.plant(gen, at=stx.scopes(BLOCK), steps=8)(values, IDS), out)


def _greedy_by_hand(model, logits_of):
    """Greedy decoding as a Python loop of whole-sequence calls, EOS (0) then padding (49)."""
    tokens = IDS
    for _ in range(6):
        nxt = jnp.argmax(logits_of(tokens)[:, -1], -1)
        done = jnp.any(tokens[:, 4:] == 0, axis=1)
        tokens = jnp.concatenate([tokens, jnp.where(done, 49, nxt)[:, None]], 1)
    return tokens


@pytest.mark.exhaustive
def test_gpt2_generate_steered_from_a_step_on(gpt2, greedy):
    d = 3.0 * jax.random.normal(jax.random.key(1), (32,))
    gen = lambda ids: gpt2.generate(ids, max_new_tokens=6).sequences  # noqa: E731
    steer = lambda h, step: (jnp.where(step >= 1, h[0] + d, h[0]),)  # noqa: E731
    got = stx.plant(gen, at=stx.scopes(BLOCK))({f"{BLOCK}_2": steer}, IDS)
    # By hand: the block's output moved by `d` from the sixth position on (the loop's step 1).
    f = lambda ids: gpt2(ids).logits  # noqa: E731
    moved = lambda h: (h[0].at[:, 5:].add(d),)  # noqa: E731
    want = _greedy_by_hand(
        gpt2, lambda ids: stx.plant(f, at=stx.scopes(BLOCK))({f"{BLOCK}_0": moved}, ids)
    )
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, greedy)  # (the steering changed the generation)


# ---- recording generations ---------------------------------------------------------------------


def test_recording_a_generation_stores_every_token_and_how_many(tmp_path):
    params = _params()
    prompts = jnp.stack(PROMPTS)
    batched = jax.vmap(decode_while, (None, 0, None))  # (the batch outside the loop: axis 0)
    loop = ["block_2", "block_3"]  # the loop's rows alone, not the prompt's call
    with stx.record(
        batched, to=tmp_path / "s", keys=loop, steps=8, ran=True, progress=False
    ) as recorder:
        for _ in range(2):
            recorder(params, prompts, 6)
    store = stx.open_store(tmp_path / "s")
    _, inters = stx.pull(batched, steps=8, ran=True)(params, prompts, 6)
    inters = {k: v for k, v in inters.items() if k.split(".")[0] in loop}
    assert sorted(store) == sorted(inters) == ["block_2", "block_2.ran", "block_3", "block_3.ran"]
    for key, value in inters.items():
        np.testing.assert_allclose(store[key][:], np.concatenate([value, value]), atol=1e-6)
    _, n = batched(params, prompts, 6)
    np.testing.assert_array_equal(store["block_2.ran"][:3].sum(1), n - 4)  # tokens per prompt
    with pytest.raises(stx.StoreError, match=r"keys=\['blocks'\]\): 'blocks' names no key"):
        stx.record(batched, to=tmp_path / "t", keys=["blocks"], progress=False)(params, prompts, 6)


@pytest.mark.exhaustive
def test_recording_gpt2_generate_the_loop_alone(gpt2, tmp_path):
    gen = lambda ids: gpt2.generate(ids, max_new_tokens=6).sequences  # noqa: E731
    at = stx.scopes(BLOCK)
    with pytest.raises(stx.StoreError, match="keys="):  # the prompt's call counts examples first
        stx.record(gen, to=tmp_path / "t", at=at, steps=8, progress=False)(IDS)
    loop = f"{BLOCK}_2"
    # (generate's loop runs for the whole batch: its rows' `.ran` are per step, not per prompt)
    options = dict(at=at, steps=8, keys=loop, axis={loop: 1}, progress=False)
    with stx.record(gen, to=tmp_path / "s", **options) as recorder:
        recorder(IDS)
    store = stx.open_store(tmp_path / "s")
    (rows,) = stx.pull(gen, at=at, steps=8)(IDS)[1][loop]
    assert sorted(store) == [f"{loop}[0]"]
    np.testing.assert_allclose(store[f"{loop}[0]"][:], np.moveaxis(rows, 1, 0), atol=1e-6)

"""KerasHub's GPT-2 `generate` on the JAX backend, read and steered step by step: against a
Python loop that calls the model on the whole sequence, one token at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
BLOCK = stx.scopes("*transformer_layer_1*")
P, LENGTH = 4, 10  # prompt tokens, then up to LENGTH in all


@pytest.fixture(scope="module")
def lm():
    with jax.numpy_rank_promotion("allow"):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=32,
        )  # fmt: skip
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(sampler="greedy")
        yield model


INPUTS = {
    "token_ids": jnp.array([[1, 2, 3, 4] + [0] * 6, [5, 6, 8, 9] + [0] * 6]),
    "padding_mask": jnp.array([[True] * P + [False] * 6] * 2),
}


def _generate(lm):
    return lambda inputs: lm.generate_step(inputs, stop_token_ids=None)["token_ids"]


def _by_hand(lm, edit=None):
    """Greedy decoding as a Python loop of whole-sequence calls; `edit` plants a hook at the
    block's output of that one forward pass."""
    tokens = INPUTS["token_ids"][:, :P]
    forward = lambda ids: lm.backbone.token_embedding(  # noqa: E731
        lm.backbone({"token_ids": ids, "padding_mask": jnp.ones(ids.shape, bool)}), reverse=True
    )
    for _ in range(LENGTH - P):
        logits = forward(tokens) if edit is None else stx.plant(forward, at=BLOCK)(edit, tokens)
        tokens = jnp.concatenate([tokens, jnp.argmax(logits[:, -1], -1)[:, None]], 1)
    return tokens, forward


def test_every_generated_token_as_the_python_loop(lm):
    with jax.numpy_rank_promotion("allow"):
        out, acts = stx.pull(_generate(lm), at=BLOCK, steps=8, ran=True)(INPUTS)
        want, forward = _by_hand(lm)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(
            out, lm.generate(dict(INPUTS), stop_token_ids=None)["token_ids"]
        )
        # The prompt's call (the cache built over every position), then the loop's rows.
        assert sorted(k for k in acts if not k.endswith(".ran")) == [
            "transformer_layer_1_0",
            "transformer_layer_1_1",
        ]
        (rows, _), ran = (
            acts["transformer_layer_1_1"],
            np.asarray(acts["transformer_layer_1_1.ran"]),
        )
        np.testing.assert_array_equal(ran, np.arange(8) < LENGTH - P)
        # Iteration s feeds position P - 1 + s: its row is that position's block output.
        (full,) = stx.pull(lambda ids: forward(ids), at=BLOCK)(out)[1].values()
        for s in range(LENGTH - P):
            np.testing.assert_allclose(rows[s, :, 0], full[:, P - 1 + s], atol=1e-4)
        # Planted back, every row reproduces the generation.
        values = {k: v for k, v in acts.items() if not k.endswith(".ran")}
        np.testing.assert_array_equal(
            stx.plant(_generate(lm), at=BLOCK, steps=8)(values, INPUTS), out
        )


def test_steered_from_a_step_on_as_the_python_loop(lm):
    d = 3.0 * jax.random.normal(jax.random.key(1), (32,))
    with jax.numpy_rank_promotion("allow"):
        steer = lambda h, step: (jnp.where(step >= 2, h[0] + d, h[0]), *h[1:])  # noqa: E731
        got = stx.plant(_generate(lm), at=BLOCK)({"transformer_layer_1_1": steer}, INPUTS)
        # By hand: the block's output moved from position P - 1 + 2 on, in every forward pass.
        moved = lambda h: h.at[:, P + 1 :].add(d)  # noqa: E731
        want, _ = _by_hand(lm, {"gpt2_backbone/transformer_layer_1_0": moved})
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got, lm.generate(dict(INPUTS), stop_token_ids=None)["token_ids"])

"""Selections in models nobody on this project wrote, each checked against an independent
reference: Hugging Face `transformers` Flax models (`output_hidden_states`, Flax's
`capture_intermediates`), penzai layers and a `jax.tree_util` dataclass (the same model with a
`save_inter` written into it by hand), and Keras 3 (`keras.Model(inputs, layer.output)`)."""

import dataclasses

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import transformers
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

import statax as stx
from statax.testing import assert_tree_allclose

transformers.logging.set_verbosity_error()  # (its notice that Flax classes are deprecated)

IDS = jnp.arange(8)[None] % 50


pytestmark = pytest.mark.usefixtures("allow_rank_promotion")  # (Keras, transformers)


# ---- a dataclass registered with jax.tree_util, its layers stacked and scanned -----------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Affine:
    w: jax.Array
    b: jax.Array
    name: str = dataclasses.field(default="", metadata={"static": True})

    def __call__(self, x):
        y = jnp.tanh(x @ self.w + self.b[None])
        return stx.save_inter(y, name=self.name) if self.name else y


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stacked:
    layers: Affine  # its arrays stacked on a leading axis, one per step

    def __call__(self, x):
        return jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)[0]


def _stacked(name=""):
    w = jax.random.normal(jax.random.key(0), (3, 4, 4)) / 2
    return Stacked(Affine(w, jnp.arange(12.0).reshape(3, 4) / 10, name))


@pytest.mark.parametrize("jit", [False, True])
def test_a_tree_util_dataclass_keeps_its_structure_while_marked(jit):
    """A scanned layer is rebuilt from the slices of its leaves in each step: marked, it is
    still the pytree node it was (item 5), and gives each step's output, stacked."""
    x = jnp.ones((2, 4))
    wrap = jax.jit if jit else (lambda f: f)
    model = _stacked()
    out, acts = wrap(stx.pull(lambda m, x: m(x), at=stx.modules("layers")))(model, x)
    ref_out, ref = wrap(stx.pull(lambda m, x: m(x)))(_stacked("layers"), x)
    assert_tree_allclose((out, acts), (ref_out, ref))
    assert acts["layers_0"].shape == (3, 2, 4)
    assert type(model.layers) is Affine  # (put back)


# ---- penzai: blocks in a Sequential, and in a LayerStack under lax.scan -----------------------


@pz.pytree_dataclass
class Marked(pz.nn.Layer):
    """A penzai layer that marks its sublayer's output by hand: the reference."""

    inner: pz.nn.Layer
    name: str = dataclasses.field(metadata={"pytree_node": False})

    def __call__(self, x, **side_inputs):
        return stx.save_inter(self.inner(x, **side_inputs), name=self.name)


def penzai_lm(stack: bool):
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=50,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=False,
        use_layer_stack=stack,
    )
    return llamalike_common.build_llamalike_transformer(config, jax.random.key(0), name="lm")


PENZAI = {
    "sequential": (False, "body.sublayers[1]", lambda m: m.body.sublayers[1]),
    "layer stack": (
        True,
        "body.sublayers[1].stacked_sublayers",
        lambda m: m.body.sublayers[1].stacked_sublayers,
    ),
}


@pytest.mark.parametrize("kind", PENZAI)
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_penzai_block_as_marked_by_hand(kind, jit):
    stack, path, where = PENZAI[kind]
    model = pz.freeze_params(penzai_lm(stack))  # (arrays, as jax.jit takes them)
    tokens = pz.nx.wrap(IDS).tag("batch", "seq")
    by_hand = pz.select(model).at(where).apply(lambda block: Marked(block, path))
    wrap = jax.jit if jit else (lambda f: f)
    got = wrap(stx.pull(lambda m, t: m(t), at=stx.modules(path, of=model)))(model, tokens)
    want = wrap(stx.pull(lambda m, t: m(t)))(by_hand, tokens)
    assert list(got[1]) == [f"{path}_0"]
    assert_tree_allclose(got, want, rtol=1e-4, atol=1e-5)
    if stack:  # one block's output per step of the scan
        assert got[1][f"{path}_0"].data_array.shape == (2, 1, 8, 16)


@pytest.mark.exhaustive
def test_penzai_model_is_a_root_without_of():
    model = penzai_lm(False)
    tokens = pz.nx.wrap(IDS).tag("batch", "seq")
    _, acts = stx.pull(model, at=stx.modules("body.sublayers[*]"))(tokens)
    assert list(acts) == [f"body.sublayers[{i}]_0" for i in range(5)]
    x = tokens
    for i, layer in enumerate(model.body.sublayers):  # the layers run by hand
        x = layer(x, **_side_inputs(model, tokens))
        np.testing.assert_allclose(
            acts[f"body.sublayers[{i}]_0"].unwrap(*x.named_shape),
            x.unwrap(*x.named_shape),
            rtol=1e-4,
            atol=1e-5,
        )


def _side_inputs(model, tokens):
    """What penzai's `TransformerLM` gives its body besides the tokens."""
    seq = tokens.named_shape["seq"]
    positions = pz.nx.arange("seq", seq)
    mask = pz.nx.wrap(jnp.tril(jnp.ones((seq, seq), bool))).tag("seq", "kv_seq")
    return {"token_positions": positions, "attn_mask": mask}


def test_star_on_an_object_that_has_no_items_is_an_error():
    model = penzai_lm(True)
    with pytest.raises(stx.SelectionError, match=r"'\*' selects the items .*stacked_sublayers"):
        stx.pull(model, at=stx.modules("body.sublayers[1].*"))(pz.nx.wrap(IDS).tag("batch", "seq"))


# ---- Keras 3 on JAX, through stateless_call -----------------------------------------------------


class Block(keras.layers.Layer):
    """A layer that calls a layer of its own: the scope path `block/inner`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, name="inner")

    def call(self, x):
        return x + self.inner(x)


def keras_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="dense_a")(inputs)
    h = keras.layers.BatchNormalization(name="bn_a")(h)
    h = keras.layers.Dropout(0.5, name="drop_a")(h)
    h = Block(name="block")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


KERAS_X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def _stateless(model, x, training):
    """A train step's forward pass: the output and the new state (moving statistics, seeds)."""
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    return lambda tv, ntv, x: model.stateless_call(tv, ntv, x, training=training), (tv, ntv, x)


def _up_to(model, name, x, training):
    """`keras.Model(inputs, layer.output)`, run statelessly: the reference."""
    ref = keras.Model(model.inputs, model.get_layer(name).output)
    call, args = _stateless(ref, x, training)
    return call(*args)[0]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_keras_layers_give_their_call_output(training, jit):
    """A layer's call output, not the state updates that also leave its scope in training
    (item 7), and a Dropout in inference, which makes no equations, too."""
    model = keras_model()
    call, args = _stateless(model, KERAS_X, training)
    pulled = stx.pull(call, at=stx.scopes("dense_a", "bn_a", "drop_a", "block", "block/inner"))
    (out, state), acts = (jax.jit(pulled) if jit else pulled)(*args)
    assert sorted(acts) == ["block/inner_0", "block_0", "bn_a_0", "dense_a_0", "drop_a_0"]
    assert_tree_allclose((out, state), call(*args), rtol=1e-4, atol=1e-5)
    for name in ("dense_a", "bn_a", "block"):
        np.testing.assert_allclose(
            acts[f"{name}_0"], _up_to(model, name, KERAS_X, training), rtol=1e-4, atol=1e-5
        )
    bn, dropped = acts["bn_a_0"], acts["drop_a_0"]
    if training:  # each value dropped, or kept and scaled by 1 / (1 - rate)
        kept = dropped != 0
        assert 0 < kept.mean() < 1
        np.testing.assert_allclose(dropped[kept], bn[kept] / 0.5, rtol=1e-5)
    else:
        np.testing.assert_array_equal(dropped, bn)
    np.testing.assert_allclose(
        acts["block/inner_0"],
        dropped @ model.get_layer("block").inner.kernel.value
        + model.get_layer("block").inner.bias.value[None],
        rtol=1e-4,
        atol=1e-5,
    )
    assert type(keras.layers.Layer.__dict__["__call__"]).__name__ == "function"
    assert keras.layers.Layer.__call__.__module__.startswith("keras")  # (put back)


# ---- Hugging Face transformers (Flax), from a small random-init config -----------------------


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    return transformers.FlaxGPT2Model(config, seed=0)


def bert(checkpointed: bool):
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=16,
    )
    return transformers.FlaxBertModel(config, seed=0, gradient_checkpointing=checkpointed)


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_gpt2_blocks_against_capture_intermediates(jit):
    model = gpt2()
    f = lambda params, ids: model(ids, params=params).last_hidden_state  # noqa: E731
    pulled = stx.pull(f, at=stx.scopes("FlaxGPT2Module/h/*"))
    out, acts = (jax.jit(pulled) if jit else pulled)(model.params, IDS)
    _, state = model.module.apply(
        {"params": model.params},
        IDS,
        jnp.ones_like(IDS),
        jnp.arange(8)[None],
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    blocks = state["intermediates"]["h"]
    assert list(acts) == ["FlaxGPT2Module/h/0_0", "FlaxGPT2Module/h/1_0"]  # (no .setup keys)
    for i in range(2):
        assert_tree_allclose(acts[f"FlaxGPT2Module/h/{i}_0"], blocks[str(i)]["__call__"][0])
    np.testing.assert_allclose(out, f(model.params, IDS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "checkpointed", [pytest.param(c, marks=pytest.mark.exhaustive) for c in (False, True)]
)
def test_bert_layers_keep_their_structure_under_remat(checkpointed):
    """A layer returns `(hidden,)`, with `gradient_checkpointing` (`nn.remat`) or without
    (item 4): each against `output_hidden_states`, and under `jax.grad`."""
    model = bert(checkpointed)

    def loss(params, ids):
        out = model(ids, params=params, output_hidden_states=True)
        return jnp.sum(jnp.sin(3 * out.last_hidden_state)), out.hidden_states

    pulled = stx.pull(loss, at=stx.scopes("FlaxBertModule/encoder/layer/*"))
    (_, hidden), acts = pulled(model.params, IDS)
    assert list(acts) == [f"FlaxBertModule/encoder/layer/{i}_0" for i in range(2)]
    for i in range(2):
        (value,) = acts[f"FlaxBertModule/encoder/layer/{i}_0"]  # a tuple of one
        np.testing.assert_allclose(value, hidden[i + 1], rtol=1e-5, atol=1e-6)
    grads, grad_acts = jax.grad(
        stx.pull(lambda p, i: loss(p, i)[0], at=stx.scopes("FlaxBertModule/encoder/layer/1")),
        has_aux=True,
    )(model.params, IDS)
    (value,) = grad_acts["FlaxBertModule/encoder/layer/1_0"]
    np.testing.assert_allclose(value, hidden[2], rtol=1e-5, atol=1e-6)
    assert_tree_allclose(
        grads, jax.grad(lambda p: loss(p, IDS)[0])(model.params), rtol=1e-4, atol=1e-5
    )


# ---- Flax NNX models that hold plain callables (the NNX tutorials' CNN, a Sequential) ----------


def nnx_cnn():
    """The NNX MNIST tutorial's CNN: its pool is a `functools.partial` it calls twice."""
    import functools

    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, *, rngs):
            self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
            self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(8 * 2 * 2, 16, rngs=rngs)
            self.linear2 = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            x = self.avg_pool(nnx.relu(self.conv1(x)))
            x = self.avg_pool(nnx.relu(self.conv2(x)))
            x = x.reshape(x.shape[0], -1)
            return self.linear2(nnx.relu(self.linear1(x)))

    return CNN(rngs=nnx.Rngs(0))


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_nnx_a_partial_the_model_holds_is_selected_per_call(jit):
    from flax import nnx

    model = nnx_cnn()
    x = jnp.linspace(-1.0, 1.0, 2 * 8 * 8).reshape(2, 8, 8, 1)
    run = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    out, inters = stx.pull(run, at=stx.modules("avg_pool", inputs=True))(model, x)
    pooled0 = model.avg_pool(nnx.relu(model.conv1(x)))  # run by hand
    pooled1 = model.avg_pool(nnx.relu(model.conv2(pooled0)))
    assert list(inters) == ["avg_pool.in_0", "avg_pool_0", "avg_pool.in_1", "avg_pool_1"]
    assert_tree_allclose(inters["avg_pool_0"], pooled0)
    assert_tree_allclose(inters["avg_pool_1"], pooled1)
    assert_tree_allclose(inters["avg_pool.in_0"], nnx.relu(model.conv1(x)))
    assert_tree_allclose(out, model(x))
    assert type(model.avg_pool).__name__ == "partial"  # (put back)
    assert stx.plant(run, at=stx.modules("avg_pool"))({"avg_pool_1": pooled1 * 0}, model, x).shape


@pytest.mark.parametrize("paths", [("layers[0]", "layers[1]"), ("layers[1]",), ("layers[*]",)])
def test_nnx_a_function_between_layers_of_a_sequential(paths):
    from flax import nnx

    seq = nnx.Sequential(
        nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    )
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    _, inters = stx.pull(seq, at=stx.modules(*paths))(x)
    h0 = seq.layers[0](x)  # run by hand
    by_hand = {"layers[0]_0": h0, "layers[1]_0": nnx.gelu(h0), "layers[2]_0": seq(x)}
    want = {k: v for k, v in by_hand.items() if any(p in ("layers[*]", k[:-2]) for p in paths)}
    assert list(inters) == list(want)
    assert_tree_allclose(dict(inters), want)
    assert seq.layers[1] is nnx.gelu  # (put back)


def test_an_equinox_activation_function_in_a_training_step():
    """`eqx.nn.MLP`'s `activation` (a function, also held as `None` in the optimizer's moments):
    one key per call, with its cotangent; the model the step returns holds the function."""
    import equinox as eqx
    import optax

    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(mlp, eqx.is_array))

    @eqx.filter_jit
    def step(m, s, x):
        g = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)
        u, s = opt.update(g, s, m)
        return eqx.apply_updates(m, u), s

    (new, _), inters = stx.pull(step, at=stx.modules("activation"), cotangents=True)(mlp, state, x)
    assert sorted(inters) == [
        "activation_0",
        "activation_0.grad",
        "activation_1",
        "activation_1.grad",
    ]
    h = jax.nn.relu(mlp.layers[0](x))  # run by hand
    assert_tree_allclose(inters["activation_0"], h)
    assert_tree_allclose(inters["activation_1"], jax.nn.relu(mlp.layers[1](h)))
    assert new.activation is mlp.activation


# ---- Hugging Face Flax T5 through `model.encode` (a Linen `apply` with `method=`) --------------


@pytest.fixture
def _t5_clip(monkeypatch):
    """transformers 4.x's Flax T5 calls `jnp.clip(x, a_max=...)`, which JAX no longer takes:
    given back for the test, as the keywords it now has."""
    clip = jnp.clip

    def old_clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
        return clip(x, a_min if min is None else min, a_max if max is None else max)

    monkeypatch.setattr(jnp, "clip", old_clip)


@pytest.mark.usefixtures("_t5_clip")
@pytest.mark.parametrize(
    "jit", [pytest.param(j, marks=pytest.mark.exhaustive) for j in (False, True)]
)
def test_t5_encode_block_is_what_the_module_returned(jit):
    cfg = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
        num_decoder_layers=1,
    )  # fmt: skip
    model = transformers.FlaxT5Model(cfg, seed=0)
    ids = jnp.arange(6)[None] % 50
    mask = jnp.ones_like(ids)
    encode = lambda p, i: model.encode(i, attention_mask=mask, params=p)  # noqa: E731
    encode = jax.jit(encode) if jit else encode
    out, inters = stx.pull(encode, at=stx.scopes("encoder/block/*"))(model.params, ids)
    # Flax's own record of the same call (as `encode` applies the module)
    _, state = model.module.apply(
        {"params": model.params},
        ids,
        mask,
        method=lambda m, i, a: m._get_encoder_module()(i, a),
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    blocks = state["intermediates"]["encoder"]["block"]
    assert list(inters) == ["encoder/block/0_0", "encoder/block/1_0"]
    for i in range(2):
        want = blocks[str(i)]["__call__"][0]
        assert_tree_allclose(inters[f"encoder/block/{i}_0"], want)
    # Through the model's __call__, the same block, under the root module's name.
    _, inters = stx.pull(
        lambda p, i: model(i, decoder_input_ids=i, params=p),
        at=stx.scopes("FlaxT5Module/encoder/block/0"),
    )(model.params, ids)
    assert_tree_allclose(inters["FlaxT5Module/encoder/block/0_0"], blocks["0"]["__call__"][0])


@pytest.mark.parametrize("vmapped", [False, True])
def test_nnx_a_function_of_an_of_model_is_marked_once_per_call(vmapped):
    """An `of=` model's function (marked before the call, then found again inside it), and under
    `vmap`, where Flax NNX refuses a change to its `List` made at another trace level."""
    from flax import nnx

    seq = nnx.Sequential(
        nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    )
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    pulled = stx.pull(lambda x: seq(x), at=stx.modules("layers[1]", of=seq))
    out, inters = jax.vmap(pulled)(x) if vmapped else pulled(x)
    assert list(inters) == ["layers[1]_0"]
    assert_tree_allclose(inters["layers[1]_0"], nnx.gelu(seq.layers[0](x)))
    assert_tree_allclose(out, seq(x))
    assert seq.layers[1] is nnx.gelu  # (put back)

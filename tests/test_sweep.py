"""`stx.sweep`: every patch against the model run by hand with that one patch in it (random
layered programs: unrolled or in a `scan`, a `vmap` and a `jit` inside or not, any axes, every
mode), against the loop of `stx.plant` calls it replaces on real models (Hugging Face Flax
GPT-2 with an IOI-style pair of prompts, an equinox transformer, Flax NNX, penzai), attribution
against the first-order term by hand (`jax.jvp`), and every bad input."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

from .helpers import compilations

MODES = ["denoising", "noising", "zero", "mean", "resample"]
SWEEP = stx.sweep


@pytest.fixture(autouse=True, params=[True, False], ids=["reuse", "one-program"])
def reuse(request, monkeypatch):
    """Every test runs both ways: each patch from the base run (`reuse=True`, the default), and
    one program that runs the whole model for every patch (`reuse=False`)."""
    monkeypatch.setattr(stx, "sweep", functools.partial(SWEEP, reuse=request.param))
    return request.param


# ---- random layered programs against the forward pass by hand ----------------------------------


def layer(h, w):  # (..., positions, features): positions mix (a running sum)
    return h + jnp.tanh(jnp.cumsum(h, axis=-2) @ w)


def other_layer(h, w):  # a `cond`'s other branch
    return h - jnp.tanh(jnp.cumsum(h, axis=-2) @ w)


class Layered:
    """A random model: `layers` layers, unrolled or in a `scan` (its rows run in order or
    reversed), over examples handled by a `vmap` inside the function or by broadcasting, under
    a `jit` or not, each layer a `cond` on its input or not, each layer's input a site
    (`"inp"`) beside its output (`"resid"`) or not; the sites in program order, or listed to
    the sweep in a shuffled order."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.layers, self.positions, self.features, self.examples = (
            int(rng.integers(1, 4)),
            int(rng.integers(2, 5)),
            int(rng.integers(2, 4)),
            int(rng.integers(2, 4)),
        )
        self.scan, self.vmap, self.jit = (bool(rng.random() < 0.5) for _ in range(3))
        self.mode = MODES[int(rng.integers(len(MODES)))]
        shape = (self.layers, self.features, self.features)
        self.ws = jnp.asarray(rng.normal(size=shape) / 2, jnp.float32)
        xs = rng.normal(size=(2, self.examples, self.positions, self.features))
        self.clean, self.corrupted = jnp.asarray(xs, jnp.float32)
        # The axes of a site's value, as pull returns it, and which of them to patch along.
        names = ["example", "position", "feature"]
        if self.scan:
            names.insert(1 if self.vmap else 0, "layer")
        chosen = [n for n in names if rng.random() < 0.5]
        self.axes = {n: names.index(n) for n in chosen}
        self.names = names
        self.cond = bool(rng.random() < 0.5)
        self.reverse, self.inputs, self.shuffled = (bool(rng.random() < 0.5) for _ in range(3))
        self.order = rng.permutation(2 * self.layers)  # (of the sites, where shuffled)

    def step(self, h, w):
        """One layer, in the model: a `cond` on the sum of its input (an example's under the
        `vmap`), where `self.cond` says."""
        if not self.cond:
            return layer(h, w)
        return jax.lax.cond(jnp.sum(h) > 0, layer, other_layer, h, w)

    def step_by_hand(self, h, w):
        """`step` on every example at once: `(examples, positions, features)`."""
        if not self.cond:
            return layer(h, w)
        total = jnp.sum(h, axis=(-2, -1), keepdims=True) if self.vmap else jnp.sum(h)
        return jnp.where(total > 0, layer(h, w), other_layer(h, w))

    def block(self, h, w):
        if self.inputs:
            h = stx.save_inter(h, name="inp")
        return stx.save_inter(self.step(h, w), name="resid")

    def __call__(self, x, ws):
        def one(x):
            if self.scan:  # (reversed: the first row to run is the last, and takes ws[0])
                body = lambda h, w: (self.block(h, w), None)  # noqa: E731
                x, _ = jax.lax.scan(body, x, ws[::-1] if self.reverse else ws, reverse=self.reverse)
            else:
                for i in range(self.layers):
                    x = self.block(x, ws[i])
            return jnp.sum(x, axis=(-2, -1))

        f = jax.vmap(one) if self.vmap else one
        return (jax.jit(f) if self.jit else f)(x)

    def by_hand(self, x, patch=None):
        """Each site's values by layer `{"inp": (layers, examples, positions, features),
        "resid": ...}` and the metric, with `patch = (name, layers, mask, source)` replacing,
        at `name` in each layer in `layers`, the values `mask` selects with the source's
        (`source`: that name's values by layer in another run)."""
        h, outs = x, {"inp": [], "resid": []}
        for i in range(self.layers):
            for name in ("inp", "resid"):
                if name == "resid":
                    h = self.step_by_hand(h, self.ws[i])
                if patch is not None and patch[0] == name and i in patch[1]:
                    h = jnp.where(patch[2], patch[3][i], h)
                outs[name].append(h)
        return {k: jnp.stack(v) for k, v in outs.items()}, jnp.mean(jnp.sum(h, axis=(-2, -1)))

    def sites(self) -> list:
        """The sites, in program order."""
        names = ["inp", "resid"] if self.inputs else ["resid"]
        if self.scan:
            return [f"{n}_0" for n in names]
        return [f"{n}_{i}" for i in range(self.layers) for n in names]

    def asked(self):
        """`sites=`: None (every site, in program order), or the sites shuffled."""
        if not self.shuffled:
            return None
        sites = self.sites()
        return [sites[i] for i in self.order if i < len(sites)]

    def expected(self, result):
        """Every patch's metric, by hand, shaped as the sweep's result."""
        clean, _ = self.by_hand(self.clean)
        corrupted, _ = self.by_hand(self.corrupted)
        base = self.corrupted if self.mode == "denoising" else self.clean
        shift = 1 + int(np.random.default_rng(0).integers(self.examples - 1))
        source = {
            "denoising": lambda name: clean[name],
            "noising": lambda name: corrupted[name],
            "zero": lambda name: jnp.zeros_like(clean[name]),
            "mean": lambda name: jnp.broadcast_to(
                jnp.mean(clean[name], axis=1, keepdims=True), clean[name].shape
            ),
            # another example's: the examples rolled by a seeded shift (as sweep documents)
            "resample": lambda name: jnp.roll(clean[name], shift, axis=1),
        }[self.mode]
        out = {}
        for site in result.sites:
            name, occurrence = site.rsplit("_", 1)
            layers = range(self.layers) if self.scan else [int(occurrence)]
            values = np.zeros(result[site].shape)
            for index in np.ndindex(*values.shape):
                at = dict(zip(self.axes, index))
                picked = layers
                if "layer" in at:  # (the row of a reversed scan is the layer from the end)
                    picked = [self.layers - 1 - at["layer"] if self.reverse else at["layer"]]
                mask = np.ones((self.examples, self.positions, self.features), bool)
                for axis, n in enumerate(["example", "position", "feature"]):
                    if n in at:
                        keep = np.arange(mask.shape[axis]) == at[n]
                        mask &= keep.reshape([-1 if a == axis else 1 for a in range(3)])
                values[index] = self.by_hand(base, (name, picked, mask, source(name)))[1]
            out[site] = values
        return out


def check_layered(seed):
    model = Layered(seed)
    result = stx.sweep(
        model,
        lambda out: out,
        (model.clean, model.ws),
        (model.corrupted, model.ws),
        sites=model.asked(),
        axes=model.axes,
        mode=model.mode,
        examples=model.names.index("example"),
        batch_size=3,
        progress=False,
    )
    want = model.expected(result)
    assert list(result.sites) == (model.asked() or model.sites())
    for site in result.sites:
        np.testing.assert_allclose(result[site], want[site], rtol=1e-4, atol=1e-4, err_msg=site)


@pytest.mark.parametrize("seed", range(6))
def test_random_layered_programs_against_the_forward_pass_by_hand(seed):
    check_layered(seed)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(6, 60))
def test_random_layered_programs_at_size(seed):
    check_layered(seed)


def test_a_site_under_an_inner_grad_against_the_gradient_by_hand():
    """A mark inside a function that `jax.grad` differentiates: the patched element is a
    constant there, the others are differentiated as before (a whole planted array would make
    all of them constants, so the loop of plants is no oracle here)."""

    def model(x):
        inner = lambda y: jnp.sum(stx.save_inter(jnp.tanh(y) * 2, name="h") ** 2)  # noqa: E731
        return jnp.sum(jax.grad(inner)(x) + x, axis=-1)

    def by_hand(x, i, source):
        def inner(y):
            return jnp.sum((jnp.tanh(y) * 2).at[:, i].set(source[:, i]) ** 2)

        return jnp.mean(jnp.sum(jax.grad(inner)(x) + x, axis=-1))

    rng = np.random.default_rng(6)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(2))
    result = stx.sweep(model, lambda out: out, (clean,), (corrupted,), axes={"feature": 1})
    want = [float(by_hand(corrupted, i, jnp.tanh(clean) * 2)) for i in range(3)]
    np.testing.assert_allclose(result["h_0"], want, rtol=1e-5)


# ---- real models: the sweep against the loop of plant calls it replaces ------------------------


def loop_of_plants(fn, metric, at, base, source, keys, axes):
    """One `stx.plant` call per site and index, run separately: the site's value in the base
    run, with the index taken from the source (the loop TransformerLens and nnsight run)."""
    _, base_values = stx.pull(fn, at=at)(*base)
    out = {}
    for key in keys:
        planted = jax.jit(
            lambda value, base, key=key: metric(stx.plant(fn, at=at)({key: value}, *base))
        )
        leaves = jax.tree.leaves(base_values[key])
        sizes = tuple(leaves[0].shape[a] for a in axes.values())
        values = np.zeros(sizes)
        for index in np.ndindex(*sizes):

            def patch(b, s):
                mask = np.zeros(b.shape, bool)
                where = [slice(None)] * b.ndim
                for a, i in zip(axes.values(), index):
                    where[a] = i
                mask[tuple(where)] = True
                return jnp.where(mask, s, b)

            value = jax.tree.map(patch, base_values[key], source[key])
            values[index] = float(jnp.mean(planted(value, base)))
        out[key] = values
    return out


def sources(mode, fn, at, clean, corrupted, keys, examples=0):
    """The base run and each site's source, by mode, written out."""
    _, c = stx.pull(fn, at=at)(*clean)
    _, x = stx.pull(fn, at=at)(*corrupted)
    if mode == "denoising":
        return corrupted, c
    if mode == "noising":
        return clean, x
    ablate = {
        "zero": lambda v: jnp.zeros_like(v),
        "mean": lambda v: jnp.broadcast_to(jnp.mean(v, examples, keepdims=True), v.shape),
        "resample": lambda v: jnp.roll(
            v, 1 + int(np.random.default_rng(0).integers(v.shape[examples] - 1)), examples
        ),
    }[mode]
    return clean, {k: jax.tree.map(ablate, c[k]) for k in keys}


def check_against_loop(fn, metric, clean, corrupted, at, axes, mode):
    result = stx.sweep(fn, metric, clean, corrupted, at=at, axes=axes, mode=mode, batch_size=5)
    base, source = sources(mode, fn, at, clean, corrupted, result.sites)
    want = loop_of_plants(fn, metric, at, base, source, result.sites, axes)
    assert list(want) == list(result.sites)
    for key in result.sites:
        np.testing.assert_allclose(result[key], want[key], rtol=2e-4, atol=2e-5, err_msg=key)
    return result


# A Hugging Face Flax GPT-2 (random-init, no download) and an IOI-style pair: the same
# sentence with the two names swapped; the metric, the logit of one name minus the other's.
IOI_CLEAN = jnp.array([[3, 11, 4, 12, 5, 6, 12, 7, 8], [3, 13, 4, 14, 5, 6, 14, 7, 8]])
IOI_CORRUPTED = jnp.array([[3, 12, 4, 11, 5, 6, 11, 7, 8], [3, 14, 4, 13, 5, 6, 13, 7, 8]])


def logit_difference(logits):
    names = jnp.array([[11, 12], [13, 14]])  # (right, wrong) per prompt
    last = logits[:, -1]
    return jnp.take_along_axis(last, names, 1) @ jnp.array([1.0, -1.0])


@pytest.fixture(scope="module")
def gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    with jax.numpy_rank_promotion("allow"):  # (transformers broadcasts ranks implicitly)
        model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    return (lambda params, ids: model(ids, params=params).logits), model.params


GPT2_BLOCKS = stx.scopes("FlaxGPT2LMHeadModule/transformer/h/*")


@pytest.mark.usefixtures("allow_rank_promotion")
@pytest.mark.parametrize(
    "mode", ["denoising", *(pytest.param(m, marks=pytest.mark.exhaustive) for m in MODES[1:])]
)
def test_gpt2_ioi_every_block_and_position(gpt2, mode):
    run, params = gpt2
    result = check_against_loop(
        run,
        logit_difference,
        (params, IOI_CLEAN),
        (params, IOI_CORRUPTED),
        GPT2_BLOCKS,
        {"position": 1},
        mode,
    )
    assert list(result.sites) == [f"FlaxGPT2LMHeadModule/transformer/h/{i}_0" for i in range(2)]
    assert result.array().shape == (2, 9)
    if mode == "denoising":  # patching the last block's whole residual at the last position
        # gives the clean run's answer: nothing after it mixes positions
        np.testing.assert_allclose(result.array()[-1, -1], result.clean, rtol=1e-4)
        np.testing.assert_allclose(result.baseline, result.corrupted)


def eqx_transformer():
    import equinox as eqx

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
            self.mlp = eqx.nn.MLP(8, 8, 16, 1, key=k2)

        def __call__(self, x):  # (positions, features)
            x = x + self.attention(x, x, x)
            return x + jax.vmap(self.mlp)(x)

    class Transformer(eqx.Module):
        blocks: tuple

        def __init__(self, key):
            self.blocks = tuple(Block(k) for k in jax.random.split(key, 3))

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return jnp.sum(x[-1])

    return Transformer(jax.random.PRNGKey(0))


@pytest.mark.parametrize("mode", MODES)
def test_equinox_transformer_every_mode(mode):
    model = eqx_transformer()
    run = lambda x: jax.vmap(model)(x)  # noqa: E731  (examples by vmap: the sites are batched)
    rng = np.random.default_rng(0)
    clean, corrupted = (jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32) for _ in range(2))
    at = stx.modules("blocks[*]", of=model)
    check_against_loop(run, lambda out: out, (clean,), (corrupted,), at, {"position": 1}, mode)


AT_SIZE = [pytest.param(m, marks=pytest.mark.exhaustive) for m in MODES[1:]]


@pytest.mark.parametrize("mode", ["denoising", *AT_SIZE])
def test_flax_nnx_model(mode):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(6, 6, rngs=rngs)

        def __call__(self, x):  # (examples, positions, features)
            return x + jnp.tanh(self.lin(jnp.cumsum(x, axis=1)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(3)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return jnp.sum(x[:, -1], axis=-1)

    net = Net(nnx.Rngs(0))
    rng = np.random.default_rng(1)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32) for _ in range(2))
    at = stx.modules("blocks[*]")
    check_against_loop(net, lambda out: out, (clean,), (corrupted,), at, {"position": 1}, mode)


@pytest.mark.parametrize("mode", ["denoising", *AT_SIZE])
def test_penzai_model(mode):
    from penzai import pz

    from tests.test_select_libraries import penzai_lm

    lm = pz.freeze_params(penzai_lm(stack=False))

    def run(model, ids):
        return model(pz.nx.wrap(ids).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")

    at = stx.modules("body.sublayers[1]", "body.sublayers[2]", of=lm)  # the two blocks
    clean = (lm, IOI_CLEAN)
    corrupted = (lm, IOI_CORRUPTED)
    # A block's value is a NamedArray over (batch, seq, embedding): positions are axis 1.
    check_against_loop(run, logit_difference, clean, corrupted, at, {"position": 1}, mode)


@pytest.mark.parametrize("mode", ["noising", *AT_SIZE])
def test_flax_linen_model(mode):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):  # (examples, positions, features)
            for _ in range(3):
                x = x + jnp.tanh(nn.Dense(5)(jnp.cumsum(x, axis=1)))
            return jnp.sum(x[:, -1], axis=-1)

    net = Net()
    rng = np.random.default_rng(3)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32) for _ in range(2))
    params = net.init(jax.random.PRNGKey(0), clean)
    at = stx.scopes("Net/Dense_*")  # each Dense layer's output, by its Linen scope
    result = check_against_loop(
        net.apply, lambda out: out, (params, clean), (params, corrupted), at, {"position": 1}, mode
    )
    assert list(result.sites) == [f"Net/Dense_{i}_0" for i in range(3)]


# ---- attribution patching against the first-order term by hand ---------------------------------


@pytest.mark.parametrize("mode", ["denoising", "zero"])
def test_attribution_is_the_first_order_term_of_each_patch(mode):
    """At each site and index: the metric at the base run plus the derivative of the metric
    along the patch (the source minus the base value, where the index is), by `jax.jvp`
    through the model with that site's value planted."""
    model = eqx_transformer()
    run = lambda x: jax.vmap(model)(x)  # noqa: E731
    rng = np.random.default_rng(2)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32) for _ in range(2))
    at = stx.modules("blocks[*]", of=model)
    axes = {"position": 1}
    got = stx.sweep(
        run, jnp.mean, (clean,), (corrupted,), at=at, axes=axes, mode=mode, method="attribution"
    )
    exact = stx.sweep(run, jnp.mean, (clean,), (corrupted,), at=at, axes=axes, mode=mode)
    base, source = sources(mode, run, at, (clean,), (corrupted,), got.sites)
    _, base_values = stx.pull(run, at=at)(*base)
    baseline = float(jnp.mean(run(*base)))
    for key in got.sites:
        want = np.zeros(got[key].shape)
        for (t,) in np.ndindex(*want.shape):
            direction = (
                jnp.zeros_like(base_values[key])
                .at[:, t]
                .set((source[key] - base_values[key])[:, t])
            )

            def along(e, key=key, direction=direction):
                planted = base_values[key] + e * direction
                return jnp.mean(stx.plant(run, at=at)({key: planted}, *base))

            _, slope = jax.jvp(along, (0.0,), (1.0,))
            want[t] = baseline + float(slope)
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    assert got.method == "attribution" and got.array().shape == exact.array().shape
    assert got.baseline == exact.baseline


# ---- the result ---------------------------------------------------------------------------------


def sweep_positions(model, **options):
    """A sweep of `model`'s layers by position, denoising."""
    pair = (model.clean, model.ws), (model.corrupted, model.ws)
    axes = {"position": len(model.names) - 2}
    return stx.sweep(model, lambda out: out, *pair, axes=axes, **options)


@pytest.fixture(scope="module")
def small():
    model = Layered(3)  # unrolled layers
    return model, sweep_positions(model, progress=False)


def test_the_result_as_a_dataframe_a_heatmap_and_html(small):
    model, result = small
    frame = result.to_dataframe()
    assert list(frame.columns) == ["site", "position", "metric"]
    assert len(frame) == model.layers * model.positions
    row = frame.iloc[model.positions + 1]
    assert (row.site, row.position) == ("resid_1", 1)
    assert row.metric == pytest.approx(result["resid_1"][1])
    figure = result.heatmap()
    image = figure.axes[0].images[0].get_array()
    np.testing.assert_allclose(image, result.array())
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == list(result.sites)
    assert figure.axes[0].get_ylabel() == "site"
    html = result._repr_html_()
    assert html.count("<tr>") == model.layers and 'src="data:image/png;base64,' in html
    normalized = result.normalized()
    want = (result["resid_0"] - result.corrupted) / (result.clean - result.corrupted)
    np.testing.assert_allclose(normalized["resid_0"], want)
    assert result.correlation(result) == pytest.approx(1.0)


def test_progress_and_batch_sizes_give_the_same_result(small, capsys):
    model, result = small
    for batch_size in (1, 2, 1000):
        again = sweep_positions(model, batch_size=batch_size, progress=True)
        np.testing.assert_allclose(again.array(), result.array(), rtol=1e-6)
    assert "patching" in capsys.readouterr().err


def test_each_site_with_axes_of_its_own():
    """Blocks by position, and a per-head value by position and head, in one sweep: each
    against the loop of plants with its own axes."""

    def model(x):  # (examples, positions, features)
        h = stx.save_inter(jnp.tanh(jnp.cumsum(x, axis=1)), name="block")
        heads = stx.save_inter(h.reshape(*h.shape[:2], 2, -1) * 1.5, name="heads")
        h = h + jnp.tanh(heads.reshape(h.shape))
        return jnp.sum(h[:, -1], axis=-1)

    rng = np.random.default_rng(4)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32) for _ in range(2))
    axes = {"block": {"position": 1}, "heads": {"position": 1, "head": 2}}
    result = stx.sweep(model, lambda out: out, (clean,), (corrupted,), axes=axes)
    assert result.axes == {"block_0": ("position",), "heads_0": ("position", "head")}
    assert result["block_0"].shape == (3,) and result["heads_0"].shape == (3, 2)
    base, source = sources("denoising", model, None, (clean,), (corrupted,), result.sites)
    for key, site_axes in (("block_0", axes["block"]), ("heads_0", axes["heads"])):
        want = loop_of_plants(model, lambda out: out, None, base, source, [key], site_axes)
        np.testing.assert_allclose(result[key], want[key], rtol=1e-5, atol=1e-6)
    attribution = stx.sweep(
        model, lambda out: out, (clean,), (corrupted,), axes=axes, method="attribution"
    )
    assert attribution["heads_0"].shape == (3, 2)
    frame = result.to_dataframe()
    assert list(frame.columns) == ["site", "position", "metric", "head"]
    assert frame["head"].isna().sum() == 3  # the block's rows have no head
    with pytest.raises(stx.SweepError, match="mixes the two"):
        stx.sweep(
            model,
            lambda out: out,
            (clean,),
            (corrupted,),
            axes={"block": {"position": 1}, "head": 2},
        )


@pytest.mark.parametrize("loop", ["scan in a scan", "while_loop", "read after the loop"])
def test_sites_in_loops_that_reuse_leaves_alone_or_reads_after_against_the_run_by_hand(loop):
    """Loops whose rows reuse leaves alone or must not skip blindly: a site in a `scan` inside
    a `scan` (two loops around it: computed), one in a `while_loop` (a planted value serves
    every iteration), and a scan's site whose stacked values the function reads again after
    the loop; each against the run written by hand with the patch in it."""
    w = jnp.asarray(np.random.default_rng(6).normal(size=(3, 3)) / 2, jnp.float32)
    step = lambda h: h + jnp.tanh(h @ w)  # noqa: E731
    layer = lambda h, _: (stx.save_inter(step(h), name="h"), None)  # noqa: E731

    def model(x):
        if loop == "scan in a scan":
            h, _ = jax.lax.scan(lambda h, _: jax.lax.scan(layer, h, None, length=2), x, None, 3)
        elif loop == "while_loop":
            n = jnp.int32(3) + (jnp.sum(x) > 1e9)  # (a trip count known when it runs)
            h = jax.lax.fori_loop(0, n, lambda i, h: layer(h, None)[0], x)
        else:
            h, hs = jax.lax.scan(lambda h, _: (layer(h, None)[0],) * 2, x, None, length=3)
            h = h + jnp.sum(hs, axis=0) * 0.5
        return jnp.sum(h, axis=-1)

    def by_hand(x, patch=None):
        """`(values, metric)`: the site's values as `pull` stacks them; `patch = (row,
        feature, source)` replaces that feature after step `row` (in a `while_loop`, after
        every step) with the source's."""
        steps = 3 if loop == "while_loop" else 6 if loop == "scan in a scan" else 3
        h, hs = x, []
        for t in range(steps):
            h = step(h)
            if patch is not None and patch[0] in (t, None):
                h = h.at[:, patch[1]].set(patch[2][t if patch[0] is not None else -1][:, patch[1]])
            hs.append(h)
        if loop == "read after the loop":
            h = h + jnp.sum(jnp.stack(hs), axis=0) * 0.5
        return jnp.stack(hs), jnp.mean(jnp.sum(h, axis=-1))

    rng = np.random.default_rng(7)
    clean, corrupted = (jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(2))
    axes = {
        "scan in a scan": {"outer": 0, "inner": 1, "feature": 3},
        "while_loop": {"feature": 1},
        "read after the loop": {"layer": 0, "feature": 2},
    }[loop]
    result = stx.sweep(model, lambda out: out, (clean,), (corrupted,), axes=axes, batch_size=4)
    (key,) = result.sites
    source, _ = by_hand(clean)
    want = np.zeros(result[key].shape)
    for index in np.ndindex(*want.shape):
        *rows, feature = index
        row = None if not rows else rows[0] * 2 + rows[1] if len(rows) == 2 else rows[0]
        want[index] = by_hand(corrupted, (row, feature, source))[1]
    np.testing.assert_allclose(result[key], want, rtol=1e-5, atol=1e-5)


def test_a_second_sweep_over_new_inputs_compiles_nothing():
    def model(x, w):
        h = stx.save_inter(jnp.tanh(x @ w), name="h")
        return jnp.sum(stx.save_inter(h * 2, name="g"), axis=-1)

    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
    pairs = [tuple(jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(2))]
    pairs.append(tuple(jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(2)))
    metric = lambda out: out  # noqa: E731
    axes = {"feature": 1}
    first = stx.sweep(model, metric, (pairs[0][0], w), (pairs[0][1], w), axes=axes)
    count = compilations()
    second = stx.sweep(model, metric, (pairs[1][0], w), (pairs[1][1], w), axes=axes)
    assert compilations() == count  # traced again (as the model is now), compiled nothing
    assert not np.allclose(first.array(), second.array())
    for site in second.sites:  # the values of the new inputs: the loop of plants says so
        base, source = sources("denoising", model, None, (pairs[1][0], w), (pairs[1][1], w), [site])
        want = loop_of_plants(model, metric, None, base, source, [site], axes)
        np.testing.assert_allclose(second[site], want[site], rtol=1e-5, atol=1e-6)
    stats = second.memory_analysis()
    assert stats.temp_size_in_bytes >= 0 and stats.argument_size_in_bytes > 0


def test_a_second_sweep_of_a_scan_over_layers_traces_no_program(monkeypatch):
    """A scan's site swept row by row (its chunk size from the first sweep's trace): the next
    sweep over new inputs compiles nothing, and traces no program again (with the fast paths,
    which keep the traces), and computes what the layers run by hand with the patch in them
    compute."""
    from statax._core import fastpaths
    from statax._drivers.programs import Programs

    ws = jnp.asarray(np.random.default_rng(8).normal(size=(3, 4, 4)) / 2, jnp.float32)

    def model(x):
        body = lambda h, w: (stx.save_inter(h + jnp.tanh(h @ w), name="h"), None)  # noqa: E731
        return jnp.sum(jax.lax.scan(body, x, ws)[0], axis=-1)

    rng = np.random.default_rng(9)
    pairs = [[jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(2)]]
    pairs.append([jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(2)])
    axes = {"layer": 0, "feature": 2}
    stx.sweep(model, lambda out: out, (pairs[0][0],), (pairs[0][1],), axes=axes, batch_size=6)
    traced = []
    original = Programs.traced
    monkeypatch.setattr(
        Programs, "traced", lambda self, *a, **k: traced.append(1) or original(self, *a, **k)
    )
    clean, corrupted = pairs[1]
    count = compilations()
    second = stx.sweep(model, lambda out: out, (clean,), (corrupted,), axes=axes, batch_size=6)
    assert compilations() == count
    assert traced == [] if fastpaths.on else traced

    def run(x, patch=None):
        hs = []
        for i, w in enumerate(ws):
            x = x + jnp.tanh(x @ w)
            if patch is not None and patch[0] == i:
                x = x.at[:, patch[1]].set(patch[2][i][:, patch[1]])
            hs.append(x)
        return hs, jnp.mean(jnp.sum(x, axis=-1))

    source, _ = run(clean)
    want = [[run(corrupted, (i, f, source))[1] for f in range(4)] for i in range(3)]
    np.testing.assert_allclose(second["h_0"], want, rtol=1e-5, atol=1e-5)


def test_a_repeated_attribution_sweep_starts_its_program_early_and_keeps_it_only_if_current(
    monkeypatch,
):
    """The second attribution sweep of the same function runs the program the first ran once,
    started before its trace; after the model changes (a global it reads), the early result is
    dropped and the program of the new trace gives the new model's answer."""
    from statax._core import fastpaths
    from statax._drivers.programs import Traced

    weights = {"w": jnp.eye(3, dtype=jnp.float32) * 0.5}

    def model(x):
        return jnp.sum(stx.save_inter(jnp.tanh(x @ weights["w"]), name="h"), axis=-1)

    runs = []
    real = Traced.run
    monkeypatch.setattr(Traced, "run", lambda self, *a: runs.append(1) or real(self, *a))
    metric = lambda out: out  # noqa: E731
    x = (jnp.ones((2, 3), jnp.float32),)

    def attribution():
        runs.clear()
        result = stx.sweep(model, metric, x, axes={"feature": 1}, mode="zero", method="attribution")
        return result.array(), len(runs)

    first, _ = attribution()
    again, count = attribution()
    np.testing.assert_array_equal(again, first)
    assert count == 1  # the early run, kept
    weights["w"] = jnp.eye(3, dtype=jnp.float32) * 2.0
    changed, count = attribution()
    assert count == (2 if fastpaths.on else 1)  # the early run dropped, the trace's program run
    h = jnp.tanh(x[0] @ weights["w"])  # zero ablation, first order: mean(sum(h)) - h * dh
    np.testing.assert_allclose(changed[0], np.mean(np.sum(h, -1)) - np.mean(h, 0), rtol=1e-5)


def test_sites_come_in_program_order_past_ten():
    """Twelve sites: `resid_10` comes after `resid_9`, not after `resid_1` (as a dict's keys
    sorted would put it)."""

    def model(x):
        for i in range(12):
            x = stx.save_inter(jnp.tanh(x * 0.9 + i / 10), name="resid")
        return jnp.sum(x, axis=-1)

    clean, corrupted = jnp.ones((2, 3)), jnp.zeros((2, 3))
    result = stx.sweep(model, lambda out: out, (clean,), (corrupted,), axes={"feature": 1})
    assert list(result.sites) == [f"resid_{i}" for i in range(12)]
    base, source = sources("denoising", model, None, (clean,), (corrupted,), ["resid_2"])
    want = loop_of_plants(model, lambda out: out, None, base, source, ["resid_2"], {"feature": 1})
    np.testing.assert_allclose(result["resid_2"], want["resid_2"], rtol=1e-5)
    assert result.locations["resid_2"].endswith(
        f"test_sweep.py:{model.__code__.co_firstlineno + 2}"
    )


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_an_error_that_says_what_and_where(small):
    model, _ = small
    args = (model.clean, model.ws)
    identity = lambda out: out  # noqa: E731
    shorter = (model.corrupted[:, :-1], model.ws)
    with pytest.raises(
        stx.SweepError,
        match=r"site 'resid_0' \(saved at .*test_sweep.py:\d+\) has shape .* in the clean run "
        r"and .* in the corrupted one",
    ):
        stx.sweep(model, identity, args, shorter)
    with pytest.raises(stx.SweepError, match=r"has no axis 5 \('head'\) to patch along"):
        stx.sweep(model, identity, args, (model.corrupted, model.ws), axes={"head": 5})
    with pytest.raises(stx.SweepError, match="must return a float scalar, or one per example"):
        stx.sweep(model, lambda out: jnp.stack([out, out], 1), args, (model.corrupted, model.ws))
    with pytest.raises(stx.SweepError, match=r"the sites \['attn'\] did not run"):
        stx.sweep(model, identity, args, (model.corrupted, model.ws), sites=["attn"])
    with pytest.raises(stx.SweepError, match="pass corrupted="):
        stx.sweep(model, identity, args)
    with pytest.raises(stx.SweepError, match="tuple of fn's positional arguments"):
        stx.sweep(model, identity, model.clean, mode="zero")
    with pytest.raises(stx.SweepError, match="mode='restore'; it is one of"):
        stx.sweep(model, identity, args, mode="restore")

    def branchy(x, ws):
        h = stx.save_inter(x * 2, name="h")
        if x.shape[0] > 100:  # never, here
            stx.save_inter(h, name="rare")
        return jnp.sum(h, axis=(-2, -1))

    with pytest.raises(stx.SweepError, match=r"the sites \['rare'\] did not run"):
        stx.sweep(branchy, identity, args, mode="zero", sites=["h", "rare"])

    def conditional(x, ws):  # a lax.cond whose branch with the mark is not taken
        h = stx.save_inter(x * 2, name="h")
        h = jax.lax.cond(
            jnp.sum(x) > 1e6, lambda h: stx.save_inter(h + 1, name="rare"), lambda h: h, h
        )
        return jnp.sum(h, axis=(-2, -1))

    with pytest.raises(
        stx.SweepError, match=r"the sites 'rare_0' \(saved at .*test_sweep.py:\d+\) did not run"
    ):
        stx.sweep(conditional, identity, args, mode="zero")
    ok = stx.sweep(conditional, identity, args, mode="zero", sites=["h"])
    assert list(ok.sites) == ["h_0"]


def test_edge_cases_of_the_arguments(small):
    """Issue 47: `batch_size` not a positive int, a function with no site, `axes=` naming no
    site, `sites=` a string, attribution at a site of integers."""
    model, _ = small
    args, other = (model.clean, model.ws), (model.corrupted, model.ws)
    identity = lambda out: out  # noqa: E731
    for size in (0, -3, 1.5, True):
        with pytest.raises(stx.SweepError, match=f"batch_size={size!r}; it is how many"):
            stx.sweep(model, identity, args, other, batch_size=size)
    with pytest.raises(stx.SweepError, match="has no site to patch.*stx.sites"):
        stx.sweep(lambda x, ws: jnp.sum(x, axis=(-2, -1)), identity, args, mode="zero")
    with pytest.raises(stx.SweepError, match=r"\['resdi'\] name no site.*'resid_0'"):
        stx.sweep(model, identity, args, other, axes={"resdi": {"position": 1}})
    one = stx.sweep(model, identity, args, other, sites="resid")  # a string: one site or name
    assert list(one.sites) == [k for k in stx.pull(model)(*args)[1] if k.startswith("resid_")]
    assert one.values == stx.sweep(model, identity, args, other, sites=["resid"]).values

    def with_ids(ids, x):
        ids = stx.save_inter(ids, name="ids")
        h = stx.save_inter(x * ids[:, None].astype(x.dtype), name="h")
        return jnp.sum(h, axis=-1)

    ids, x = jnp.array([1, 2, 3]), jnp.ones((3, 4))
    clean, corrupted = (ids, x), (ids + 1, x * 2)
    with pytest.raises(stx.SweepError, match=r"site 'ids_0' \(saved at .*\) holds int32"):
        stx.sweep(with_ids, jnp.mean, clean, corrupted, method="attribution")
    exact = stx.sweep(with_ids, jnp.mean, clean, corrupted)  # the exact sweep patches ids too
    assert list(exact.sites) == ["ids_0", "h_0"]
    assert stx.sweep(with_ids, jnp.mean, clean, corrupted, sites="h", method="attribution")


def test_an_equinox_model_as_an_argument():
    """Its non-array leaves (activation functions) are static, as `pull` takes them."""
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.PRNGKey(0))
    x1, x0 = jnp.ones((3, 4)), jnp.zeros((3, 4))
    fn = lambda m, x: jax.vmap(m)(x)[:, 0]  # noqa: E731
    at = stx.modules("layers[0]")
    result = stx.sweep(fn, jnp.mean, (mlp, x1), (mlp, x0), at=at, axes={"unit": 1})
    values = stx.pull(fn, at=at)(mlp, x1)[1]
    for unit in range(8):  # each unit of the clean run's first layer into the corrupted run
        source = values["layers[0]_0"]
        base = stx.pull(fn, at=at)(mlp, x0)[1]["layers[0]_0"]
        patched = base.at[:, unit].set(source[:, unit])
        want = jnp.mean(stx.plant(fn, at=at)({"layers[0]_0": patched}, mlp, x0))
        np.testing.assert_allclose(result["layers[0]_0"][unit], want, rtol=1e-5, atol=1e-6)


def test_sharded_inputs_and_patches_sharded_over_devices(small):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    model, result = small  # 2 examples
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("e", "p"))
    by_example = NamedSharding(mesh, P("e"))  # the inputs, over two devices' examples
    clean, corrupted = (jax.device_put(x, by_example) for x in (model.clean, model.corrupted))
    sharded = stx.sweep(
        model,
        lambda out: out,
        (clean, model.ws),
        (corrupted, model.ws),
        axes={"position": len(model.names) - 2},
        batch_size=4,
        patch_sharding=NamedSharding(mesh, P(("e", "p"))),  # patches over all four
        progress=False,
    )
    np.testing.assert_allclose(sharded.array(), result.array(), rtol=1e-5, atol=1e-6)

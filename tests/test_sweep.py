"""`stx.sweep`: every patch against the model run by hand with that one patch in it (random
layered programs: unrolled or in a `scan`, a `vmap` and a `jit` inside or not, any axes, every
mode), against the loop of `stx.plant` calls it replaces on real models (Hugging Face Flax
GPT-2 with an IOI-style pair of prompts, an equinox transformer, Flax NNX, penzai), attribution
against the first-order term by hand (`jax.jvp`), and every bad input."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import statax as stx

MODES = ["denoising", "noising", "zero", "mean", "resample"]


# ---- random layered programs against the forward pass by hand ----------------------------------


def layer(h, w):  # (..., positions, features): positions mix (a running sum)
    return h + jnp.tanh(jnp.cumsum(h, axis=-2) @ w)


class Layered:
    """A random model: `layers` layers, unrolled or in a `scan`, over examples handled by a
    `vmap` inside the function or by broadcasting, under a `jit` or not."""

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

    def __call__(self, x, ws):
        def one(x):
            if self.scan:
                body = lambda h, w: (stx.save_inter(layer(h, w), name="resid"), None)  # noqa: E731
                x, _ = jax.lax.scan(body, x, ws)
            else:
                for i in range(self.layers):
                    x = stx.save_inter(layer(x, ws[i]), name="resid")
            return jnp.sum(x, axis=(-2, -1))

        f = jax.vmap(one) if self.vmap else one
        return (jax.jit(f) if self.jit else f)(x)

    def by_hand(self, x, patch=None):
        """The layers' outputs `(layers, examples, positions, features)` and the metric, with
        `patch = (layers, mask, source)` replacing, after each layer in `layers`, the values
        `mask` selects with the source's (`source`: the layers' outputs of another run)."""
        h, outs = x, []
        for i in range(self.layers):
            h = layer(h, self.ws[i])
            if patch is not None and i in patch[0]:
                h = jnp.where(patch[1], patch[2][i], h)
            outs.append(h)
        return jnp.stack(outs), jnp.mean(jnp.sum(h, axis=(-2, -1)))

    def expected(self, result):
        """Every patch's metric, by hand, shaped as the sweep's result."""
        clean, _ = self.by_hand(self.clean)
        corrupted, _ = self.by_hand(self.corrupted)
        base = self.corrupted if self.mode == "denoising" else self.clean
        source = {
            "denoising": clean,
            "noising": corrupted,
            "zero": jnp.zeros_like(clean),
            "mean": jnp.broadcast_to(jnp.mean(clean, axis=1, keepdims=True), clean.shape),
            # another example's: the examples rolled by a seeded shift (as sweep documents)
            "resample": jnp.roll(
                clean, 1 + int(np.random.default_rng(0).integers(self.examples - 1)), axis=1
            ),
        }[self.mode]
        out = {}
        for site in result.sites:
            layers = range(self.layers) if self.scan else [int(site.rsplit("_", 1)[1])]
            values = np.zeros(result[site].shape)
            for index in np.ndindex(*values.shape):
                at = dict(zip(self.axes, index))
                picked = [at["layer"]] if "layer" in at else layers
                mask = np.ones((self.examples, self.positions, self.features), bool)
                for axis, name in enumerate(["example", "position", "feature"]):
                    if name in at:
                        keep = np.arange(mask.shape[axis]) == at[name]
                        mask &= keep.reshape([-1 if a == axis else 1 for a in range(3)])
                values[index] = self.by_hand(base, (picked, mask, source))[1]
            out[site] = values
        return out


def check_layered(seed):
    model = Layered(seed)
    result = stx.sweep(
        model,
        lambda out: out,
        (model.clean, model.ws),
        (model.corrupted, model.ws),
        axes=model.axes,
        mode=model.mode,
        examples=model.names.index("example"),
        batch_size=3,
        progress=False,
    )
    want = model.expected(result)
    assert list(result.sites) == (
        ["resid_0"] if model.scan else [f"resid_{i}" for i in range(model.layers)]
    )
    for site in result.sites:
        np.testing.assert_allclose(result[site], want[site], rtol=1e-4, atol=1e-4, err_msg=site)


@pytest.mark.parametrize("seed", range(6))
def test_random_layered_programs_against_the_forward_pass_by_hand(seed):
    check_layered(seed)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(6, 60))
def test_random_layered_programs_at_size(seed):
    check_layered(seed)

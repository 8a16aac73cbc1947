"""Train an equinox MLP on scikit-learn's digits and watch it with statax.

Tracks the activations of every layer (marked with `save_inter`), the weights, the gradients
and the optimizer state (a momentum buffer, a plain pytree), as in-graph statistics every
`--every` steps; writes TensorBoard event files, a pandas DataFrame in tandv's schema, and
plots. Needs the extras in `statax[all]`, which the README's set-up installs (in `.venv`):

    .venv/bin/python examples/train_digits.py --steps 300 --out runs/digits
    .venv/bin/tensorboard --logdir runs/digits
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import statax as stx


class MLP(eqx.Module):
    layers: list

    def __init__(self, sizes, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            x = stx.save_inter(jax.nn.relu(layer(x)), name=f"layer{i}")
        return stx.save_inter(self.layers[-1](x), name="logits")


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


@functools.partial(eqx.filter_jit, donate="all-except-first")
def train_step(model, momentum, x, y, collect: bool):
    # `collect` is static: on the steps without it, this compiles to the plain training step.
    (loss, grads), activations = stx.pull(
        eqx.filter_value_and_grad(loss_fn), summarize=stx.stats, enabled=collect
    )(model, x, y)
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
    model = jax.tree_util.tree_map(lambda p, m: p - 0.05 * m, model, momentum)
    summaries = {}
    if collect:
        summaries = {
            "Activation": activations,
            "Weight": stx.tree_stats(model),
            "Gradient": stx.tree_stats(grads),
            "Optimiser_State": stx.tree_stats(momentum),
        }
    return model, momentum, loss, summaries


def main(steps=300, every=10, batch=128, out="runs/digits", progress=True, seed=0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x_all = jnp.asarray(digits.data / 16.0, jnp.float32)
    y_all = jnp.asarray(digits.target, jnp.int32)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)

    key = jax.random.key(seed)
    model = MLP([64, 128, 128, 10], key)
    momentum = jax.tree_util.tree_map(jnp.zeros_like, eqx.filter(model, eqx.is_array))

    writer = stx.TensorBoardWriter(str(out / "tensorboard"))
    tracker = stx.Tracker(every=every, sinks=[writer])
    rng = np.random.default_rng(seed)
    steps_iter = range(steps)
    if progress:
        from tqdm import tqdm

        steps_iter = tqdm(steps_iter, desc="training", unit="step")
    for step in steps_iter:
        idx = rng.integers(0, len(x_all), batch)
        collect = tracker.due(step)
        model, momentum, loss, summaries = train_step(
            model, momentum, x_all[idx], y_all[idx], collect
        )
        if collect:
            tracker.record(step, summaries)
            writer.scalar("train/loss", float(loss), step)
            if progress:
                steps_iter.set_postfix(loss=f"{float(loss):.3f}")
    tracker.close()

    accuracy = float(jnp.mean(jnp.argmax(jax.vmap(model)(x_all), -1) == y_all))
    frame = tracker.dataframe()
    frame.to_pickle(out / "summaries.pkl")
    last = int(frame[("metadata", "step")].max())
    figures = {
        "exponent_histogram.png": stx.plot_exponent_histogram(frame, "layer0_0", last),
        "activation_rms.png": stx.plot_stat(frame, "rms", "Activation"),
        "gradient_heatmap.png": stx.plot_heatmap(frame, "rms", "Gradient"),
    }
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=80)
    print(
        f"final loss {float(loss):.4f}, train accuracy {accuracy:.3f}; "
        f"{len(frame)} summary rows; wrote {out}/"
    )
    return float(loss), accuracy, frame


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default="runs/digits")
    args = parser.parse_args()
    main(args.steps, args.every, out=args.out)

"""A sweep's two runs and what it patches: the plan (hashable: part of the key of its
programs), the clean and corrupted runs (`pull`ed, traced inside each program), their metric,
the sources of the ablations, and the mask of one patch's index."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import SweepError
from .._drivers.programs import made_of, shapes_of, trace_now
from .._drivers.pull import pull

__all__ = ["Plan", "Runs", "ablation", "mask", "metric_of", "run_of"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sweep patches: hashable, part of the key of its compiled programs."""

    mode: str
    examples: int
    seed: int
    keys: tuple
    axes: tuple  # ((key, ((name, axis), ...)), ...): each site's
    sizes: tuple  # ((key, (size per axis, ...)), ...)
    ranks: tuple  # each key's place in program order (the order `keys` has is the user's)

    def base_and_other(self, clean, corrupted) -> tuple:
        """The arguments of the run patched into (the base run), and of the other run: the
        corrupted run is the base in `"denoising"`, the clean run otherwise."""
        return (corrupted, clean) if self.mode == "denoising" else (clean, corrupted)


class Runs:
    """The clean and corrupted runs: `runs(clean, corrupted) -> ((metric, values), (metric,
    values) or None)`, traced inside each program of a sweep, and `shapes` of them without
    running anything. A dict leaves `jax.eval_shape` in sorted order: `order` keeps `pull`'s
    (program order), and its keys (which know where they were saved), from the trace."""

    def __init__(self, fn, metric, at):
        self.fn, self.at = fn, at
        # `ran=True`: a site in a branch not taken is there under a trace (zeros), its flag
        # says it did not run.
        self.pulled, self.metric, self.order = pull(fn, at=at, ran=True), metric, [[], []]

    def runs(self, clean, corrupted):
        """`((metric, values, ran), ...)`: `ran`, whether each site that may not have run ran."""
        results = []
        for order, args in zip(self.order, (clean, corrupted)):
            if args is None:
                results.append(None)
                continue
            out, values = self.pulled(*args)
            results.append(run_of(self.metric, out, values))
            order[:] = list(results[-1][1])
        return tuple(results)

    def shapes(self, clean, corrupted):
        """`(made_of, shapes)`: the two runs traced now (with the inputs' arrays traced and
        their other leaves static, as `pull`): what they compute, their constants included
        (`programs.made_of`: a sweep program is a function of it, so the one made of an equal
        trace serves), and the values' shapes of each run (`None` for no corrupted run), in
        program order."""
        jaxpr, consts, _, out_info = trace_now(self.runs, (clean, corrupted), {})
        shaped = shapes_of(jaxpr, out_info)
        return made_of(jaxpr, consts), tuple(
            None if r is None else {k: r[1][k] for k in order}
            for order, r in zip(self.order, shaped)
        )

    def prepared(self, plan: Plan, clean, corrupted):
        """Inside a program: the base run's arguments and values, each site's source, and the
        metric of each run, as `plan.mode` says."""
        (clean_metric, clean_values, clean_ran), corrupted_run = self.runs(clean, corrupted)
        corrupted_metric, corrupted_values, corrupted_ran = corrupted_run or (None, None, {})
        keys = plan.keys
        ran = {
            k: jnp.all(jnp.stack([r[k] for r in (clean_ran, corrupted_ran) if k in r]))
            for k in keys
            if k in clean_ran or k in corrupted_ran
        }
        base, _ = plan.base_and_other(clean, corrupted)
        if plan.mode == "denoising":
            base_values, source = corrupted_values, clean_values
        elif plan.mode == "noising":
            base_values, source = clean_values, corrupted_values
        else:
            base_values = clean_values
            source = ablation(plan.mode, clean_values, plan.examples, plan.seed)
        pick = lambda values: {k: values[k] for k in keys}  # noqa: E731
        metrics = (clean_metric, corrupted_metric, ran)
        return base, pick(base_values), pick(source), metrics


def run_of(metric, out, values) -> tuple:
    """`(metric, values, ran)` of a run from what `pull(..., ran=True)` returned."""
    ran = {k[: -len(".ran")]: v for k, v in values.items() if k.endswith(".ran")}
    values = {k: v for k, v in values.items() if not k.endswith(".ran")}
    return metric_of(metric, out), values, ran


def metric_of(metric, out) -> jax.Array:
    value = jnp.asarray(metric(out))
    if value.ndim > 1 or not jnp.issubdtype(value.dtype, jnp.floating):
        raise SweepError(
            f"stx.sweep: the metric returned {value.dtype}{tuple(value.shape)}; it must return "
            "a float scalar, or one per example (shape (batch,)), of the function's output."
        )
    return jnp.mean(value)


def ablation(mode: str, values: dict, axis: int, seed: int) -> dict:
    def source(v):
        if mode == "zero":
            return jnp.zeros_like(v)
        if mode == "mean":
            mean = jnp.mean(v, axis=axis, keepdims=True)
            return jnp.broadcast_to(mean, v.shape).astype(v.dtype)
        examples = v.shape[axis]
        if examples < 2:
            raise SweepError("stx.sweep(mode='resample') needs at least two examples.")
        shift = 1 + int(np.random.default_rng(seed).integers(examples - 1))
        return jnp.roll(v, shift, axis=axis)  # every example takes another's value

    return {k: jax.tree.map(source, v) for k, v in values.items()}


def mask(leaf, axes: dict, index) -> jax.Array:
    """Where `index` (one entry per axis, traced) is, in a leaf's shape, broadcastable (all
    of it where no axis is patched)."""
    mask = jnp.ones((), bool)
    for (_, axis), i in zip(axes.items(), index):
        axis = axis % leaf.ndim
        shape = [1] * leaf.ndim
        shape[axis] = leaf.shape[axis]
        mask = mask & (jnp.arange(leaf.shape[axis]).reshape(shape) == i)
    return mask

"""`sweep`: activation patching over every site and index as one compiled program.

A patch is a (site, index) pair. Every site is planted with a hook that replaces the value at
the index with the source's, where the patch's site is this site, and passes the value through
elsewhere; the site and index are traced, so one program runs every patch: `vmap` over a chunk
of `batch_size` patches, the chunks run in turn through the same compiled program.
Attribution patching reads the gradient of the metric at each site from one backward pass
(`grad_inters`) and takes the first-order term, `(source - base) . gradient`, at each index.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import SweepError
from .._drivers.interventions import grad_inters, plant
from .._drivers.planting import Switch
from .._drivers.pull import pull
from .result import SweepResult

__all__ = ["MODES", "sweep"]

MODES = ("denoising", "noising", "zero", "mean", "resample")


def sweep(
    fn: Callable,
    metric: Callable,
    clean: tuple,
    corrupted: tuple | None = None,
    *,
    at: Any = None,
    sites: Sequence[str] | None = None,
    axes: Mapping[str, int] | None = None,
    mode: str = "denoising",
    method: str = "exact",
    examples: int = 0,
    batch_size: int = 64,
    patch_sharding: jax.sharding.Sharding | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> SweepResult:
    """Activation patching: the metric with each site's value patched, one index at a time.

    Runs `fn` on a base input with one site's value (at one index of its `axes`, or whole)
    replaced by a source value, for every site and index, and returns the metric of each run.
    The patches run as one compiled program (`vmap` over `batch_size` patches at a time; the
    program is compiled once per sweep).

    Args:
        fn: the model, as `pull` takes it.
        metric: a function of `fn`'s output returning a scalar, or one per example (shape
            `(batch,)`, averaged).
        clean: the clean input: a tuple of `fn`'s positional arguments.
        corrupted: the corrupted input, the same way (`"denoising"` and `"noising"` need it).
        at: selections that make the sites (as in `pull`), beside the marks by hand.
        sites: the keys (`"resid_3"`) or names (`"resid"`: every occurrence) to patch; by
            default every key `pull(fn, at=at)` returns.
        axes: the axes patched one index at a time, by name: `{"position": 1}` patches each
            position of every site (axis 1 of its value, the examples' axis 0 included);
            several axes patch every combination. None patches each site whole.
        mode: where the source comes from, and which run it goes into:
            `"denoising"`: the clean run's value into the corrupted run;
            `"noising"`: the corrupted run's value into the clean run;
            `"zero"`, `"mean"` (over the examples) and `"resample"` (another example's, a
            seeded shuffle of the examples): an ablation of the clean run.
        method: `"exact"` runs every patch; `"attribution"` takes the first-order term of each
            patch from one forward and one backward pass at the base run (attribution
            patching), shaped as the exact sweep's result.
        examples: the axis of each site's value that counts the examples, which `"mean"`
            averages over and `"resample"` shuffles (a site stacked by a `scan` over layers
            outside a `vmap` has the layers first: `examples=1`).
        batch_size: how many patches run at once (memory grows with it).
        patch_sharding: a sharding of one axis over devices (`NamedSharding(mesh, P("p"))`):
            each chunk's patches are split over them (`batch_size` a multiple of their
            number). The inputs keep their own sharding either way.
        seed: the shuffle of `"resample"`.
        progress: a progress bar over the chunks (tqdm): None shows one where tqdm is
            installed and the output is a terminal.

    Returns:
        A `SweepResult`: the metric for every site and index, labelled (`.to_dataframe()`,
        `.heatmap()`, an HTML table in a notebook), beside the metric of the clean, corrupted
        and base runs.
    """
    if mode not in MODES:
        raise SweepError(f"stx.sweep: mode={mode!r}; it is one of {', '.join(MODES)}.")
    if method not in ("exact", "attribution"):
        raise SweepError(f"stx.sweep: method={method!r}; it is 'exact' or 'attribution'.")
    clean = _arguments(clean, "clean")
    if mode in ("denoising", "noising") and corrupted is None:
        raise SweepError(f"stx.sweep(mode={mode!r}) patches between two runs: pass corrupted=.")
    corrupted = None if corrupted is None else _arguments(corrupted, "corrupted")
    axes = dict(axes or {})

    at = tuple(at) if isinstance(at, list) else at  # (hashable: a key of the programs)
    runs = _cached(("runs", fn, metric, at), lambda: jax.jit(_runs(fn, metric, at)))
    (clean_metric, clean_values), corrupted_run = runs(clean, corrupted)
    keys = _sites(sites, clean_values)
    clean_values = {k: clean_values[k] for k in keys}
    clean_metric, corrupted_metric = float(clean_metric), None
    if corrupted is not None:
        corrupted_metric, corrupted_values = corrupted_run
        _same_shapes(keys, clean_values, corrupted_values)
        corrupted_metric = float(corrupted_metric)
    sizes = {k: _axis_sizes(k, clean_values[k], axes) for k in keys}

    if mode == "denoising":
        base, base_values, source = corrupted, corrupted_values, clean_values
    elif mode == "noising":
        base, base_values, source = clean, clean_values, {k: corrupted_values[k] for k in keys}
    else:
        base, base_values = clean, clean_values
        source = _ablation(mode, clean_values, examples, seed)
    baseline = corrupted_metric if base is corrupted else clean_metric

    memory = None
    if method == "attribution":
        values = _attribution(fn, metric, at, base, base_values, keys, source, axes, sizes)
    else:
        values, memory = _exact(
            fn, metric, at, base, keys, source, axes, sizes, batch_size, patch_sharding, progress
        )
    return SweepResult(
        sites=keys,
        axes=tuple(axes),
        values=values,
        baseline=baseline,
        clean=clean_metric,
        corrupted=corrupted_metric,
        mode=mode,
        method=method,
        locations={k: getattr(k, "location", "") for k in keys},
        lowered=memory,
    )


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_KEEP = 8  # the compiled programs kept, the most recently used


def _cached(key, make):
    """A jitted program shared by the sweeps of one function, metric, sites and axes (the last
    `_KEEP` of them): a sweep over new inputs of the same shapes compiles nothing."""
    try:
        program = _PROGRAMS.pop(key)
    except TypeError:  # something in the key does not hash: this sweep's own
        return make()
    except KeyError:
        program = make()
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _KEEP:
        _PROGRAMS.popitem(last=False)
    return program


def _runs(fn, metric, at):
    """`(clean, corrupted) -> ((metric, values), (metric, values) or None)`: the two runs."""
    pulled = pull(fn, at=at)

    def runs(clean, corrupted):
        results = []
        for args in (clean, corrupted):
            if args is None:
                results.append(None)
                continue
            out, values = pulled(*args)
            results.append((_metric(metric, out), values))
        return tuple(results)

    return runs


def _arguments(args, which: str) -> tuple:
    if not isinstance(args, tuple):
        raise SweepError(
            f"stx.sweep: {which}= is a tuple of fn's positional arguments, got "
            f"{type(args).__name__}. For one argument x, pass ({which}=(x,))."
        )
    return args


def _sites(sites, values: dict) -> list:
    if sites is None:
        return list(values)
    keys, missing = [], []
    for site in sites:
        found = [k for k in values if k == site or k.rsplit("_", 1)[0] == site]
        keys += [k for k in found if k not in keys]
        if not found:
            missing.append(site)
    if missing:
        raise SweepError(
            f"stx.sweep: the sites {missing} did not run in the clean run: no mark or selected "
            f"place of that key or name saved a value (a branch not taken, a name misspelt). "
            f"The sites that ran: {list(values)}."
        )
    return keys


def _same_shapes(keys, clean: dict, corrupted: dict) -> None:
    for key in keys:
        if key not in corrupted:
            raise SweepError(
                f"stx.sweep: site {key!r} (saved at {getattr(key, 'location', '?')}) ran in the "
                "clean run but not in the corrupted one. Patch sites that run in both."
            )
        shapes = [[jnp.shape(x) for x in jax.tree.leaves(v)] for v in (clean[key], corrupted[key])]
        if shapes[0] != shapes[1]:
            raise SweepError(
                f"stx.sweep: site {key!r} (saved at {getattr(key, 'location', '?')}) has shape "
                f"{shapes[0]} in the clean run and {shapes[1]} in the corrupted one: the two "
                "inputs must give every site one shape (the same batch, the same length; pad "
                "the prompts to one length)."
            )


def _metric(metric, out) -> jax.Array:
    value = jnp.asarray(metric(out))
    if value.ndim > 1 or not jnp.issubdtype(value.dtype, jnp.floating):
        raise SweepError(
            f"stx.sweep: the metric returned {value.dtype}{tuple(value.shape)}; it must return "
            "a float scalar, or one per example (shape (batch,)), of the function's output."
        )
    return jnp.mean(value)


def _axis_sizes(key, value, axes: dict) -> tuple[int, ...]:
    leaves = jax.tree.leaves(value)
    sizes = []
    for name, axis in axes.items():
        lengths = {leaf.shape[axis] for leaf in leaves if -leaf.ndim <= axis < leaf.ndim}
        if len(lengths) != 1 or any(not -leaf.ndim <= axis < leaf.ndim for leaf in leaves):
            shapes = [leaf.shape for leaf in leaves]
            raise SweepError(
                f"stx.sweep: site {key!r} (saved at {getattr(key, 'location', '?')}) has no "
                f"axis {axis} ({name!r}) to patch along: its value's shape is "
                f"{shapes[0] if len(shapes) == 1 else shapes}. Give axes= that every site has, "
                "or sweep the sites apart."
            )
        sizes.append(lengths.pop())
    return tuple(sizes)


def _ablation(mode: str, values: dict, axis: int, seed: int) -> dict:
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


def _mask(leaf, axes: dict, index) -> jax.Array:
    """Where `index` (one entry per axis, traced) is, in a leaf's shape, broadcastable (all
    of it where no axis is patched)."""
    mask = jnp.ones((), bool)
    for (_, axis), i in zip(axes.items(), index):
        axis = axis % leaf.ndim
        shape = [1] * leaf.ndim
        shape[axis] = leaf.shape[axis]
        mask = mask & (jnp.arange(leaf.shape[axis]).reshape(shape) == i)
    return mask


def _exact(fn, metric, at, base, keys, source, axes, sizes, batch_size, sharding, progress):
    patches = [(s, i) for s, key in enumerate(keys) for i in range(math.prod(sizes[key]))]
    site_ids = np.array([s for s, _ in patches], np.int32)
    flat = np.array([i for _, i in patches], np.int32)
    chunk = max(1, min(int(batch_size), len(patches)))
    key = ("exact", fn, metric, at, tuple(keys), tuple(axes.items()), tuple(sizes.items()))
    run = _cached(key, lambda: _patch_program(fn, metric, at, keys, axes, sizes))
    results, memory = [], None
    starts = range(0, len(patches), chunk)
    for start in _progress(starts, progress, len(patches)):
        stop = min(start + chunk, len(patches))
        pad = chunk - (stop - start)  # the last chunk padded: one compiled shape
        s = np.concatenate([site_ids[start:stop], np.repeat(site_ids[stop - 1], pad)])
        i = np.concatenate([flat[start:stop], np.repeat(flat[stop - 1], pad)])
        if sharding is not None:  # the chunk's patches split over devices
            s, i = jax.device_put((s, i), sharding)
        chunk_values = run(s, i, base, source)
        results.append(np.asarray(chunk_values)[: stop - start])
        if memory is None:  # the chunk's program, lowered when asked (`memory_analysis()`)
            memory = functools.partial(run.lower, s, i, base, source)
    values = np.concatenate(results)
    out, at_ = {}, 0
    for key in keys:
        n = math.prod(sizes[key])
        out[key] = values[at_ : at_ + n].reshape(sizes[key])
        at_ += n
    return out, memory


def _patch_program(fn, metric, at, keys, axes, sizes):
    """The compiled program of a chunk: `(sites, indices, base, source) -> metrics`, every
    site planted with a `Switch` on where the patch is its own."""
    planted = plant(fn, at=at)

    def one(site, flat_index, base, source):
        values = {}
        for s, key in enumerate(keys):
            index = jnp.unravel_index(flat_index, sizes[key]) if sizes[key] else ()
            masks = jax.tree.map(lambda leaf: _mask(leaf, axes, index), source[key])
            values[key] = Switch(site == s, masks, source[key])
        return _metric(metric, planted(values, *base))

    @jax.jit
    def run(sites, indices, base, source):
        return jax.vmap(one, in_axes=(0, 0, None, None))(sites, indices, base, source)

    return run


def _attribution(fn, metric, at, base, base_values, keys, source, axes, sizes):
    def loss(*args):
        return _metric(metric, fn(*args))

    def first_order(base, base_values, source):
        baseline, grads = grad_inters(loss, at=at)(*base)
        out = {}
        for key in keys:
            total = 0.0
            for src, v, g in zip(
                *map(jax.tree.leaves, (source[key], base_values[key], grads[key]))
            ):
                term = (src - v) * g
                kept = [a % term.ndim for a in axes.values()]
                summed = jnp.sum(term, axis=tuple(a for a in range(term.ndim) if a not in kept))
                order = sorted(kept)  # what the sum leaves, in the order of `axes`
                total = total + jnp.transpose(summed, [order.index(a) for a in kept])
            out[key] = baseline + total
        return out

    key = ("attribution", fn, metric, at, tuple(keys), tuple(axes.items()))
    program = _cached(key, lambda: jax.jit(first_order))
    values = program(base, {k: base_values[k] for k in keys}, source)
    return {key: np.asarray(values[key]).reshape(sizes[key]) for key in keys}


def _progress(items, progress, total):
    if progress is False:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError(
                'stx.sweep(progress=True) needs tqdm. Install it with: pip install "statax[plot]"'
            ) from None
        return items
    return tqdm(items, desc="patching", unit="chunk", disable=None if progress is None else False)

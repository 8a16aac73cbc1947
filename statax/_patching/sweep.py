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
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import fastpaths as _fastpaths
from .._core.errors import SweepError
from .._core.sinking import sink
from .._drivers.interventions import plant, planted_pull
from .._drivers.planting import Add, Switch, loop_rows
from .._drivers.programs import Programs, kind_of
from .._monitor.optional import progress_bar
from . import checks
from .chunks import chunked, size_of
from .result import SweepResult
from .runs import Plan, Runs, ablation, mask, metric_of, run_of

__all__ = ["MODES", "sweep"]

MODES = ("denoising", "noising", "zero", "mean", "resample")


def sweep(
    fn: Callable,
    metric: Callable,
    clean: tuple,
    corrupted: tuple | None = None,
    *,
    at: Any = None,
    sites: str | Sequence[str] | None = None,
    axes: Mapping[str, int] | Mapping[str, Mapping[str, int]] | None = None,
    mode: str = "denoising",
    method: str = "exact",
    examples: int = 0,
    batch_size: int = 64,
    reuse: bool = True,
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
        sites: the keys (`"resid_3"`) or names (`"resid"`: every occurrence) to patch (one
            string is one of them); by default every key `pull(fn, at=at)` returns.
        axes: the axes patched one index at a time, by name: `{"position": 1}` patches each
            position of every site (axis 1 of its value, the examples' axis 0 included);
            several axes patch every combination. None patches each site whole. For sites with
            different axes, a mapping of sites (keys or names) to such mappings:
            `{"resid": {"position": 1}, "attn": {"position": 1, "head": 2}}`; a site not in it
            is patched whole.
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
        reuse: start each patch from the base run: the two runs run once a sweep, a chunk
            holds one site's patches, and each site the program reaches before the patched
            one takes its base value instead of computing it (one program still: each site
            is a `cond`). In a `scan` over layers, each row of its sites that runs before the
            chunk's first patch does (a chunk holds one row's patches where they fill at
            least half of `batch_size`). A site inside
            another loop (a `while_loop`, a scan in a scan) is patched as with
            `reuse=False`, which runs the whole model for every patch (see "Patching
            experiments"); the results are the same either way.
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
    checks.batch_size(batch_size)
    clean = checks.arguments(clean, "clean")
    if mode in ("denoising", "noising") and corrupted is None:
        raise SweepError(f"stx.sweep(mode={mode!r}) patches between two runs: pass corrupted=.")
    corrupted = None if corrupted is None else checks.arguments(corrupted, "corrupted")
    axes = dict(axes or {})
    per_site = any(isinstance(v, Mapping) for v in axes.values())

    at = tuple(at) if isinstance(at, list) else at  # (hashable: a key of the programs)
    runs = Runs(fn, metric, at)
    # The fast path of a one-program sweep (attribution): the program the last such sweep ran
    # starts before the trace, and its result is kept where the trace is that sweep's.
    asked = guess = early = None
    if method == "attribution" and _fastpaths.on:
        asked = (
            method,
            repr(sites),
            repr(axes),
            mode,
            examples,
            seed,
            kind_of((clean, corrupted), {}),
        )
        last = _LAST.get(asked)
        if last is not None and last[0] is fn and last[1] is metric and last[2] == at:
            guess = last[3]
        if guess is not None and guess.startable():
            early = guess.run((clean, corrupted), {})  # (dispatched: it runs as the host traces)
    made, (clean_values, corrupted_values) = runs.shapes(clean, corrupted)  # (traced, not run)
    keys = checks.sites(sites, clean_values)
    if corrupted is not None:
        checks.same_shapes(keys, clean_values, corrupted_values)
    if per_site:
        checks.axes_name_sites(axes, keys)
    if method == "attribution":
        checks.differentiable(keys, clean_values)
    site_axes = {k: checks.axes_of(k, axes, per_site) for k in keys}
    sizes = {k: checks.axis_sizes(k, clean_values[k], site_axes[k]) for k in keys}
    plan = Plan(
        mode,
        examples,
        seed,
        tuple(keys),
        tuple((k, tuple(a.items())) for k, a in site_axes.items()),
        tuple(sizes.items()),
        tuple(list(clean_values).index(k) for k in keys),
    )

    lowered = None
    kept = _Kept(made, plan, method, batch_size, patch_sharding, reuse and method == "exact")
    if method == "attribution":
        traced = kept.get() or kept.put(
            _PROGRAMS.traced(_attribution(runs, plan, clean_values), clean, corrupted)
        )
        if asked is not None:
            _LAST[asked] = (fn, metric, at, traced)
            while len(_LAST) > 8:
                del _LAST[next(iter(_LAST))]
        if early is not None and traced is guess:
            out = traced.unflatten(early)
        else:
            out = traced(clean, corrupted)
        # (every result read back at once: one wait, not one per array)
        values, (clean_metric, corrupted_metric, ran) = jax.device_get(out)
        checks.check_ran(ran)
        values = {k: np.asarray(values[k]).reshape(sizes[k]) for k in keys}
    else:
        values, clean_metric, corrupted_metric, lowered = _exact(
            runs,
            plan,
            clean,
            corrupted,
            batch_size,
            patch_sharding,
            progress,
            kept,
            reuse,
        )
    clean_metric = float(clean_metric)
    corrupted_metric = None if corrupted is None else float(corrupted_metric)
    return SweepResult(
        sites=keys,
        axes={k: tuple(a) for k, a in site_axes.items()} if per_site else tuple(axes),
        values=values,
        baseline=corrupted_metric if mode == "denoising" else clean_metric,
        clean=clean_metric,
        corrupted=corrupted_metric,
        mode=mode,
        method=method,
        locations={k: getattr(k, "location", "") for k in keys},
        lowered=lowered,
    )


# The compiled programs of sweeps, kept by what they compute (the last eight): a sweep over new
# inputs of the same shapes compiles nothing, and one of a changed model runs it as it is now.
_PROGRAMS = Programs(keep=8)
# The traces of sweep programs (`Traced`: a program and its constants), kept by what the two
# runs compute (`made_of`: their trace, constants included) and the plan: a sweep whose runs
# trace as a sweep before did (the same model and metric, reading the same arrays) skips
# tracing its program, which is a function of them. The last eight.
_TRACES: collections.OrderedDict = collections.OrderedDict()
# The last one-program sweeps, by what they were asked (their options and the kind of their
# inputs): `(fn, metric, at, Traced)`, whose program the next such sweep starts early.
_LAST: dict = {}


@dataclasses.dataclass(frozen=True)
class _Kept:
    """Where a sweep's `Traced` is kept: by what its runs compute and how it sweeps."""

    made: tuple
    plan: Any
    method: str
    batch_size: int
    sharding: Any
    reuse: bool

    def get(self):
        traced = _TRACES.pop(self, None) if _fastpaths.on else None
        if traced is not None:
            _TRACES[self] = traced
        return traced

    def put(self, traced):
        _TRACES[self] = traced
        while len(_TRACES) > 8:
            _TRACES.popitem(last=False)
        return traced


@dataclasses.dataclass
class _Programs:
    """An exact sweep's programs, traced at its first chunk (or kept). With `reuse`: `prepare`
    runs the two runs once a sweep, and `chunk` runs a chunk of one site's patches from their
    values (`_reuse_program`); without: `chunk` runs the two runs and a chunk of any patches
    (`_patch_program`)."""

    reuse: bool
    prepare: Any = None
    chunk: Any = None
    size: int | None = None  # the patches a chunk of `chunk` holds
    rows: dict | None = None  # the sites a scan stacks (`planting.loop_rows`)


def _exact(runs, plan, clean, corrupted, batch_size, sharding, progress, kept, reuse):
    sizes = dict(plan.sizes)
    programs = kept.get() or kept.put(_Programs(reuse))
    if reuse:  # the two runs, once: each site's base value and source, the metrics
        if programs.prepare is None:
            programs.prepare = _PROGRAMS.traced(
                functools.partial(_prepared, runs, plan), clean, corrupted
            )
        base_values, source, metrics = programs.prepare(clean, corrupted)
        checks.check_ran(metrics[2])
        base, _ = plan.base_and_other(clean, corrupted)
        make = functools.partial(_reuse_program, runs, plan)
    else:
        make = functools.partial(_patch_program, runs, plan)

    def args_of(chunk, size):  # (padded with its last patch: one compiled shape)
        padded = chunk + [chunk[-1]] * (size - len(chunk))
        s = np.array([p[0] for p in padded], np.int32)
        i = np.array([p[1] for p in padded], np.int32)
        if sharding is not None:  # the chunk's patches split over devices
            s, i = jax.device_put((s, i), sharding)
        return (s[0], i, base, base_values, source) if reuse else (s, i, clean, corrupted)

    def program(size):
        """The chunk's program for chunks of `size`: traced once a sweep (or kept), and with
        it which sites a scan stacks (`loop_rows`)."""
        if programs.size != size:
            with loop_rows() as found:
                args = args_of([(0, 0)], size)
                programs.chunk = _PROGRAMS.traced(make(), *args, rewrite=sink if reuse else None)
            programs.size, programs.rows = size, found
        return programs.chunk

    # The patches, a chunk at a time; with `reuse`, a chunk holds one site's patches (its run
    # before the site is skipped), and where a scan stacks a site, one row's if that fits.
    sharded = sharding is not None
    size = size_of(plan, batch_size, reuse, sharded, programs.rows)
    if reuse and programs.rows is None:  # (known once the program is traced, or kept)
        program(size)
        size = size_of(plan, batch_size, reuse, sharded, programs.rows)
    chunks = chunked(plan, size, reuse, programs.rows if reuse else None)
    bar = progress_bar(
        progress, "stx.sweep", "plot", iterable=chunks, desc="patching", unit="chunk"
    )
    out, lowered = {}, None
    for n, chunk in enumerate(chunks if bar is None else bar):
        args = args_of(chunk, size)
        if lowered is None:  # the chunk's program, lowered when asked (`memory_analysis()`)
            lowered = functools.partial(program(size).lower, *args)
        chunk_values = program(size)(*args)
        if not reuse:
            chunk_values, metrics = chunk_values
            if not n:
                checks.check_ran(metrics[2])
        chunk_values = np.asarray(chunk_values)[: len(chunk)]
        sites, indices = np.array(chunk).T  # (where each patch's metric goes)
        for s in np.unique(sites):
            if s not in out:
                out[s] = np.zeros(math.prod(sizes[plan.keys[s]]), chunk_values.dtype)
            out[s][indices[sites == s]] = chunk_values[sites == s]
    out = {key: out[s].reshape(sizes[key]) for s, key in enumerate(plan.keys)}
    return out, metrics[0], metrics[1], lowered


def _prepared(runs: Runs, plan: Plan, clean, corrupted):
    """The program that prepares a sweep with `reuse`: each site's value in the base run and
    its source, and the metrics of the two runs."""
    _, base_values, source, metrics = runs.prepared(plan, clean, corrupted)
    return base_values, source, metrics


def _patched(runs: Runs, plan: Plan):
    """`(one, reached)`. `one`, the metric of one patch: `(site, flat index, base arguments,
    sources, base values, reach) -> metric`, every site planted with a `Switch`, on where the
    patch is its own; given the base values (`reuse`), each `Switch` knows the base run's value
    there, whether the patch is at a site later in program order (`sites=` may list them in
    any order) and where a chunk's patches may be (`reach`, from `reached`: see `Switch`)."""
    planted = plant(runs.fn, at=runs.at)
    axes, sizes = {k: dict(a) for k, a in plan.axes}, dict(plan.sizes)

    def masks(key, flat_index, source):
        index = jnp.unravel_index(flat_index, sizes[key]) if sizes[key] else ()
        return jax.tree.map(lambda leaf: mask(leaf, axes[key], index), source[key])

    def one(site, flat_index, base, source, base_values=None, reach=None):
        values = {}
        rank = jnp.asarray(plan.ranks)[site]  # (the patched site's place in program order)
        for s, key in enumerate(plan.keys):
            known = ()
            if base_values is not None:
                known = (base_values[key], rank > plan.ranks[s], reach[key])
            values[key] = Switch(site == s, masks(key, flat_index, source), source[key], *known)
        return metric_of(runs.metric, planted(values, *base))

    def reached(site, indices, source):
        """Where a chunk of one site's patches (`indices`, not batched) may patch: per site,
        the union of their masks there (none but at `site`)."""
        return {
            key: jax.tree.map(
                lambda m: (site == s) & jnp.any(m, axis=0),
                jax.vmap(lambda i, key=key: masks(key, i, source))(indices),
            )
            for s, key in enumerate(plan.keys)
        }

    return one, reached


def _reuse_program(runs: Runs, plan: Plan):
    """The compiled program of a chunk of one site's patches, from the base run: `(site,
    indices, base, base values, sources) -> metrics`. A site before the patched one (which
    `site`, not batched, says) is computed; the patched one and those before it take the base
    run's values, and `sinking.sink` moves what computes a value into the branch that needs
    it, so that the run before the patched site is skipped."""
    one, reached = _patched(runs, plan)

    def run(site, indices, base, base_values, source):
        reach = reached(site, indices, source)  # (one for the chunk: a scan skips rows)
        chunk = lambda i: one(site, i, base, source, base_values, reach)  # noqa: E731
        return jax.vmap(chunk)(indices)

    return run


def _patch_program(runs: Runs, plan: Plan):
    """The compiled program of a chunk: `(sites, indices, clean, corrupted) -> (metrics, clean
    metric, corrupted metric)`. The two runs are computed once per chunk (nothing in them
    depends on the patch)."""
    one, _ = _patched(runs, plan)

    def run(sites, indices, clean, corrupted):
        base, _, source, metrics = runs.prepared(plan, clean, corrupted)
        return jax.vmap(one, in_axes=(0, 0, None, None))(sites, indices, base, source), metrics

    return run


def _attribution(runs: Runs, plan: Plan, shapes: dict):
    """The compiled program of an attribution sweep: `(clean, corrupted) -> ({key: metric at
    each index}, clean metric, corrupted metric)`. One forward and one backward pass of the
    base run give its metric, its values at the sites and the metric's gradient with respect
    to each (a zero perturbation planted there, `planted_pull`); the source run, where it is
    the other run, is one forward pass more."""
    axes = {k: dict(a) for k, a in plan.axes}

    def first_order(clean, corrupted):
        base, other = plan.base_and_other(clean, corrupted)
        zeros = {
            k: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[k]) for k in plan.keys
        }

        def loss(perturbations):
            values = {k: Add(d) for k, d in perturbations.items()}
            out, pulled = planted_pull(runs.fn, runs.at, values, base, ran=True)
            run = run_of(runs.metric, out, pulled)
            return run[0], run

        (_, (baseline, base_values, ran)), grads = jax.value_and_grad(loss, has_aux=True)(zeros)
        if plan.mode in ("denoising", "noising"):
            other_metric, source, other_ran = run_of(runs.metric, *runs.pulled(*other))
            ran = {k: ran.get(k, True) & other_ran.get(k, True) for k in {*ran, *other_ran}}
        else:
            other_metric = (
                None if corrupted is None else metric_of(runs.metric, runs.pulled(*corrupted)[0])
            )
            source = ablation(plan.mode, base_values, plan.examples, plan.seed)
        out = {}
        for key in plan.keys:
            total = 0.0
            leaves = map(jax.tree.leaves, (source[key], base_values[key], grads[key]))
            for src, v, g in zip(*leaves):
                term = (src - v) * g
                kept = [a % term.ndim for a in axes[key].values()]
                summed = jnp.sum(term, axis=tuple(a for a in range(term.ndim) if a not in kept))
                order = sorted(kept)  # what the sum leaves, in the order of `axes`
                total = total + jnp.transpose(summed, [order.index(a) for a in kept])
            out[key] = baseline + total
        ran = {k: ran[k] for k in plan.keys if k in ran}
        if plan.mode == "denoising":
            return out, (other_metric, baseline, ran)
        return out, (baseline, other_metric, ran)

    return first_order

"""In-graph summary statistics: `stats` of any pytree, computed inside `jit`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["exponent_range", "path_name", "stats", "tree_stats"]

SCALARS = (
    "mean",
    "std",
    "min",
    "max",
    "rms",
    "max_abs",
    "zero_fraction",
    "zero_count",
    "nan_count",
    "inf_count",
)


def exponent_range(dtype) -> tuple[int, int]:
    """`(lo, hi)`: the exponents `n` (values in `[2**n, 2**(n+1))`) a dtype can hold, subnormals
    included. `stats` counts values per exponent in `lo..hi`."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)
    info = ml_dtypes.finfo(dtype)
    return int(info.minexp) - int(info.nmant), int(info.maxexp) - 1


def stats(tree: Any, *, format: str | None = "float8_e4m3fn") -> Any:
    """Summary statistics of every array leaf of `tree`, computed where it is (inside `jit`).

    Per leaf, a dict of scalars: `mean`, `std`, `min`, `max`, `rms`, `max_abs` (over the finite
    values), `zero_fraction` and `zero_count` (exact zeros), `nan_count`, `inf_count`; and an
    exponent histogram: `exponent_counts[i]` counts the finite non-zero values in
    `[2**n, 2**(n+1))` with `n = exponent_min + i`, over the range of the leaf's dtype;
    `underflow` and `overflow` count the values that a cast to `format` (an `ml_dtypes` float
    format such as `"float8_e4m3fn"`; `None` for none) would flush to zero or push past its
    largest value, as tandv's schema records them.

    Use it as `stx.pull(fn, summarize=stx.stats)`, so that only the summaries leave the device.

    Args:
        tree: any pytree; non-array leaves are left as they are.
        format: the low-precision format for `underflow` / `overflow`.

    Returns:
        `tree` with each array leaf replaced by its dict of statistics.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> s = stx.stats(jnp.array([0.0, 1.0, -3.0, 1000.0]))
        >>> float(s["max_abs"]), float(s["zero_fraction"]), int(s["overflow"])
        (1000.0, 0.25, 1)
    """
    return jax.tree_util.tree_map(lambda x: _leaf_stats(x, format), tree)


def _leaf_stats(x, format):
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return x
    x = jnp.asarray(x)
    lo, hi = exponent_range(x.dtype)
    nbins = hi - lo + 1
    # Everything in float32 (or wider): exact for bfloat16, float16 and small integers.
    v = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if v.dtype != jnp.float32:  # float64: one more pass is fine
        return _wide_stats(v, x.dtype, lo, hi, format)
    a = jnp.abs(v)
    # One histogram pass gives the exponents and the NaN, Inf and zero counts. Exponents from
    # the bits; subnormals scaled into the normal range first, so theirs are exact too.
    subnormal = a < 2.0**-126
    scaled = jnp.where(subnormal, a * 2.0**64, a)
    biased = (jax.lax.bitcast_convert_type(scaled, jnp.int32) >> 23) & 0xFF
    exponent = biased - 127 - jnp.where(subnormal, 64, 0)
    key = jnp.where(
        jnp.isnan(v),
        nbins,
        jnp.where(jnp.isinf(v), nbins + 1, jnp.where(a == 0, nbins + 2, exponent - lo)),
    )
    key = jnp.clip(key, 0, nbins + 2)
    # The same pass classifies each value for the low-precision format: 0 in range,
    # 1 flushed to zero, 2 past its largest value (a 2-d histogram, one scatter).
    if format is not None:
        info = ml_dtypes.finfo(jnp.dtype(format))
        klass = jnp.where(
            (a > 0) & (a < float(info.smallest_subnormal) / 2),
            1,
            jnp.where(jnp.isfinite(v) & (a > float(info.max)), 2, 0),
        )
        key = key * 3 + klass
    size = (nbins + 3) * (3 if format is not None else 1)
    flat = jnp.zeros(size, jnp.int32).at[key.ravel()].add(1)
    counts = flat.reshape(nbins + 3, -1).sum(1)
    nan_count, inf_count, zero_count = counts[nbins], counts[nbins + 1], counts[nbins + 2]
    finite = jnp.isfinite(v)
    n = jnp.maximum(v.size - nan_count - inf_count, 1).astype(jnp.float32)
    safe = jnp.where(finite, v, 0)
    squares = jnp.sum(safe * safe)
    low = jnp.min(jnp.where(finite, v, jnp.inf))
    high = jnp.max(jnp.where(finite, v, -jnp.inf))
    mean, std = _mean_std(v, finite, n, low, high)
    out = {
        "mean": mean,
        "std": std,
        "min": low,
        "max": high,
        "rms": jnp.sqrt(squares / n),
        "max_abs": jnp.maximum(jnp.abs(low), jnp.abs(high)),
        "zero_fraction": zero_count / max(v.size, 1),
        "zero_count": zero_count,
        "nan_count": nan_count,
        "inf_count": inf_count,
        "exponent_min": jnp.int32(lo),
        "exponent_counts": counts[:nbins],
        # An empty array of the leaf's dtype: the dtype travels to the host, no data does.
        "dtype": jnp.zeros((0,), x.dtype),
    }
    if format is not None:
        per_class = flat.reshape(nbins + 3, 3).sum(0)
        out["underflow"], out["overflow"] = per_class[1], per_class[2]
    return out


def _mean_std(v, finite, n, low, high):
    """Mean and standard deviation over the finite values, stable in float32 whatever the
    offset and scale: shifted to the midrange (exact for values close together) and divided by
    the half-range, then two passes, so nothing like `E[x**2] - mean**2` cancels and no square
    underflows or overflows."""
    shift = jnp.where(jnp.isfinite(low + high), low / 2 + high / 2, 0).astype(v.dtype)
    half = high / 2 - low / 2
    scale = jnp.where(jnp.isfinite(half) & (half > 0), half, 1).astype(v.dtype)
    d = jnp.where(finite, (v - shift) / scale, 0)
    mean_d = jnp.sum(d) / n
    centred = jnp.where(finite, d - mean_d, 0)
    return shift + scale * mean_d, scale * jnp.sqrt(jnp.sum(centred * centred) / n)


def _format_counts(a, finite, format):
    info = ml_dtypes.finfo(jnp.dtype(format))
    return {
        "underflow": jnp.sum((a > 0) & (a < float(info.smallest_subnormal) / 2)),
        "overflow": jnp.sum(finite & (a > float(info.max))),
    }


def _wide_stats(v, dtype, lo, hi, format):
    finite = jnp.isfinite(v)
    n = jnp.maximum(jnp.sum(finite), 1).astype(v.dtype)
    safe = jnp.where(finite, v, 0)
    low = jnp.min(jnp.where(finite, v, jnp.inf))
    high = jnp.max(jnp.where(finite, v, -jnp.inf))
    mean, std = _mean_std(v, finite, n, low, high)
    a = jnp.abs(safe)
    nonzero = finite & (v != 0)
    _, exponent = jnp.frexp(jnp.where(nonzero, a, 1))
    bins = jnp.clip(exponent - 1 - lo, 0, hi - lo)
    counts = (
        jnp.zeros(hi - lo + 1, jnp.int32).at[bins.ravel()].add(nonzero.ravel().astype(jnp.int32))
    )
    out = {
        "mean": mean,
        "std": std,
        "min": low,
        "max": high,
        "rms": jnp.sqrt(jnp.sum(safe**2) / n),
        "max_abs": jnp.max(a),
        "zero_fraction": jnp.mean(v == 0),
        "zero_count": jnp.sum(v == 0),
        "nan_count": jnp.sum(jnp.isnan(v)),
        "inf_count": jnp.sum(jnp.isinf(v)),
        "exponent_min": jnp.int32(lo),
        "exponent_counts": counts,
        "dtype": jnp.zeros((0,), dtype),
    }
    if format is not None:
        out.update(_format_counts(a, finite, format))
    return out


def tree_stats(tree: Any, *, format: str | None = "float8_e4m3fn") -> dict[str, Any]:
    """`stats` of every array leaf of `tree`, keyed by its path (`"layers[0].weight"`), for
    weights, gradients and optimizer state.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> sorted(stx.tree_stats({"w": jnp.ones(2), "b": [jnp.zeros(1)]}))
        ['b[0]', 'w']
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {
        path_name(path): _leaf_stats(leaf, format)
        for path, leaf in leaves
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic))
    }


def path_name(path) -> str:
    """A pytree path as a readable name: `layers[0].weight`, `opt.mu`."""
    name = ""
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            name += f"[{key.idx}]"
        else:
            part = getattr(key, "key", getattr(key, "name", key))
            name += f".{part}" if name else str(part)
    return name

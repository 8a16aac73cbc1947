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
    values), `zero_fraction`, `nan_count`, `inf_count`; and an exponent histogram:
    `exponent_counts[i]` counts the finite non-zero values in `[2**n, 2**(n+1))` with
    `n = exponent_min + i`, over the range of the leaf's dtype; `underflow` and `overflow`
    count the values that a cast to `format` (an `ml_dtypes` float format such as
    `"float8_e4m3fn"`; `None` for none) would flush to zero or push past its largest value,
    as tandv's schema records them.

    Use it as `stx.pull(fn, summarize=stx.stats)`, so that only the summaries leave the device.

    Args:
        tree: any pytree; non-array leaves are left as they are.
        format: the low-precision format for `underflow` / `overflow`.

    Returns:
        `tree` with each array leaf replaced by its dict of statistics.

    Example:
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
    v = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.floating) else x
    v = v.astype(jnp.promote_types(v.dtype, jnp.float32))
    finite = jnp.isfinite(v)
    n_finite = jnp.maximum(jnp.sum(finite), 1)
    safe = jnp.where(finite, v, 0)
    mean = jnp.sum(safe) / n_finite
    var = jnp.sum(jnp.where(finite, (v - mean) ** 2, 0)) / n_finite
    absolute = jnp.abs(safe)
    nonzero = finite & (v != 0)
    _, exponent = jnp.frexp(jnp.where(nonzero, absolute, 1))
    bins = jnp.clip(exponent - 1 - lo, 0, hi - lo)
    counts = (
        jnp.zeros(hi - lo + 1, jnp.int32).at[bins.ravel()].add(nonzero.ravel().astype(jnp.int32))
    )
    out = {
        "mean": mean,
        "std": jnp.sqrt(var),
        "min": jnp.min(jnp.where(finite, v, jnp.inf)),
        "max": jnp.max(jnp.where(finite, v, -jnp.inf)),
        "rms": jnp.sqrt(jnp.sum(safe**2) / n_finite),
        "max_abs": jnp.max(absolute),
        "zero_fraction": jnp.mean(v == 0),
        "nan_count": jnp.sum(jnp.isnan(v)),
        "inf_count": jnp.sum(jnp.isinf(v)),
        "exponent_min": jnp.int32(lo),
        "exponent_counts": counts,
        # An empty array of the leaf's dtype: the dtype travels to the host, no data does.
        "dtype": jnp.zeros((0,), x.dtype),
    }
    if format is not None:
        info = ml_dtypes.finfo(jnp.dtype(format))
        out["underflow"] = jnp.sum(nonzero & (absolute < float(info.smallest_subnormal) / 2))
        out["overflow"] = jnp.sum(finite & (absolute > float(info.max)))
    return out


def tree_stats(tree: Any, *, format: str | None = "float8_e4m3fn") -> dict[str, Any]:
    """`stats` of every array leaf of `tree`, keyed by its path (`"layers[0].weight"`), for
    weights, gradients and optimizer state.

    Example:
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

"""`describe`: one readable line per intermediate, at a prompt or in a debugger."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._pull import origins
from ._stats import path_name, stats

__all__ = ["describe"]


_summary = jax.jit(functools.partial(stats, format=None))


class Description:
    """What `describe` returns: text at a prompt; in a notebook, treescope's rendering of the
    intermediates when treescope is installed."""

    def __init__(self, text: str, inters: Any):
        self.text = text
        self._inters = inters

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__

    def _repr_html_(self) -> str:
        try:
            import treescope
        except ImportError:
            return self._pre()
        return treescope.render_to_html(self._inters)

    def _pre(self) -> str:
        import html

        return f"<pre>{html.escape(self.text)}</pre>"


def describe(inters: dict[str, Any]) -> Description:
    """One line per array in `inters`: name, shape, dtype, mean, std, min, max (over finite
    values), NaN and Inf counts, and the file:line of the `save_inter` (for a dict that `pull`
    returned). Statistics are computed on the device, one small transfer per array.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     return stx.save_inter(x * 2, name="double")
        >>> _, inters = stx.pull(f)(jnp.arange(4.0))
        >>> print(stx.describe(inters))  # doctest: +ELLIPSIS
        double_0  (4,)  float32  mean +3  std 2.236  min +0  max +6  nan 0  inf 0  <doctest ...>:2
    """
    where = origins(inters)
    rows = []
    for key, value in inters.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            name = key + ("." + path_name(path) if path else "")
            if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and np.size(leaf):
                st = jax.device_get(_summary(jnp.asarray(leaf)))
                mean, std, low, high = st["mean"], st["std"], st["min"], st["max"]
                nans, infs = st["nan_count"], st["inf_count"]
                line = (
                    f"mean {mean:+.4g}  std {std:.4g}  min {low:+.4g}  max {high:+.4g}  "
                    f"nan {int(nans)}  inf {int(infs)}"
                )
                shape = str(tuple(np.shape(leaf)))
                rows.append([name, shape, str(leaf.dtype), line, where.get(key, "")])
            else:
                rows.append([name, "", type(leaf).__name__, repr(leaf), where.get(key, "")])
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    lines = [
        "  ".join(
            [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]), r[3], r[4]]
        ).rstrip()
        for r in rows
    ]
    return Description("\n".join(lines), inters)

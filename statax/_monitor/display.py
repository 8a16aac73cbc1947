"""`describe`: one readable line per intermediate, at a prompt, in a debugger or in a notebook.

In Jupyter and Colab, `describe`'s table renders as HTML, and so does the dict `pull` returns:
when statax is imported in an IPython kernel, it registers an HTML formatter for dicts whose
keys are all `Key`s (what `pull`, `plant` and `grad_inters` return). Every other dict is
displayed as before. Where treescope is installed, the table is followed by treescope's
rendering of the values, which opens the arrays themselves.
"""

from __future__ import annotations

import functools
import html
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.meta import RAN, KeyName
from .._drivers.naming import Key, origins
from .stats import path_name, stats

__all__ = ["describe"]


_summary = jax.jit(functools.partial(stats, format=None))

_STATS = ("mean", "std", "min", "max", "nan", "inf")


class _Row(NamedTuple):
    name: str
    shape: str  # "" for a leaf that is not an array
    dtype: str  # the type's name for a leaf that is not an array
    stats: tuple[str, ...] | None  # formatted as _STATS; None for a leaf that is not an array
    value: str  # repr of a leaf that is not an array
    where: str


class Description:
    """What `describe` returns: text at a prompt and in `print`; an HTML table in a notebook
    (followed by treescope's rendering of the values, where treescope is installed)."""

    def __init__(self, rows: list[_Row], inters: Any):
        self.rows = rows
        self._inters = inters
        self.text = _text(rows)

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__

    def _repr_html_(self) -> str:
        table = _html_table(self.rows)
        try:
            import treescope
        except ImportError:
            return table
        values = treescope.render_to_html(self._inters)
        return f"{table}<details><summary>values (treescope)</summary>{values}</details>"


def describe(inters: dict[str, Any]) -> Description:
    """One line per array in `inters`: name, shape, dtype, mean, std, min, max (over finite
    values), NaN and Inf counts, and the file:line of the `save_inter` (for a dict that `pull`
    returned). Statistics are computed on the device, one small transfer per array. In a
    notebook the result is an HTML table.

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
        parsed = KeyName.parse(key)
        if parsed.suffix == RAN and str(parsed.value()) in inters:
            continue  # said on its value's rows (`pull(fn, ran=True)`)
        ran = _ran_note(inters.get(str(parsed.ran())))
        site = " ".join(filter(None, (ran, where.get(key, ""))))
        for path, leaf in jax.tree_util.tree_leaves_with_path(value, is_leaf=_summarized):
            name = key + ("." + path_name(path) if path else "")
            if _summarized(leaf):  # (`summarize=stx.stats`: its statistics, one row)
                st = jax.device_get(leaf)
                rows.append(_Row(name, "", "stats", _cells(st), "", site))
            elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and np.size(leaf):
                st = jax.device_get(_summary(jnp.asarray(leaf)))
                shape = str(tuple(np.shape(leaf)))
                rows.append(_Row(name, shape, str(leaf.dtype), _cells(st), "", site))
            else:
                kind = type(leaf).__name__
                rows.append(_Row(name, "", kind, None, repr(leaf), where.get(key, "")))
    return Description(rows, inters)


_SUMMARY_KEYS = frozenset({"mean", "std", "min", "max", "nan_count", "inf_count"})


def _summarized(x) -> bool:
    """Whether `x` is what `stx.stats` made of one array (a dict of its statistics)."""
    return isinstance(x, dict) and _SUMMARY_KEYS <= x.keys()


def _cells(st) -> tuple[str, ...]:
    """A row's statistics, formatted as `_STATS`."""
    return (
        f"{float(st['mean']):+.4g}",
        f"{float(st['std']):.4g}",
        f"{float(st['min']):+.4g}",
        f"{float(st['max']):+.4g}",
        str(int(st["nan_count"])),
        str(int(st["inf_count"])),
    )


def _ran_note(mask) -> str:
    """What a value's mask of `pull(fn, ran=True)` says: nothing where it all ran, else
    `"(did not run)"` or `"(ran k of n)"` (per example under a `vmap`, per row in a `scan`)."""
    if mask is None:
        return ""
    mask = np.asarray(jax.device_get(mask), bool)
    if mask.all():
        return ""
    if not mask.any():
        return "(did not run)"
    return f"(ran {int(mask.sum())} of {mask.size})"


def _text(rows: list[_Row]) -> str:
    """The rows as aligned columns (a value that is not an array, shown by its repr, spans the
    statistics' columns)."""
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    cells = [r.stats for r in rows if r.stats is not None]
    stat_widths = [max(len(c[i]) for c in cells) for i in range(len(_STATS))] if cells else []
    lines = []
    for r in rows:
        if r.stats is None:
            middle = r.value
        else:
            padded = [c.ljust(w) for c, w in zip(r.stats, stat_widths)]
            middle = "  ".join(f"{label} {cell}" for label, cell in zip(_STATS, padded))
        head = [r.name.ljust(widths[0]), r.shape.ljust(widths[1]), r.dtype.ljust(widths[2])]
        lines.append("  ".join([*head, middle, r.where]).rstrip())
    return "\n".join(lines)


_STYLE = (
    "<style>"
    ".statax-describe{border-collapse:collapse;font-family:monospace;font-size:12px}"
    ".statax-describe th,.statax-describe td{padding:2px 8px;text-align:right;"
    "border-bottom:1px solid #ddd}"
    ".statax-describe th{background:#f3f3f3}"
    ".statax-describe td.l,.statax-describe th.l{text-align:left}"
    ".statax-describe td.bad{color:#fff;background:#c0392b}"
    ".statax-describe td.where{color:#777}"
    "</style>"
)


def _html_table(rows: list[_Row]) -> str:
    """The rows as an HTML table: a column per statistic, NaN and Inf counts above zero in
    red, and where each value was saved."""
    e = html.escape
    head = "".join(
        f'<th class="l">{h}</th>' if h in ("name", "dtype", "saved at") else f"<th>{h}</th>"
        for h in ("name", "shape", "dtype", *_STATS, "saved at")
    )
    body = []
    for r in rows:
        cells = [f'<td class="l">{e(r.name)}</td>', f"<td>{e(r.shape)}</td>"]
        cells.append(f'<td class="l">{e(r.dtype)}</td>')
        if r.stats is None:
            cells.append(f'<td class="l" colspan="{len(_STATS)}">{e(r.value)}</td>')
        else:
            for label, cell in zip(_STATS, r.stats):
                bad = label in ("nan", "inf") and cell != "0"
                cells.append(f'<td class="bad">{cell}</td>' if bad else f"<td>{cell}</td>")
        cells.append(f'<td class="l where">{e(r.where)}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'{_STYLE}<table class="statax-describe"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def is_pulled(obj: Any) -> bool:
    """Whether `obj` is a dict that `pull` (or `grad_inters`) returned: every key a `Key`, and
    every value made of arrays (not a dict made from one, `{k: v.shape for k, v in ...}`)."""
    return (
        type(obj) is dict
        and bool(obj)
        and all(isinstance(k, Key) for k in obj)
        and all(isinstance(leaf, _ARRAYS) for leaf in jax.tree_util.tree_leaves(list(obj.values())))
    )


_ARRAYS = (jax.Array, np.ndarray, np.generic)


def register_notebook_display() -> bool:
    """In an IPython kernel (Jupyter, Colab), display the dicts that `pull` returns as
    `describe`'s HTML table; any other dict goes to the formatter it had. Returns whether
    there was a kernel to register with. Called when statax is imported."""
    ipython = sys.modules.get("IPython")  # (never imported here: a notebook has it already)
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return False
    formatter = shell.display_formatter.formatters["text/html"]
    previous = formatter.for_type(dict, None)

    def html_of(obj):
        if is_pulled(obj):
            return describe(obj)._repr_html_()
        return previous(obj) if previous is not None else None

    formatter.for_type(dict, html_of)
    return True

"""`stx.sites(fn)(*args)`: a map of every place a selection can reach in a function, with what
a `pull` of it would return, found by abstract evaluation (no computation runs).
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._core import staging as _staging
from .._core.errors import SelectionError
from .._core.meta import RAN, KeyName
from .._core.tracebacks import boundary
from .._select import report as _report
from .._select import vocabulary as _vocabulary
from .._select.plan import survey, uncalled_tolerated
from .._select.where import is_transform, location_of, short_place, stack_of, walk_counted
from .pull import pull

__all__ = ["Site", "Sites", "sites"]

_KINDS = ("mark", "scope", "module", "primitive", "line")


@dataclasses.dataclass(frozen=True)
class Site:
    """One place a selection can reach.

    Attributes:
        kind: `"mark"` (a `save_inter` written by hand), `"scope"`, `"module"`, `"primitive"`
            or `"line"`.
        place: what selects it: the mark's name, or what `stx.scopes`, `stx.modules`,
            `stx.primitives` or `stx.lines` takes.
        shape, dtype: of its value's first array as `pull` returns it, for one call (with a
            loop's iterations stacked in front); for a primitive or a line, of its first
            equation's first output, per iteration. A value with no array (a module that
            returns a Python bool) has no shape, and its first leaf's type as dtype (`"bool"`).
        calls: how many times the function reaches it, as `pull` keys them (`name_0`, ...);
            for a primitive or a line, how many equations it has.
        per_call: how many values each of those gives: the iterations of the loops around it
            (`None` inside a `while_loop`, whose count is known only when it runs).
        nbytes: the bytes of all it gives, as `pull` returns them (for a primitive, what
            `stx.primitives` returns; for a line, all its equations' outputs; inside a
            `while_loop`, one iteration's).
    """

    kind: str
    place: str
    shape: tuple[int, ...] | None
    dtype: str | None
    calls: int
    per_call: int | None
    nbytes: int

    def selection(self) -> Any:
        """The selection that reaches this place (`None` for a mark, which `pull` returns)."""
        make = {
            "scope": _vocabulary.scopes,
            "module": _vocabulary.modules,
            "primitive": _vocabulary.primitives,
            "line": _vocabulary.lines,
        }.get(self.kind)
        return None if make is None else make(self.place)


class Sites(Sequence[Site]):
    """What `stx.sites(fn)(*args)` returns: the places, marks first, then scopes, modules,
    primitives and lines, each in the order the function reaches them. A table in a terminal
    (`print`) and in a notebook."""

    def __init__(self, rows: list[Site], bytes_of: Callable[[tuple], int]):
        self._rows = rows
        self._bytes_of = bytes_of

    def __getitem__(self, i):
        return self._rows[i]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Site]:
        return iter(self._rows)

    def of(self, kind: str) -> list[Site]:
        """The sites of one kind (`"scope"`, ...)."""
        if kind not in _KINDS:
            raise ValueError(f"stx.sites: no kind {kind!r}; the kinds are {', '.join(_KINDS)}.")
        return [s for s in self._rows if s.kind == kind]

    def find(self, place: str, kind: str | None = None) -> Site:
        """The site at `place` (of `kind`, where places of two kinds share a name)."""
        for site in self._rows:
            if site.place == place and kind in (None, site.kind):
                return site
        options = [s.place for s in self._rows if kind in (None, s.kind)]
        raise SelectionError(
            f"stx.sites: no site {place!r}. There is, closest first: "
            f"{_report.closest(place, options)}."
        )

    def bytes(self, *at) -> int:
        """The bytes that `pull(fn, at=at)` returns for these arguments (its marks too), worked
        out by abstract evaluation: what it would take before it runs."""
        return self._bytes_of(at)

    def __str__(self) -> str:
        rows = [_cells(s) for s in self._rows]
        widths = [max(len(r[i]) for r in [_HEAD, *rows]) for i in range(len(_HEAD))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [_HEAD, *rows]]
        total = sum(s.nbytes for s in self._rows if s.kind in ("mark", "scope", "module"))
        lines.append(f"{len(self._rows)} sites; marks, scopes and modules: {_size(total)}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        # Each cell aligned by its own style (a notebook may drop the <style> of an output it
        # does not trust, and right-aligns cells by default): text left, figures right.
        e = html.escape
        align = [f' style="text-align:{"right" if i >= _FIGURES else "left"}"' for i in range(7)]
        head = "".join(f"<th{a}>{e(h)}</th>" for h, a in zip(_HEAD, align, strict=True))
        body = "".join(
            "<tr>"
            + "".join(f"<td{a}>{e(c)}</td>" for c, a in zip(_cells(s), align, strict=True))
            + "</tr>"
            for s in self._rows
        )
        return (
            "<style>.statax-sites{border-collapse:collapse;font-family:monospace;font-size:12px}"
            ".statax-sites td,.statax-sites th{padding:2px 8px;text-align:left;"
            "border-bottom:1px solid #ddd}</style>"
            f'<table class="statax-sites"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )


_HEAD = ("kind", "place", "shape", "dtype", "calls", "per call", "bytes")
_FIGURES = 4  # (the columns from "calls" on are figures)


def _cells(s: Site) -> tuple[str, ...]:
    per_call = "?" if s.per_call is None else str(s.per_call)
    shape = "" if s.shape is None else str(s.shape)
    return (s.kind, s.place, shape, s.dtype or "", str(s.calls), per_call, _size(s.nbytes))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def sites(fn: Callable) -> Callable[..., Sites]:
    """A map of what the selections can reach in `fn`: `stx.sites(fn)(*args)`.

    Lists every hand-written mark, scope path, submodule (of an equinox, Flax NNX or penzai
    model among `fn` and its arguments), primitive and source line, with the shape, dtype,
    occurrences and bytes of what a `pull` would return. Nothing is computed: the function is
    evaluated abstractly, as `jax.eval_shape` does. `.bytes(*at)` gives the total a
    `pull(fn, at=at)` would return, before it runs out of memory.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     with jax.named_scope("enc"):
        ...         h = jnp.tanh(x)
        ...     return stx.save_inter(h * 2, name="out")
        >>> found = stx.sites(f)(jnp.ones((4, 8)))
        >>> [(s.kind, s.place, s.shape, s.nbytes) for s in found.of("scope")]
        [('scope', 'enc', (4, 8), 128)]
        >>> found.bytes(stx.scopes("enc"))  # "out" (a mark) and "enc"
        256
    """

    @boundary
    def mapped(*args, **kwargs) -> Sites:
        return _map(fn, args, kwargs)

    return mapped


def _shapes(fn, args, kwargs, at=(), tolerate=False) -> dict:
    """`{key: value}` that `pull(fn, at=at)` returns, as `ShapeDtypeStruct`s."""
    pulled = pull(fn, at=list(at)) if at else pull(fn)
    if not tolerate:
        return eqx.filter_eval_shape(pulled, *args, **kwargs)[1]
    with uncalled_tolerated():
        return eqx.filter_eval_shape(pulled, *args, **kwargs)[1]


def _nbytes(tree) -> int:
    return sum(
        math.prod(x.shape) * _itemsize(x.dtype)
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype")
    )


def _itemsize(dtype) -> int:
    """Bytes per element, also of JAX's extended dtypes (PRNG keys: `key<fry>`)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return int(getattr(dtype, "itemsize", 0))


def _grouped(kind: str, shapes: dict, skip: set, per_call: dict) -> list[Site]:
    """One site per name among `shapes`' keys (`name_0`, `name_1`, ...), but those in `skip`."""
    rows: dict[str, list] = {}
    for key, value in shapes.items():
        parsed = KeyName.parse(key)
        if key in skip or parsed.suffix == RAN:
            continue
        name = parsed.name if key.reduce is None else str(key)
        rows.setdefault(name, []).append(value)
    out = []
    for name, values in rows.items():
        shape, dtype = _described(jax.tree_util.tree_leaves(values))
        out.append(
            Site(kind, name, shape, dtype, len(values), per_call.get(name, 1), _nbytes(values))
        )
    return out


def _described(leaves: list) -> tuple[tuple[int, ...] | None, str | None]:
    """The shape and dtype of the first array among `leaves`; where there is none (a module
    that returns a Python bool), no shape and the first leaf's type (`"bool"`)."""
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return tuple(leaf.shape), str(leaf.dtype)
    return None, None if not leaves else type(leaves[0]).__name__


def _map(fn, args, kwargs) -> Sites:
    surveyed = survey(fn, args, kwargs)
    paths, called, ran = surveyed.paths, surveyed.called, surveyed.ran
    everything = list(walk_counted(surveyed.jaxpr.jaxpr.eqns))
    there = surveyed.places
    per_call: dict[str, int | None] = {}  # by mark name and by scope path: its first equation's
    for stack, eqn, trips in everything:
        if eqn.primitive.name == "save_inter":
            per_call.setdefault(eqn.params["meta"].name, trips)
        names = []
        for element in stack_of(stack, eqn):
            if is_transform(element):
                break  # (a scope inside a transformation applied in the function: no site)
            names.append(element.name)
            per_call.setdefault("/".join(names), trips)

    marks = _shapes(fn, args, kwargs)
    rows = _grouped("mark", marks, set(), per_call)
    taken = set(marks)
    scopes = [  # (not those under a transformation, nor a Linen module's by its method's name)
        p for p in there.scopes if p in per_call and not _method_named(p, ran)
    ]
    scopes += [p for p in ran if p not in scopes]  # (a module that makes no equations)
    if scopes:
        scoped = _selectable(fn, args, kwargs, _vocabulary.scopes, scopes)
        rows += _ordered(_grouped("scope", scoped, taken, per_call), scopes)
        taken |= set(scoped)
    if paths:
        found = _shapes(fn, args, kwargs, (surveyed.modules,), tolerate=True)
        rows += _ordered(_grouped("module", found, taken, per_call), list(called))
    rows += _equations("primitive", everything, lambda eqn: eqn.primitive.name, there.primitives)
    rows += _equations("line", everything, lambda eqn: _short_place(location_of(eqn)), None)

    def bytes_of(at: tuple) -> int:
        return _nbytes(_shapes(fn, args, kwargs, at))

    return Sites(rows, bytes_of)


_METHOD = re.compile(r"[A-Za-z_]\w*\.\w+")  # a scope Flax names after a method: "Net._run"


def _method_named(path: str, ran) -> bool:
    """Whether `path`, a scope of the program, names a Linen module that ran (`ran`: their
    paths, as `pull` selects and keys them) through the scope of a method on the way (an
    `nn.jit` method: `"Net/Net._run/block_0"` for `"Net/block_0"`)."""
    if not ran or path in ran:
        return False
    parts = path.split("/")
    kept = [p for p in parts if not _METHOD.fullmatch(p)]
    return len(kept) < len(parts) and ("/".join(kept) in ran or not kept)


def _transformed(stack: tuple, eqn) -> bool:
    """Whether `eqn` runs under a transformation applied inside the function (a `vmap`, a
    `jvp`): no selection reaches it there, only a module selection around it."""
    return any(is_transform(e) for e in stack_of(stack, eqn))


def _drops(eqn) -> bool:
    return any(_staging.dropped(v) for v in eqn.outvars)


def _ordered(rows: list[Site], order: list[str]) -> list[Site]:
    """`rows` in the order of their places in `order` (the map's: as the function reaches them)."""
    index = {place: i for i, place in enumerate(order)}
    return sorted(rows, key=lambda s: index.get(s.place, len(index)))


def _short_place(location: str) -> str:
    return location if location == "<unknown>" else short_place(location)


def _selectable(fn, args, kwargs, make, places: list[str]) -> dict:
    """What `pull` returns with every one of `places` selected; where that is refused (a scope
    inside a transformation applied in the function), with each that can be."""
    try:
        return _shapes(fn, args, kwargs, (make(*places),))
    except SelectionError:
        found: dict = {}
        for place in places:
            try:
                found.update(_shapes(fn, args, kwargs, (make(place),)))
            except SelectionError:
                continue
        return found


def _equations(kind, walked, place_of, order) -> list[Site]:
    """One site per place of equations (a primitive, a line): their number, and the bytes of
    their outputs over the loops' iterations; none for a place a selection cannot reach (one of
    its equations under a transformation applied in the function, or a primitive one of whose
    equations drops an output)."""
    rows: dict[str, list] = {}
    refused = set()  # (one of its equations is under a transformation applied in the function)
    for stack, eqn, trips in walked:
        if eqn.primitive.name == "save_inter":
            continue
        place = place_of(eqn)
        if place == "<unknown>" or place in refused:
            continue
        if _transformed(stack, eqn) or (kind == "primitive" and _drops(eqn)):
            refused.add(place)
            rows.pop(place, None)
            continue
        entry = rows.setdefault(place, [None, 0, 1, 0])  # first aval, count, per call, bytes
        out = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
        if entry[0] is None and out:
            entry[0] = out[0]
        entry[1] += 1
        entry[2] = None if trips is None or entry[2] is None else max(entry[2], trips)
        entry[3] += (trips or 1) * _nbytes(out)
    names = order if order is not None else list(rows)
    return [
        Site(
            kind,
            name,
            None if rows[name][0] is None else tuple(rows[name][0].shape),
            None if rows[name][0] is None else str(rows[name][0].dtype),
            rows[name][1],
            rows[name][2],
            rows[name][3],
        )
        for name in names
        if name in rows
    ]

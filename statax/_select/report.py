"""A selection that matches nothing: an error that lists what there is, closest first."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from typing import NamedTuple

from .._core.errors import SelectionError
from .vocabulary import Lines, Primitives, Scopes
from .where import is_transform, location_of, scope_region, short_place, stack_of, walk_eqns

__all__ = ["Places", "closest", "places_in"]


# ---- nothing matched ---------------------------------------------------------------------------


def _wanted(selection) -> list:
    if isinstance(selection, Primitives):
        return sorted(selection.names)
    if isinstance(selection, Scopes):
        return list(selection.patterns)
    return list(selection.places)


def check_found(eqns: Sequence, chosen: tuple) -> None:
    """Raise where a pattern, primitive or place of `chosen` matches nothing in `eqns` (at
    any depth)."""
    found: set = {  # (a scope marked as its module ran, which may make no equations)
        (s, p)
        for s in chosen
        if isinstance(s, Scopes)
        for p in s.patterns
        if any(fnmatch.fnmatchcase(path, p) for path in s.marked)
    }
    wanted = sum(len(_wanted(s)) for s in chosen)
    for stack, eqn in walk_eqns(eqns, ()):
        if len(found) == wanted:
            return
        for selection in chosen:
            if isinstance(selection, Primitives):
                if eqn.primitive.name in selection.names:
                    found.add((selection, eqn.primitive.name))
            elif isinstance(selection, Scopes):
                full = stack_of(stack, eqn)
                for pattern in selection.patterns:
                    if scope_region((pattern,), full) is not None:
                        found.add((selection, pattern))
            else:
                for file, line in selection.places:
                    if Lines(((file, line),)).region(eqn) is not None:
                        found.add((selection, (file, line)))
    for selection in chosen:
        missing = [w for w in _wanted(selection) if (selection, w) not in found]
        if missing:
            _nothing_found(selection, missing[0], eqns)


def _nothing_found(selection, wanted, eqns) -> None:
    there = places_in(eqns)
    if isinstance(selection, Primitives):
        what, kind, options = f"primitive {wanted!r}", "primitives", there.primitives
    elif isinstance(selection, Scopes):
        what, kind, options = f"scope {wanted!r}", "scopes", there.scopes
    else:
        wanted = f"{wanted[0]}:{wanted[1]}"
        what, kind = f"line {wanted!r}", "lines (where each equation was made)"
        options = [short_place(line) for line in there.lines]
    listed = closest(wanted, sorted(set(options))) if options else "none"
    raise SelectionError(
        f"{selection}: no {what} in the program. The {kind} there, closest first: {listed}."
    )


class Places(NamedTuple):
    """What a program's selections can reach, each in the order first met: its scope paths
    (every prefix), its primitives, and its lines (`"file:line"`, where each equation was
    made). `stx.sites` lists them, and a selection that matches nothing is an error listing
    them."""

    scopes: list[str]
    primitives: list[str]
    lines: list[str]


def places_in(eqns: Sequence) -> Places:
    scopes: dict[str, None] = {}
    primitives: dict[str, None] = {}
    lines: dict[str, None] = {}
    for stack, eqn in walk_eqns(eqns, ()):
        names = [e.name for e in stack_of(stack, eqn) if not is_transform(e)]
        scopes.update(dict.fromkeys("/".join(names[: k + 1]) for k in range(len(names))))
        primitives[eqn.primitive.name] = None
        lines[location_of(eqn)] = None
    lines.pop("<unknown>", None)
    return Places(list(scopes), list(primitives), list(lines))


def closest(wanted: str, options: Sequence[str], n: int = 8) -> str:
    """`options`, the closest to `wanted` first (at most `n`, then how many more)."""
    ranked = sorted(
        options, key=lambda o: -difflib.SequenceMatcher(None, wanted.lower(), o.lower()).ratio()
    )
    shown = ", ".join(map(repr, ranked[:n]))
    return shown + (f" (and {len(ranked) - n} more)" if len(ranked) > n else "")

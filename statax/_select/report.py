"""Selections: marks where none were written, for a model nobody edited.

`pull(fn, at=...)`, `plant(fn, at=...)` and `grad_inters(fn, at=...)` take selections, which
make `save_inter`s at the places they select; from there on those are marks like any other.

Two kinds, by how they find their places:

* **Objects** (`modules`): submodules of an equinox or Flax NNX model (or any callable object
  in one), by attribute path. For the call, each selected object's class is swapped for a
  subclass whose `__call__` marks the output (and inputs) and calls the original; the class is
  put back when the call returns. The mark is made where the submodule runs, in whatever trace
  is there (inside a `vmap`, a `scan`, a derivative), so it behaves exactly as a
  `save_inter` written at the end of its `__call__`.
* **Places in the program** (`scopes`, `primitives`, `lines`): the function is traced to a
  jaxpr (its own marks as they would be), the equations are matched, and the jaxpr is then
  evaluated into the trace `pull` is making, with a `save_inter` after each selected place.
  Inside `jit`, `scan`, `while_loop`, `cond`, `jax.checkpoint` and custom derivatives the inner
  jaxpr is evaluated the same way, so a selection there behaves as a mark written there.
  A scope or a line is a region: the values made inside it and read after it (or returned)
  leave it, and are marked, together, where its last equation is. A transformation applied
  inside the function (`vmap`, `jvp`, `grad`), around the selected place, has already been
  applied to the jaxpr: the value there is no longer one a mark written at that place would
  see (its batch axis may be anywhere, a tangent stands beside a primal), so that is an error
  that says to apply the transformation outside, or to select by module.

A selection that matches nothing is an error listing what there is, closest first.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from .._core.errors import SelectionError
from .vocabulary import Lines, Primitives, Scopes
from .where import _is_transform, _location, _scope_region, _short, _stack_of, _walk_eqns

__all__ = ["closest"]


# ---- nothing matched ---------------------------------------------------------------------------


def _wanted(selection) -> list:
    if isinstance(selection, Primitives):
        return sorted(selection.names)
    if isinstance(selection, Scopes):
        return list(selection.patterns)
    return list(selection.places)


def _check_found(eqns: Sequence, chosen: tuple) -> None:
    """Raise where a pattern, primitive or place of `chosen` matches nothing in `eqns` (at
    any depth)."""
    found: set = set()
    wanted = sum(len(_wanted(s)) for s in chosen)
    for stack, eqn in _walk_eqns(eqns, ()):
        if len(found) == wanted:
            return
        for selection in chosen:
            if isinstance(selection, Primitives):
                if eqn.primitive.name in selection.names:
                    found.add((selection, eqn.primitive.name))
            elif isinstance(selection, Scopes):
                full = _stack_of(stack, eqn)
                for pattern in selection.patterns:
                    if _scope_region((pattern,), full) is not None:
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
    if isinstance(selection, Primitives):
        what, there = f"primitive {wanted!r}", {e.primitive.name for _, e in _walk_eqns(eqns, ())}
        kind = "primitives"
    elif isinstance(selection, Scopes):
        there = set()
        for stack, eqn in _walk_eqns(eqns, ()):
            names = [e.name for e in _stack_of(stack, eqn) if not _is_transform(e)]
            there.update("/".join(names[: k + 1]) for k in range(len(names)))
        what, kind = f"scope {wanted!r}", "scopes"
    else:
        wanted = f"{wanted[0]}:{wanted[1]}"
        there = {_short(_location(e)) for _, e in _walk_eqns(eqns, ())} - {"<unknown>"}
        what, kind = f"line {wanted!r}", "lines (where each equation was made)"
    listed = closest(wanted, sorted(there)) if there else "none"
    raise SelectionError(
        f"{selection}: no {what} in the program. The {kind} there, closest first: {listed}."
    )


def closest(wanted: str, options: Sequence[str], n: int = 8) -> str:
    """`options`, the closest to `wanted` first (at most `n`, then how many more)."""
    ranked = sorted(
        options, key=lambda o: -difflib.SequenceMatcher(None, wanted.lower(), o.lower()).ratio()
    )
    shown = ", ".join(map(repr, ranked[:n]))
    return shown + (f" (and {len(ranked) - n} more)" if len(ranked) > n else "")

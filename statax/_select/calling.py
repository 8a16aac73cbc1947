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

import functools
from collections.abc import Callable

from .linen import _with_linen
from .objects import _with_modules
from .places import _with_places
from .vocabulary import Modules, Scopes, Selection

__all__ = ["calling"]


def calling(call: Callable, at: tuple[Selection, ...], *, objects: bool, fn=None) -> Callable:
    """`call(tree, *args, **kwargs)` (which calls `fn`) with the selections of one kind made:
    by object (`objects=True`, where the live objects are: inside Flax NNX's merge) or in the
    program."""
    if objects:
        scopes = tuple(s for s in at if isinstance(s, Scopes))
        if scopes:
            call = functools.partial(_with_linen, call, scopes)
        chosen = tuple(s for s in at if isinstance(s, Modules))
        return call if not chosen else functools.partial(_with_modules, call, chosen, fn)
    chosen = tuple(s for s in at if not isinstance(s, Modules))
    return call if not chosen else functools.partial(_with_places, call, chosen)

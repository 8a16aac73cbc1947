"""Selections: marks where none were written, for a model nobody edited.

`pull(fn, at=...)`, `plant(fn, at=...)` and `grad_inters(fn, at=...)` take selections, which
make `save_inter`s at the places they select; from there on those are marks like any other.

Two kinds, by how they find their places:

* **Objects** (`modules`, `objects.py`): submodules of an equinox or Flax NNX model (or any
  callable object in one), by attribute path. For the call, each selected object's class is
  swapped for a subclass whose `__call__` marks the output (and inputs) and calls the
  original; the class is put back when the call returns. The mark is made where the submodule
  runs, in whatever trace is there (inside a `vmap`, a `scan`, a derivative), so it behaves
  exactly as a `save_inter` written at the end of its `__call__`. Flax Linen modules are
  marked where they run too, through Flax's method interceptor (`linen.py`).
* **Places in the program** (`scopes`, `primitives`, `lines`, `places.py`): the function is
  traced to a jaxpr (its own marks as they would be), the equations are matched, and the
  jaxpr is then evaluated (`_core.evaluator`) with a `save_inter` after each selected place,
  or, for `pull`, marks are put into the jaxpr it traced. Inside every primitive whose handler
  declares it `selectable` (`jit`, `scan`, `while_loop`, `cond`, `jax.checkpoint`, custom
  derivatives) the inner jaxpr is treated the same way. A scope or a line is a region: the
  values made inside it and read after it (or returned) leave it, and are marked, together,
  where its last equation is. A transformation applied inside the function (`vmap`, `jvp`,
  `grad`), around the selected place, has already been applied to the jaxpr: that is an error
  that says to apply the transformation outside, or to select by module.

A selection that matches nothing is an error listing what there is, closest first
(`report.py`).
"""

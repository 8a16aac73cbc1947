"""Modules of libraries that name their scopes after them (Flax Linen, Keras), selected by scope
path and marked where they run, on their method's output: inside a `vmap` or a derivative as a
`save_inter` at the end of the method would be, in the structure the method returns. The
program-level pass then skips those scopes. How each library is reached: `linen.py`,
`keras.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from .._core.context import within
from .._core.marks import find_saves_in
from .._core.primitive import mark_as
from .vocabulary import Scopes, Selection
from .where import outermost_match, outside_libraries

__all__ = ["mark_selected", "marking", "marks_found", "modules_recorded", "run_marked"]


# The scope paths marked as their modules ran, in the current `pull` (`None` outside one).
_RUN_MARKED: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "statax_run_marked", default=None
)


def marking() -> set | None:
    """The set to add the paths marked as their modules run to; `None` outside a `pull`."""
    return _RUN_MARKED.get()


def mark_selected(chosen: tuple[Scopes, ...], names: list[str], out, marked: set):
    """`out`, a module's output, marked where one of `chosen` selects its scope path (`names`,
    its parts) itself, rather than a scope around it."""
    path = "/".join(names)
    ran = _RAN.get()
    if ran is not None:
        ran[path] = None
    for selection in chosen:
        if outermost_match(selection.patterns, names) == path:
            marked.add(path)
            return mark_as(out, path, outside_libraries(), selection.reduce)
    return out


# Where recorded (`modules_recorded`): the scope paths of the modules that ran, in order.
_RAN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("statax_ran", default=None)


def modules_recorded():
    """Within, the scope paths of the Linen and Keras modules that run are recorded, also of
    those that make no equations (a Keras `Dropout` in inference); yields them, in order."""
    return within(_RAN, {})


@contextlib.contextmanager
def run_marked(chosen: tuple[Selection, ...]):
    """Within, the modules whose scopes `chosen` selects are marked as they run; yields
    `chosen` as a function of nothing, for once they have run: its scope selections then skip
    the scopes marked so."""
    with within(_RUN_MARKED, set()) as marked:
        yield lambda: tuple(
            dataclasses.replace(s, marked=frozenset(marked)) if isinstance(s, Scopes) else s
            for s in chosen
        )


def marks_found(chosen: tuple[Selection, ...], eqns) -> tuple[Selection, ...]:
    """`chosen` with the scopes that were marked as their modules ran found in `eqns` too: a
    `jax.jit` inside the function whose trace JAX kept from an earlier call (under the same
    selections) runs no module again, but holds the marks they made."""
    scopes = [s for s in chosen if isinstance(s, Scopes)]
    if not scopes:
        return chosen
    names = {meta.name for meta in find_saves_in(eqns)}
    found = {
        s: frozenset(n for n in names if outermost_match(s.patterns, n.split("/")) == n)
        for s in scopes
    }
    return tuple(
        dataclasses.replace(s, marked=s.marked | found[s]) if found.get(s) else s for s in chosen
    )

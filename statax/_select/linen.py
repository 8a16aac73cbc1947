"""Flax Linen modules selected by scope path, marked where they run through Flax's public
`nn.intercept_methods`: the interceptor runs inside the module's own named scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys

from jax.extend import source_info_util as source_info_api

from .._core.primitive import mark_as
from .vocabulary import Scopes, Selection
from .where import _is_transform, _outside_libraries, _scope_region

__all__ = ["linen_marked"]


# ---- Flax Linen modules: their scopes marked where they run ------------------------------------
#
# Linen runs each module method under a named scope of its path (`Model/Block_0`), and lets an
# interceptor run inside that scope (`nn.intercept_methods`). A selected scope that is a
# module's is marked there, on the method's output, as it runs: inside a `vmap` or a derivative
# as a `save_inter` at the end of the method would be. The program-level pass then skips it.

_LINEN_MARKED: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "statax_linen_marked", default=None
)


def _with_linen(call, chosen: tuple[Scopes, ...], tree, *args, **kwargs):
    linen = sys.modules.get("flax.linen")
    marked = _LINEN_MARKED.get()
    if linen is None or marked is None:
        return call(tree, *args, **kwargs)

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        stack = source_info_api.current_name_stack().stack
        names = [e.name for e in stack if not _is_transform(e)]
        path = "/".join(names)
        for selection in chosen:
            region = _scope_region(selection.patterns, stack)
            if region is not None and region[0] == path:  # this module's own scope
                marked.add(path)
                return mark_as(out, path, _outside_libraries(), selection.reduce)
        return out

    with linen.intercept_methods(interceptor):
        return call(tree, *args, **kwargs)


@contextlib.contextmanager
def linen_marked(chosen: tuple[Selection, ...]):
    """Within, the Linen modules whose scopes `chosen` selects are marked as they run; yields
    `chosen` as a function of nothing, for once they have run: its scope selections then skip
    the scopes marked so."""
    marked: set = set()
    token = _LINEN_MARKED.set(marked)
    try:
        yield lambda: tuple(
            dataclasses.replace(s, marked=frozenset(marked)) if isinstance(s, Scopes) else s
            for s in chosen
        )
    finally:
        _LINEN_MARKED.reset(token)

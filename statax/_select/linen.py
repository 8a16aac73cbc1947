"""Flax Linen modules selected by scope path, marked where they run through Flax's public
`nn.intercept_methods`: the interceptor runs inside the module's own named scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys

from .._core.primitive import mark_as
from .vocabulary import Scopes, Selection
from .where import _outside_libraries, outermost_match

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

    roots: list[str] = []  # the module the outermost call is of: the scope path's first name

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        outermost = not roots
        if outermost:
            roots.append(module.name or type(module).__name__)  # (as Linen names its scope)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            if outermost:
                roots.pop()
        if context.method_name == "setup":  # it makes submodules: no value comes out
            return out
        names = _scope_names(roots[0] if roots else None, module, context.method_name)
        path = "/".join(names)
        for selection in chosen:
            if outermost_match(selection.patterns, names) == path:  # this module's own scope
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


def _scope_names(root: str | None, module, method: str) -> list[str]:
    """The parts of the scope path Linen runs `module.method` under: the outermost module's
    name (`root`), the module's path, and `.method` for a method other than `__call__`. Made
    from the modules, not read from JAX's name stack, which a lifted transformation cuts short
    (`nn.remat`'s body is traced by `jax.checkpoint` under a name stack of its own)."""
    names = [root or module.name or type(module).__name__, *module.path]
    if method != "__call__":
        names[-1] += f".{method}"
    return names

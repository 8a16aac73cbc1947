"""Flax Linen modules selected by scope path, marked where they run through Flax's public
`nn.intercept_methods`: the interceptor runs inside the module's own named scope.
"""

from __future__ import annotations

import sys

from .running import mark_selected, marking
from .vocabulary import Scopes

__all__ = ["with_linen"]


# Linen runs each module method under a named scope of its path (`Model/Block_0`), and lets an
# interceptor run inside that scope (`nn.intercept_methods`).


def with_linen(call, chosen: tuple[Scopes, ...], tree, *args, **kwargs):
    """`call(tree, *args, **kwargs)` with the Linen modules whose scopes `chosen` selects
    marked as they run."""
    linen = sys.modules.get("flax.linen")
    marked = marking()
    if linen is None or marked is None:
        return call(tree, *args, **kwargs)

    # The name of the module the outermost call is of, where it is the root: the scope path's
    # first name. `apply(..., method=f)` with a function `f` that calls a submodule
    # (`FlaxT5Model.encode`) calls no method of the root: no scope of its name then (None).
    roots: list[str | None] = []
    setups = 0  # how many `setup`s are running: what runs inside one only builds

    def interceptor(next_fun, args, kwargs, context):
        nonlocal setups
        module = context.module
        outermost = not roots
        if outermost:  # (as Linen names its scope)
            roots.append(None if module.path else module.name or type(module).__name__)
        setup = context.method_name == "setup"
        setups += setup
        try:
            out = next_fun(*args, **kwargs)
        finally:
            if outermost:
                roots.pop()
            setups -= setup
        if setup or setups:  # it makes submodules (a helper `setup` calls): no value
            return out
        names = _scope_names(roots[0] if roots else None, module, context.method_name)
        return mark_selected(chosen, names, out, marked)

    with linen.intercept_methods(interceptor):
        return call(tree, *args, **kwargs)


def _scope_names(root: str | None, module, method: str) -> list[str]:
    """The parts of the scope path Linen runs `module.method` under: the root module's name
    where its method was called (`root`), the module's path, and `.method` for a method other
    than `__call__`. Made
    from the modules, not read from JAX's name stack, which a lifted transformation cuts short
    (`nn.remat`'s body is traced by `jax.checkpoint` under a name stack of its own)."""
    names = [root, *module.path] if root else list(module.path)
    if not names:
        names = [module.name or type(module).__name__]
    if method != "__call__":
        names[-1] += f".{method}"
    return names

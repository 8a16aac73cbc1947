"""`scope`: a prefix for the names of the `save_inter`s inside it."""

from __future__ import annotations

import contextlib

from . import context as _context

__all__ = ["scope"]


class scope(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Prefix the names of the `save_inter`s inside with `name/`.

    Scopes nest (`"encoder/layer0/attn"`) and hold across `jit`, `scan` and `vmap` (a function
    `jax.jit` traced in one scope is traced again in another). Use as a context manager or a
    decorator.

    Args:
        name: the scope's name, a non-empty string without `"/"` at either end.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> @stx.scope("encoder")
        ... def encode(x):
        ...     with stx.scope("layer0"):
        ...         return stx.save_inter(x * 2, name="attn")
        >>> stx.pull(encode)(jnp.float32(1.0))[1]
        {'encoder/layer0/attn_0': Array(2., dtype=float32)}
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip("/"):
            raise TypeError(f"stx.scope needs a non-empty string name, got {name!r}")
        self.name = name.strip("/")
        self._entered: list = []

    def __enter__(self) -> scope:
        context = _context.SCOPE(_context.SCOPE.value + self.name + "/")
        context.__enter__()
        self._entered.append(context)
        return self

    def __exit__(self, *exc) -> None:
        self._entered.pop().__exit__(*exc)

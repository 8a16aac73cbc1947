"""Errors that say what went wrong, where, and what to do."""

from __future__ import annotations

from collections.abc import Sequence

from ._meta import StateMeta

__all__ = ["HandlerError", "UnhandledPrimitiveError"]


def _where(metas: Sequence[StateMeta]) -> str:
    shown = ", ".join(f"{m.name!r} at {m.location}" for m in metas[:3])
    more = f" and {len(metas) - 3} more" if len(metas) > 3 else ""
    return shown + more


class UnhandledPrimitiveError(NotImplementedError):
    """A higher-order primitive without a handler holds a `save_inter`."""

    def __init__(self, primitive, metas: Sequence[StateMeta]):
        self.primitive = primitive
        self.metas = tuple(metas)
        super().__init__(
            f"statax.pull cannot look inside the primitive `{primitive}`, whose inner jaxpr "
            f"holds save_inter {_where(self.metas)}.\n"
            f"To fix: register a handler with `statax.register_handler({primitive}_p, handler)` "
            "(see 'Writing a handler' in the docs), or move the save_inter out of the "
            f"`{primitive}`."
        )


class HandlerError(TypeError):
    """A handler broke the handler contract."""

    def __init__(self, primitive, problem: str):
        self.primitive = primitive
        super().__init__(
            f"The statax handler for `{primitive}` {problem}. A handler returns "
            "(new_eqn, metas): new_eqn's outputs are the original ones followed by the array "
            "leaves of each StateMeta in metas, in order."
        )

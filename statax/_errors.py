"""Errors that say what went wrong, where, and what to do."""

from __future__ import annotations

from collections.abc import Sequence

from ._meta import StateMeta

__all__ = ["BranchMismatchError", "HandlerError", "UnhandledPrimitiveError"]


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


class BranchMismatchError(TypeError):
    """Two branches of a `cond` save different kinds of value under one (name, occurrence)."""

    def __init__(self, meta_a: StateMeta, avals_a, meta_b: StateMeta, avals_b):
        def kind(meta, avals):
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)
            return f"{meta.treedef} of ({shapes})"

        super().__init__(
            f"The branches of a cond/switch save different values as {meta_a.name!r}: "
            f"{kind(meta_a, avals_a)} at {meta_a.location}, but {kind(meta_b, avals_b)} at "
            f"{meta_b.location}. statax returns one value per name and occurrence from "
            "whichever branch ran, so they must match. To fix: give the two save_inter calls "
            "different names."
        )

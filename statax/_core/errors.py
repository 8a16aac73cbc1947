"""Errors that say what went wrong, where, and what to do."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .meta import StateMeta

__all__ = [
    "HandlerError",
    "KeyCollisionError",
    "PlantError",
    "ReduceMismatchError",
    "SelectionError",
    "StateError",
    "StatefulWarning",
    "StoreError",
    "SweepError",
    "UnhandledPrimitiveError",
    "error_if",
]


def error_if(values: list, pred, message: str) -> list:
    """`values`, which raise `message` when the program runs where `pred` is true (per example
    under `vmap`: where any is). equinox's runtime errors (`eqx.error_if`): a callback only in
    the branch taken past the error, so that a program that does not fail pays nothing for it,
    and `values` pass through it, so that no compiler drops it."""
    import equinox as eqx

    return eqx.error_if(values, pred, message)


def _where(metas: Sequence[StateMeta]) -> str:
    shown = ", ".join(f"{m.name!r} at {m.location}" for m in metas[:3])
    more = f" and {len(metas) - 3} more" if len(metas) > 3 else ""
    return shown + more


def import_path(obj) -> str | None:
    """A dotted name `obj` can be imported by (`module.attribute`), public modules first, then
    the shortest; None where no loaded module holds it. Primitives have no such name of their
    own (`custom_vmap_p` is `jax._src.custom_batching.custom_vmap_p`); this finds it."""
    found = [
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        for attr, value in list(getattr(module, "__dict__", {}).items())
        if value is obj and not attr.startswith("__")
    ]
    private = lambda path: any(part.startswith("_") for part in path.split("."))  # noqa: E731
    return min(found, key=lambda path: (private(path), len(path), path), default=None)


class UnhandledPrimitiveError(NotImplementedError):
    """A higher-order primitive without a handler holds a `save_inter`."""

    def __init__(self, primitive, metas: Sequence[StateMeta], in_rules: bool = False):
        self.primitive = primitive
        self.metas = tuple(metas)
        where = (
            "whose rules run Python code that calls save_inter (they would run it when the "
            "program is evaluated or compiled, where no pull can collect it): "
            if in_rules
            else "whose inner jaxpr holds save_inter "
        )
        path = import_path(primitive)
        module, name = path.rsplit(".", 1) if path else (None, "prim")
        if path is None:
            got = "with prim = error.primitive (this error holds the primitive)"
        elif module == "__main__":
            got = "(the primitive your script defines)"
        else:
            got = f"after `from {module} import {name}`"
            if "._" in "." + path:
                got += " (a private name; this error holds it too, as `.primitive`)"
        super().__init__(
            f"statax.pull cannot look inside the primitive `{primitive}`, {where}"
            f"{_where(self.metas)}.\n"
            f"To fix: register a handler, `statax.extend.register_handler({name}, handler)` "
            f"{got}, as 'Writing a handler' in the docs shows; or move the save_inter out of "
            f"the `{primitive}`."
        )


class HandlerError(TypeError):
    """A handler broke the handler contract."""

    def __init__(self, primitive, problem: str):
        self.primitive = primitive
        super().__init__(
            f"The statax handler for `{primitive}` {problem}. A handler returns "
            "statax.extend.Rewrite(new_eqn, outs, ins): new_eqn's outputs are the original "
            "ones followed by the array leaves of each StateMeta in outs, and its inputs the "
            "original ones followed by those of each StateMeta in ins, in order."
        )


class ReduceMismatchError(ValueError):
    """Two `save_inter`s of one name that cannot combine into one entry."""

    def __init__(self, first: StateMeta, other: StateMeta, what: str):
        self.metas = (first, other)
        super().__init__(
            f"save_inter calls named {first.name!r} differ in their {what}: "
            f"reduce={first.reduce!r} at {first.location}, reduce={other.reduce!r} at "
            f"{other.location}. Occurrences of one name combine into one entry, so they must "
            "agree. To fix: use the same reduce mode and values of the same kind, or give the "
            "calls different names."
        )

    @classmethod
    def in_while_loop(cls, meta: StateMeta) -> ReduceMismatchError:
        error = cls.__new__(cls)
        error.metas = (meta,)
        ValueError.__init__(
            error,
            f"save_inter {meta.name!r} at {meta.location} has reduce={meta.reduce!r} inside a "
            "while_loop, whose number of iterations is not known when it is compiled, so its "
            "occurrences cannot be stacked. To fix: use reduce='last', 'mean', 'sum', 'min', "
            "'max' or 'first', or a scan (or fori_loop with static bounds).",
        )
        return error


class KeyCollisionError(ValueError):
    """A reduced name equals the key of another name's occurrence (`"y_0"` beside `"y"`)."""

    def __init__(self, key: str, first: StateMeta, other: StateMeta):
        super().__init__(
            f"Two intermediates would both be keyed {key!r}: {first.name!r} "
            f"(reduce={first.reduce!r}) at {first.location} and {other.name!r} "
            f"(reduce={other.reduce!r}) at {other.location}. A reduced name is keyed by the "
            "name itself, an unreduced one by name_n. To fix: rename one of them."
        )


class CotangentsError(ValueError):
    """`pull(fn, cotangents=True)` (or a cotangent planted) where `fn` differentiates none of
    its marks inside it: there is no backward pass through them to read."""


class PlantError(ValueError):
    """A value given to `plant` (or `grad_inters`) that cannot go where it was asked to."""


class SelectionError(ValueError):
    """A selection (`at=`, or `only=`) that matches nothing, or selects a place it cannot
    mark. The message lists what there is, closest first."""


class StateError(ValueError):
    """State that `stateful` cannot thread as asked: a name passed in that the function never
    uses, a value of the wrong kind, or a set that leaves a name without a value on some path.
    The message names the state, where it is read or set, and what to do."""


class StatefulWarning(UserWarning):
    """`get_state` ran outside `stateful`: it returned its `init()`, and `set_state` did
    nothing."""


class StoreError(ValueError):
    """A store of captures (`stx.record`, `stx.open_store`) that cannot take or give what was
    asked: a path that is not one, a batch whose keys, shapes or dtypes differ from what it
    holds, or a write that failed (a full disk). What it committed before stays readable."""


class SweepError(ValueError):
    """A patching sweep (`stx.sweep`) that cannot run as asked: inputs whose sites differ in
    shape, an axis a site does not have, a metric that is not a scalar per example, a site
    that did not run."""


# Users catch these as `stx.SelectionError` and the like: tracebacks name them so.
for _error in (
    UnhandledPrimitiveError,
    HandlerError,
    ReduceMismatchError,
    KeyCollisionError,
    CotangentsError,
    PlantError,
    SelectionError,
    StateError,
    StatefulWarning,
    StoreError,
    SweepError,
):
    _error.__module__ = "statax"

"""The selections users write: `stx.modules`, `stx.scopes`, `stx.primitives`, `stx.lines`, and
what each matches.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from .._core.tracebacks import cell_of
from .where import same_file, scope_region

__all__ = ["Selection", "lines", "modules", "primitives", "scopes", "selections"]


class Selection:
    """What `at=` takes (a list of them too): made by `stx.scopes`, `stx.modules`,
    `stx.primitives` and `stx.lines`."""

    reduce: str | None


@dataclasses.dataclass(frozen=True)
class Scopes(Selection):
    patterns: tuple[str, ...]
    reduce: str | None = None
    marked: frozenset[str] = frozenset()  # scopes marked as they ran (Flax Linen modules)

    def region(self, stack: tuple) -> tuple[str, bool] | None:
        """`(path, transformed)` of the outermost scope of `stack` (a name stack's elements)
        that one of the patterns matches, and whether a transformation encloses it; `None`
        also for one marked already."""
        region = scope_region(self.patterns, stack)
        return None if region is None or region[0] in self.marked else region

    def __str__(self) -> str:
        return f"stx.scopes({', '.join(map(repr, self.patterns))})"


@dataclasses.dataclass(frozen=True)
class Lines(Selection):
    places: tuple[tuple[str, int], ...]
    reduce: str | None = None

    def region(self, eqn) -> str | None:
        """The place (`"file.py:42"`) whose line was running when `eqn` was traced."""
        traceback = eqn.source_info.traceback
        if traceback is None:
            return None
        frames = [(f.file_name, f.line_num) for f in traceback.frames]
        for file, line in self.places:
            if any(n == line and _at(f, file) for f, n in frames):
                return _shown(file, line)
        return None

    def __str__(self) -> str:
        return f"stx.lines({', '.join(repr(_shown(f, n)) for f, n in self.places)})"


def _at(file_name: str, file: str) -> bool:
    """Whether a frame's `file_name` is `file`: its path's end, or a notebook cell's label."""
    if file.startswith("Cell In["):
        return cell_of(file_name) == file
    return same_file(file_name, file)


def _shown(file: str, line: int) -> str:
    """A place as statax shows it: `"model.py:42"`, or `"Cell In[3], line 6"` in a notebook."""
    return f"{file}, line {line}" if file.startswith("Cell In[") else f"{file}:{line}"


@dataclasses.dataclass(frozen=True)
class Primitives(Selection):
    names: frozenset[str]
    reduce: str | None = None

    def __str__(self) -> str:
        return f"stx.primitives({', '.join(map(repr, sorted(self.names)))})"


@dataclasses.dataclass(frozen=True)
class Modules(Selection):
    paths: tuple  # strings, or functions of the root (as `eqx.tree_at`'s `where`)
    inputs: bool = False
    reduce: str | None = None
    of: Any = dataclasses.field(default=None, compare=False, hash=False)
    # `of`'s identity, which equality and hashing compare in its place (a model is no key):
    # selections of two models are two cache keys. Read by the dataclass's `__eq__`/`__hash__`.
    of_id: int | None = None

    def __str__(self) -> str:
        shown = [p if isinstance(p, str) else getattr(p, "__name__", "where") for p in self.paths]
        return f"stx.modules({', '.join(map(repr, shown))})"


def scopes(*patterns: str, reduce: str | None = None) -> Selection:
    """Select the values that leave a named scope: a Flax Linen module's path
    (`"Model/Block_0"`), an equinox layer's (`"eqx.nn.Linear"`), or any `jax.named_scope`.

    A value leaves a scope where it is made inside it and read after it, or returned: a
    module's output, seen in the program. Each call of a scope is one occurrence, its values
    together (a tuple where there are several), keyed by the scope's path
    (`"Model/Block_0_0"`).

    Each pattern selects the outermost scope it matches on a path; patterns are regions of
    their own, so a scope and one nested in it (`stx.scopes("Model/Block_1",
    "Model/Block_1/Dense_0")`) both come back, as two selections would.

    Args:
        *patterns: scope paths from the outermost, `/`-separated, as `fnmatch` patterns: `*`
            matches any run of characters, `/` included (`"Model/Block_*"`: every block,
            the outermost match on each path; `"*attn"`: a scope named `attn` anywhere).
        reduce: as `save_inter`'s.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     with jax.named_scope("block"):
        ...         h = jnp.sin(x) * 2
        ...     return h + 1
        >>> stx.pull(f, at=stx.scopes("block"))(jnp.float32(0.5))[1]
        {'block_0': Array(0.9588511, dtype=float32)}
    """
    return Scopes(_strings(patterns, "stx.scopes"), reduce)


def primitives(*names: str, reduce: str | None = None) -> Selection:
    """Select the outputs of every equation of these primitives (`"dot_general"`,
    `"conv_general_dilated"`), keyed by the primitive's name.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> f = lambda w, x: jnp.tanh(x @ w)
        >>> stx.pull(f, at=stx.primitives("dot_general"))(2 * jnp.eye(2), jnp.ones(2))[1]
        {'dot_general_0': Array([2., 2.], dtype=float32)}
    """
    return Primitives(frozenset(_strings(names, "stx.primitives")), reduce)


def lines(*places: str, reduce: str | None = None) -> Selection:
    """Select the values that the computation at a source line makes and that are read after
    it: `"model.py:42"` (the end of the file's path, and its line). Keyed by the place."""
    parsed = []
    for place in _strings(places, "stx.lines"):
        match = re.fullmatch(r"(Cell In\[\d+\]), line (\d+)", place) or re.fullmatch(
            r"(.+):(\d+)", place
        )
        if match is None:
            raise TypeError(
                f"stx.lines takes 'file.py:42' places (in a notebook, 'Cell In[3], line 6', as "
                f"statax shows them); got {place!r}."
            )
        parsed.append((match[1], int(match[2])))
    return Lines(tuple(parsed), reduce)


def modules(
    *paths: str | Callable, inputs: bool = False, of: Any = None, reduce: str | None = None
) -> Selection:
    """Select the outputs (and, with `inputs=True`, the inputs) of submodules' calls.

    Args:
        *paths: a path from the model (`"blocks[0].attn"`, `"blocks.0.attn"` and
            `"blocks/0/attn"` alike; `*` for every item of a list or dict: `"blocks[*]"`), or a
            function of the model returning the submodule (`lambda m: m.blocks[0].attn`, as
            `eqx.tree_at`'s `where`).
        inputs: also mark the arguments of each call, keyed `f"{path}.in"`: the argument
            where there is one, the tuple of positional arguments where there are several,
            `(args, kwargs)` where there are keyword arguments.
        of: the model the paths start from. By default the callable itself where it is a
            module (or a method of one), else the first argument that is an `eqx.Module` or a
            Flax NNX module.
        reduce: as `save_inter`'s.

    Keys are the paths (`"blocks[0].attn_0"`): one occurrence per call of the submodule, stacked
    where it runs in a `scan`, batched where it runs in a `vmap`.

    Examples:
        >>> import equinox as eqx, jax, statax as stx
        >>> mlp = eqx.nn.MLP(2, 1, width_size=3, depth=1, key=jax.random.PRNGKey(0))
        >>> _, inters = stx.pull(mlp, at=stx.modules("layers[*]"))(jax.numpy.ones(2))
        >>> {key: value.shape for key, value in inters.items()}
        {'layers[0]_0': (3,), 'layers[1]_0': (1,)}
    """
    for path in paths:
        if not (isinstance(path, str) or callable(path)):
            raise TypeError(f"stx.modules takes paths (strings) or functions; got {path!r}.")
    if not paths:
        raise TypeError("stx.modules needs at least one path.")
    return Modules(tuple(paths), bool(inputs), reduce, of, None if of is None else id(of))


def _strings(values: Sequence, what: str) -> tuple[str, ...]:
    if not values or not all(isinstance(v, str) and v for v in values):
        raise TypeError(f"{what} takes one or more non-empty strings; got {values!r}.")
    return tuple(values)


def selections(at: Any) -> tuple[Selection, ...]:
    """`at=` as a tuple of selections (hashable: part of a trace's cache key)."""
    if at is None:
        return ()
    items = (at,) if isinstance(at, Selection) else at
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, Selection) for s in items):
        text = next(
            (x for x in (at if isinstance(at, (list, tuple)) else [at]) if isinstance(x, str)), None
        )
        hint = ""
        if text is not None:
            hint = (
                f" For a mark saved as {text!r}, pull(fn, only={text!r}); for a named scope or "
                f"a module's path, at=stx.scopes({text!r}) or at=stx.modules({text!r})."
            )
        raise TypeError(
            "at= takes a selection (stx.scopes, stx.modules, stx.primitives, stx.lines) or a "
            f"list of them; got {at!r}.{hint}"
        )
    # A scope nested in another is a region of its own: one selection per pattern, so that
    # `stx.scopes("outer", "outer/inner")` marks both, as two selections do.
    return tuple(
        one
        for s in items
        for one in (
            [dataclasses.replace(s, patterns=(p,)) for p in s.patterns]
            if isinstance(s, Scopes) and len(s.patterns) > 1
            else [s]
        )
    )


def describe_selections(chosen: Sequence[Selection]) -> str:
    return " and ".join(map(str, chosen))

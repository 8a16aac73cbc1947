"""`StateMeta`: what statax knows about one intermediate besides its arrays."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ARRAY",
    "GRAD",
    "RAN",
    "KeyName",
    "LoopPlace",
    "share_taps",
    "tap_root",
    "StateMeta",
    "Static",
    "hashable",
    "key_names",
    "keys_of",
    "split",
]


class LoopPlace(collections.namedtuple("LoopPlace", "length reverse index count")):
    """Where a planted mark is in a `scan` that gives it one planted value per row
    (`StateMeta.loops`): the scan's `length`, whether its rows run in `reverse`, and the
    mark's place among the `count` marks its body takes values in for (`index`: their order
    in one iteration, which is program order)."""


class _ArraySlot:
    """Marks, in `StateMeta.static_leaves`, the place of an array leaf."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ARRAY"

    def __reduce__(self):
        return (_ArraySlot, ())


ARRAY = _ArraySlot()


class Static:
    """Holds an unhashable static leaf so that primitive params stay hashable (by identity)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def hashable(leaf: Any) -> Any:
    """`leaf`, or a `Static` holding it where it cannot be hashed."""
    try:
        hash(leaf)
    except TypeError:
        return Static(leaf)
    return leaf


def split(value: Any) -> tuple[Any, tuple[Any, ...], list]:
    """`(treedef, static_leaves, arrays)` of a pytree, as a `StateMeta` describes it: array
    leaves (JAX and NumPy arrays, tracers) are `ARRAY` in `static_leaves` and listed in
    `arrays`; the others are kept in `static_leaves` (made hashable)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    is_array = [eqx.is_array(leaf) for leaf in leaves]
    static = tuple(ARRAY if a else hashable(x) for x, a in zip(leaves, is_array, strict=True))
    return treedef, static, [x for x, a in zip(leaves, is_array, strict=True) if a]


NUMBERS = (int, float, complex)  # Python numbers (`bool`s are flags, not numbers, here)


def number_as_array(leaf: Any) -> Any:
    """A Python number as `jax.jit` takes one: a weakly typed array; any other leaf as it is."""
    return jnp.asarray(leaf) if type(leaf) in NUMBERS else leaf


def unwrap(leaf: Any) -> Any:
    """A static leaf as the user gave it (`Static` holds the unhashable ones)."""
    return leaf.value if isinstance(leaf, Static) else leaf


@dataclasses.dataclass(frozen=True)
class StateMeta:
    """Describes one intermediate: a pytree marked by one `save_inter` call.

    A handler exposes an intermediate as the flat array leaves it appends to an equation's
    outputs (`num_arrays` of them, in leaf order); the `StateMeta` says how to turn those
    leaves back into the value the user saved.

    Attributes:
        name: the name given to `save_inter`.
        treedef: the pytree structure of the saved value.
        static_leaves: one entry per leaf of `treedef`: `ARRAY` where an array leaf goes,
            else the non-array leaf itself (a string, `None`, a callable, ...), which is
            returned unchanged.
        location: `"file.py:line"` of the `save_inter` call, or `"<unknown>"`.
        batch_ndim: how many leading axes of each array leaf were added by `vmap`s inside
            the pulled function (outermost `vmap` first). Handlers that add an axis of their
            own (as `shard_map` does) put it after these, so that `pull(vmap(f))` and
            `vmap(pull(f))` agree.
        reduce: how the occurrences of `name` combine (`save_inter`'s `reduce`), or `None`
            to keep them apart as `name_0`, `name_1`, ...
        accumulator: whether the leaves are a running combination of occurrences rather
            than one occurrence's values: for the elementwise modes, the array leaves followed
            by one count of the same shape each; for `"stack"` and `"collect"`, the leaves with
            an occurrence axis after the batch axes followed by one boolean mask each, true
            where an occurrence ran (`"stack"`: one per row; `"collect"`: one per element).
        flagged: whether the array leaves are followed by one boolean, true where this
            occurrence ran (`pull(fn, ran=True)`: a `cond` branch not taken leaves it false,
            as it leaves the value zeros).
        tap: in a `pull(fn, cotangents=True)`, the number a differentiated mark shares with
            its cotangent's (`_core.cotangents`), so that the cotangent is keyed after it.
        grad: whether the leaves are the cotangent that flowed back through the mark `tap`
            numbers (keyed `f"{key}.grad"`), not its value.
        site: for a cotangent, the shapes of one occurrence's arrays at its mark (without the
            axes a `vmap` or a loop puts in front), so that its index is known.
        moves: for a cotangent read in loops that a `vmap` outside them batches (their marks'
            values taken out of the loops before it, so that the value has its batch axes
            first), per leading batch axis: how many of the loops still to stack it are inside
            that `vmap`. A loop that stacks it puts the axes with loops left in front of its
            own, so that the cotangent is laid out as its value is.
        failed: for what a planted mark takes in, per hook of its name, the error that hook
            raised on the value there (`""` where it did not): `plant` raises it where that hook
            is planted, and nowhere else, since a hook runs only where it is planted.
        stepped: for what a planted mark takes in, whether its last leaf is the iteration
            index of the innermost loop around it (a hook of its name has a `step` parameter):
            that loop's handler gives it (`exposers.take`), and outside any loop it is 0.
        loops: for what a planted mark takes in, the loops around it that took its step
            (`exposers.take`), outermost first: a `LoopPlace` for a `scan` (whose rows are its
            iterations), `None` for another loop (a planted value used in every iteration).
    """

    name: str
    treedef: jax.tree_util.PyTreeDef
    static_leaves: tuple[Any, ...]
    location: str = "<unknown>"
    batch_ndim: int = 0
    reduce: str | None = None
    accumulator: bool = False
    flagged: bool = False
    tap: int | None = None
    grad: bool = False
    site: tuple = ()
    moves: tuple = ()
    failed: tuple = ()
    stepped: bool = False
    loops: tuple = ()

    @property
    def planted_as(self) -> str:
        """The name `plant` knows this mark by: its name, or for a cotangent `f"{name}.grad"`."""
        return self.name + GRAD if self.grad else self.name

    @functools.cached_property
    def num_values(self) -> int:
        """How many array leaves the saved value has."""
        return sum(leaf is ARRAY for leaf in self.static_leaves)

    @functools.cached_property
    def num_arrays(self) -> int:
        """How many flat array leaves carry this intermediate (counts and masks included)."""
        counted = self.accumulator and self.reduce is not None
        return (2 * self.num_values if counted else self.num_values) + self.flagged

    def unflatten(self, arrays: Sequence[Any]) -> Any:
        """Rebuild the saved pytree from its array leaves."""
        arrays = iter(arrays)
        leaves = [next(arrays) if s is ARRAY else unwrap(s) for s in self.static_leaves]
        if next(arrays, None) is not None:
            raise ValueError(f"too many array leaves for {self.name!r}")
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def __repr__(self) -> str:
        return f"StateMeta(name={self.name!r}, arrays={self.num_arrays}, at {self.location})"


def kind_str(shape: Sequence[int], dtype: Any) -> str:
    """An array's kind as statax's messages write it: `float32[3, 2]`."""
    return f"{np.dtype(dtype).name}{list(shape)}"


def kinds_str(avals: Sequence[Any]) -> str:
    """`(float32[3], int32[])`: the kinds of values with a `shape` and a `dtype`."""
    return "(" + ", ".join(kind_str(a.shape, a.dtype) for a in avals) + ")"


def occurrences(metas: Sequence[StateMeta]) -> list[tuple[str, int]]:
    """`(name, n)` of each meta: its name, and which occurrence of it it is, counted from 0 in
    order (as `pull` keys them `name_n`)."""
    seen: dict[str, int] = {}
    out = []
    for meta in metas:
        n = seen.get(meta.name, 0)
        seen[meta.name] = n + 1
        out.append((meta.name, n))
    return out


GRAD = ".grad"  # a cotangent's key: its value's and this
RAN = ".ran"  # whether an occurrence ran (`pull(fn, ran=True)`): its key and this
_OCCURRENCE = re.compile(r"(.+)_(\d+)")


@dataclasses.dataclass(frozen=True)
class KeyName:
    """The format of the keys `pull` returns, in one place: `"h_0"` (occurrence 0 of `h`),
    `"h"` (a name saved with `reduce=`: one entry), and after either `".grad"` (the cotangent
    that flowed back through it) or `".ran"` (whether it ran).

    Attributes:
        name: the mark's name.
        occurrence: which occurrence of the name, from 0 in program order; `None` for a name
            saved with `reduce=`.
        suffix: `""` (the value), `GRAD` or `RAN`.
    """

    name: str
    occurrence: int | None = None
    suffix: str = ""

    def __str__(self) -> str:
        base = self.name if self.occurrence is None else f"{self.name}_{self.occurrence}"
        return base + self.suffix

    @classmethod
    def parse(cls, key: str) -> KeyName:
        """`key` read as `pull` writes keys: a trailing `_n` is an occurrence (`"h_2"` could also
        be a reduced name of its own; `str()` of either reading is `key` again)."""
        suffix = next((x for x in (GRAD, RAN) if key.endswith(x)), "")
        base = key[: len(key) - len(suffix)]
        match = _OCCURRENCE.fullmatch(base)
        if match is None:
            return cls(base, None, suffix)
        return cls(match[1], int(match[2]), suffix)

    @property
    def grad(self) -> bool:
        """Whether it names a cotangent."""
        return self.suffix == GRAD

    def value(self) -> KeyName:
        """The key of the value itself (of a cotangent or a `.ran` flag)."""
        return dataclasses.replace(self, suffix="")

    def cotangent(self) -> KeyName:
        return dataclasses.replace(self, suffix=GRAD)

    def ran(self) -> KeyName:
        return dataclasses.replace(self, suffix=RAN)


def keys_of(metas: Sequence[StateMeta], values: Sequence[StateMeta] = ()) -> list[str]:
    """The key `pull` gives each intermediate: `f"{name}_{n}"`, `n` counting the name's
    occurrences in order; a reduced name is keyed by itself; a cotangent by its value's key and
    `.grad`, its value being among `metas`, or else among `values` (the marks `pull` keys: for
    what `plant` takes in, where a cotangent comes without its value)."""
    return [str(k) for k in key_names(metas, values)]


# A tap number -> the number of the slot it is a branch's tap of (`share_taps`). Bounded, the
# oldest forgotten (a trace uses its own soon); numbers are never reused.
_TWINS: collections.OrderedDict[int, int] = collections.OrderedDict()


def share_taps(numbers: Sequence[int]) -> None:
    """The taps numbered `numbers` read one slot's cotangent, the first's: the marks of one slot
    of a `cond`, one in each branch, each left a tap. Where JAX runs every branch (a batched
    predicate: a `select` of their results), each example's cotangent comes through the tap of
    the branch it took, the other reading zeros, so a slot's cotangent is the sum of what its
    taps read (`tap_root` tells the naming so)."""
    first, *rest = numbers
    for n in rest:
        _TWINS[n] = first
    while len(_TWINS) > 4096:
        _TWINS.popitem(last=False)


def tap_root(n: int | None) -> int | None:
    """The number of the slot whose cotangent the tap `n` reads (`share_taps`): `n` itself,
    but for a `cond` branch's tap of a slot that another branch's tap numbers."""
    return _TWINS.get(n, n)


def key_names(metas: Sequence[StateMeta], values: Sequence[StateMeta] = ()) -> list[KeyName]:
    """`keys_of`, as `KeyName`s."""
    counts: dict[str, int] = {}
    keys: list[KeyName | None] = []
    # tap number -> the keys of the values it taps, in program order: one, or one per call of a
    # function that JAX differentiated once for all of them (a `jax.jit` called twice)
    tapped: dict[int, list[KeyName]] = {}
    for meta, key in zip(values, key_names(values) if values else (), strict=True):
        if meta.tap is not None and not meta.grad:
            tapped.setdefault(meta.tap, []).append(key)
    own = not tapped
    for meta in metas:
        if meta.reduce is not None:
            keys.append(KeyName(meta.name))
            continue
        if meta.grad:  # a cotangent: after its value's key (`"h_0.grad"`)
            keys.append(None)
            continue
        n = counts.get(meta.name, 0)
        counts[meta.name] = n + 1
        keys.append(KeyName(meta.name, n))
        if meta.tap is not None and own:
            tapped.setdefault(meta.tap, []).append(keys[-1])
    grads: dict[str, int] = {}  # (a cotangent whose value is not among `metas`: counted apart)
    left: dict[int, list[KeyName]] = {}  # per tap, the calls whose cotangent is still to come
    for i, meta in enumerate(metas):
        if keys[i] is None:
            # The backward pass runs the calls that share a tap in reverse: the first cotangent
            # is the last call's. (Each branch's tap of a `cond` slot reads each call once.)
            if meta.tap not in left:
                left[meta.tap] = list(tapped.get(tap_root(meta.tap), ()))
            calls = left[meta.tap]
            key = calls.pop() if calls else None
            if key is None:
                n = grads.get(meta.name, 0)
                grads[meta.name] = n + 1
                key = KeyName(meta.name, n)
            keys[i] = key.cotangent()
    return keys

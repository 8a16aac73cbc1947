"""`open_store`: a store of captures read back, lazily, and a shuffled, batched iterator for
training from it."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from .._core.errors import StoreError
from . import layout

__all__ = ["Store", "StoredArray", "open_store"]


def open_store(path: str) -> Store:
    """The store `stx.record` wrote at `path`: a mapping of keys to arrays read lazily
    (`store["h_0"][:100]` reads 100 rows), holding the batches committed (a batch a killed run
    left partly written is not there), with the store's metadata (`store.metadata`) and a
    shuffled, batched iterator (`store.batches(...)`)."""
    metadata = layout.read_metadata(str(path))
    if metadata is None:
        raise StoreError(
            f"{str(path)!r} holds no store of captures"
            + (" (it does not exist)." if not os.path.exists(path) else " (it is empty).")
            + " stx.record(fn, to=path) makes one."
        )
    return Store(str(path), metadata)


class StoredArray:
    """One key of a store: its committed rows, read when indexed (numpy indexing along the
    rows and the other axes; `np.asarray(array)` reads all)."""

    def __init__(self, array, rows: int, key: str, location: str):
        self._array = array[:rows]
        self.key, self.location = key, location

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._array.dtype.numpy_dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        """NumPy's answer for any index NumPy takes (negative indices, slices past the end,
        steps, integer and boolean arrays, `None`, `...`): the block the index reaches is read,
        and indexed as NumPy would index the whole array."""
        box, local = numpy_index(index, self.shape)
        block = np.asarray(self._array[box].read().result())
        return block[local]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self[start:stop]

    def __repr__(self) -> str:
        return f"StoredArray({self.key!r}, shape={self.shape}, dtype={self.dtype})"


def numpy_index(index, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple]:
    """`(box, local)` such that `a[index]` is `a[box][local]` for an array `a` of `shape`, as
    NumPy indexes it: `box` is a slice per axis with steps of 1 within the array (the block the
    index reaches), `local` the index into that block. NumPy's `IndexError`s are raised here,
    before anything is read."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [_as_index(item) for item in items]
    consumed = sum(_axes_taken(item) for item in items)
    if consumed > len(shape):
        raise IndexError(
            f"too many indices for array: array is {len(shape)}-dimensional, but {consumed} "
            "were indexed"
        )
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    rest = len(shape) - consumed  # the axes `...` (or the end) stands for
    if not any(item is Ellipsis for item in items):
        items.append(Ellipsis)
    # Integer arrays that broadcast to nothing select nothing: NumPy checks none of them.
    arrays = [i.shape for i in items if isinstance(i, np.ndarray) and i.ndim and i.dtype != bool]
    arrays += [(int(i.sum()),) for i in items if isinstance(i, np.ndarray) and i.dtype == bool]
    try:
        empty = bool(arrays) and math.prod(np.broadcast_shapes(*arrays)) == 0
    except ValueError:
        raise IndexError(
            "shape mismatch: indexing arrays could not be broadcast together with shapes "
            + " ".join(map(str, arrays))
        ) from None
    box, local, axis = [], [], 0
    for item in items:
        if item is None:
            local.append(None)
            continue
        if item is Ellipsis:  # kept in the local index: NumPy places advanced axes by it
            box += [slice(0, n) for n in shape[axis : axis + rest]]
            local.append(Ellipsis)
            axis += rest
            continue
        if isinstance(item, np.ndarray) and item.dtype == bool:
            dims = shape[axis : axis + item.ndim]
            if item.shape != dims:
                raise IndexError(
                    f"boolean index did not match indexed array along axis {axis}; size of "
                    f"axis is {dims} but size of corresponding boolean axis is {item.shape}"
                )
            for positions, n in zip(np.nonzero(item), dims):
                lo, hi = _bounds(positions, n)
                box.append(slice(lo, hi))
                local.append(positions - lo)
            axis += item.ndim
            continue
        n = shape[axis]
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            taken = range(start, stop, step)
            if not taken:
                box.append(slice(0, 0))
                local.append(slice(0, 0))
            else:
                lo, hi = min(taken[0], taken[-1]), max(taken[0], taken[-1]) + 1
                end = taken[-1] - lo + (1 if step > 0 else -1)
                box.append(slice(lo, hi))
                local.append(slice(taken[0] - lo, None if end < 0 else end, step))
        else:  # an integer, or an array of them
            positions = np.where(item < 0, item + n, item)
            if empty and positions.ndim:
                box.append(slice(0, 0))
                local.append(np.zeros_like(positions))
                axis += 1
                continue
            if np.any((positions < 0) | (positions >= n)):
                bad = np.asarray(item).ravel()[np.argmax((positions < 0) | (positions >= n))]
                raise IndexError(f"index {bad} is out of bounds for axis {axis} with size {n}")
            lo, hi = _bounds(positions, n)
            box.append(slice(lo, hi))
            local.append(positions - lo if positions.ndim else int(positions) - lo)
        axis += 1
    return tuple(box), tuple(local)


def _as_index(item):
    """An index item as NumPy reads it: a list or array of integers or booleans an array."""
    if item is None or item is Ellipsis or isinstance(item, slice):
        return item
    if isinstance(item, (bool, np.bool_)):
        raise IndexError("a boolean scalar index is not supported; index with an array")
    if isinstance(item, (int, np.integer)):
        return np.asarray(int(item))
    if isinstance(item, list) and not item:  # NumPy reads [] as an integer index
        return np.zeros(0, np.intp)
    array = np.asarray(item)
    if array.dtype == bool or np.issubdtype(array.dtype, np.integer):
        return array
    raise IndexError(
        "only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) and integer or "
        f"boolean arrays are valid indices (got {type(item).__name__})"
    )


def _axes_taken(item) -> int:
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, np.ndarray) and item.dtype == bool:
        return item.ndim
    return 1


def _bounds(positions: np.ndarray, n: int) -> tuple[int, int]:
    if positions.size == 0:
        return 0, 0
    return int(positions.min()), int(positions.max()) + 1


class Store(Mapping):
    """What `open_store` returns."""

    def __init__(self, path: str, metadata: dict):
        self.path, self.metadata = path, metadata
        self.batches_committed, self.rows = layout.committed(path, metadata["processes"])
        self._arrays: dict[str, StoredArray] = {}

    def __getitem__(self, key: str) -> StoredArray:
        if key not in self.metadata["keys"]:
            raise KeyError(
                f"{key!r} is not a key of the store at {self.path!r}; it has "
                f"{sorted(self.metadata['keys'])}."
            )
        if key not in self._arrays:
            about = self.metadata["keys"][key]
            rows = self.batches_committed if about["rows"] == "batches" else self.rows
            array = layout.open_array(self.path, key, read_only=True)
            self._arrays[key] = StoredArray(array, rows, key, about["location"])
        return self._arrays[key]

    def __iter__(self):
        return iter(self.metadata["keys"])

    def __len__(self) -> int:
        return len(self.metadata["keys"])

    def __repr__(self) -> str:
        return (
            f"Store({self.path!r}: {self.batches_committed} batches, {self.rows} rows, "
            f"keys {list(self)})"
        )

    def batches(
        self,
        batch_size: int,
        keys: Sequence[str] | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        buffer_rows: int | None = None,
        drop_last: bool = True,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of `batch_size` rows, `{key: rows}` for `keys` (default: every key whose
        rows are examples), the same rows of each key.

        Shuffled (`shuffle=True`) across the whole store without loading it: blocks of
        contiguous rows (one chunk each) are read in a random order into a buffer of
        `buffer_rows` (default: 16 batches), whose rows are shuffled and given out in batches;
        the rows a buffer leaves over go into the next. One pass over the store; `seed` fixes
        the order. `drop_last=False` gives the last, smaller batch too."""
        keys = list(keys) if keys is not None else self._example_keys()
        arrays = [self[key] for key in keys]
        for key in keys:
            if self.metadata["keys"][key]["rows"] != "examples":
                raise StoreError(
                    f"store.batches: {key!r} holds a row per recorded batch (a summary), not "
                    "per example; iterate over it with store[key][:]."
                )
        rows = self.rows
        block = self._block_rows(keys)
        starts = np.arange(0, rows, block)
        rng = np.random.default_rng(seed)
        if shuffle:
            starts = rng.permutation(starts)
        buffer_rows = max(batch_size, buffer_rows or 16 * batch_size)
        pending: list[np.ndarray] | None = None
        i = 0
        while i < len(starts) or pending is not None:
            read = []
            while i < len(starts) and sum(len(r) for r in read) < buffer_rows:
                start = int(starts[i])
                read.append(np.arange(start, min(start + block, rows)))
                i += 1
            spans = [(int(r[0]), int(r[-1]) + 1) for r in read]
            fresh = (
                [np.concatenate([a.rows(lo, hi) for lo, hi in spans]) for a in arrays]
                if spans
                else None
            )
            if pending is not None:
                fresh = (
                    pending if fresh is None else [np.concatenate(p) for p in zip(pending, fresh)]
                )
                pending = None
            n = len(fresh[0])
            order = rng.permutation(n) if shuffle else np.arange(n)
            full = n - n % batch_size
            for lo in range(0, full, batch_size):
                take = order[lo : lo + batch_size]
                yield {key: values[take] for key, values in zip(keys, fresh)}
            rest = order[full:]
            if len(rest):
                leftover = [values[rest] for values in fresh]
                if i < len(starts):
                    pending = leftover
                elif not drop_last:
                    yield dict(zip(keys, leftover))

    def _example_keys(self) -> list[str]:
        return [k for k, about in self.metadata["keys"].items() if about["rows"] == "examples"]

    def _block_rows(self, keys) -> int:
        """The rows of one chunk of the first key (a read of a block touches whole chunks)."""
        if not keys:
            raise StoreError(f"store.batches: the store at {self.path!r} has no keys to batch.")
        chunk = self[keys[0]]._array.chunk_layout.write_chunk.shape
        return max(1, int(chunk[0]))

"""A store of captures on disk: a zarr v3 group, read and written by tensorstore.

    acts.zarr/zarr.json             the group; its attribute "statax" is the store's metadata
    acts.zarr/<key>/...             one zarr v3 array per key, the examples along axis 0
    acts.zarr/_statax/commit.<p>    what process p has committed: {"batches": b, "rows": r}
    acts.zarr/_statax/making.json   while the store is being made: the metadata it will have

A store is made in an order that a killed run can always be told from: `_statax/` first (with
`making.json`), then the arrays, then `zarr.json`, the name only a finished store has (each
file is written whole, to a temporary name, and renamed into place). A folder with `_statax/`
and no `zarr.json` is a store half made, with no batch in it: `stx.record` makes it again,
`stx.open_store` says so.

A batch is committed once every array holds it: each process writes its commit record (an
atomic replace) after its own writes of that batch are done, and the store holds the batches
every process has committed. Rows past them (a run killed mid-write) are a partial batch: a
reader does not see them, and the next run overwrites them.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from typing import Any

import numpy as np

from .._core.errors import StoreError
from .._monitor.optional import require

__all__ = [
    "FORMAT",
    "HalfMade",
    "array_path",
    "begin",
    "chunk_shape",
    "array_spec",
    "committed",
    "cut",
    "finish",
    "kvstore",
    "new_array",
    "open_array",
    "read_metadata",
    "region",
    "remove_stale_locks",
    "tensorstore",
    "write_commit",
]

FORMAT = 1  # the layout's version, in the metadata
CHUNK_BYTES = 64 << 20  # a chunk holds at most this much (fewer rows of a shard)
_GROUP = "zarr.json"
_COMMITS = "_statax/"
_MAKING = "_statax/making.json"


class HalfMade(StoreError):
    """The folder holds a store whose making was cut short (a run killed before its arrays and
    metadata were all written): it holds no batch."""


def tensorstore():
    return require("tensorstore", "store")


def kvstore(path: str):
    """The store's files, as tensorstore's key-value store (its writes replace atomically)."""
    ts = tensorstore()
    return ts.KvStore.open({"driver": "file", "path": os.path.abspath(path) + "/"}).result()


def array_path(key: str) -> str:
    """A key's folder: the key, with what a path cannot hold quoted (`"blocks/mlp_0"` is
    `"blocks%2Fmlp_0"`), so that every key is one array of the group."""
    return urllib.parse.quote(key, safe="[]()._-")


def array_spec(path: str, key: str) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.path.join(os.path.abspath(path), array_path(key))},
    }


def read_metadata(path: str) -> dict | None:
    """The store's metadata; None where `path` holds no store yet (absent, or an empty folder).
    Anything else there is a `StoreError`: statax writes only where it made the store."""
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        raise StoreError(f"{path!r} is a file, not a store of captures. Give a folder's path.")
    if not os.listdir(path):
        return None
    found = kvstore(path).read(_GROUP).result()
    if found.state != "value" and os.path.isdir(os.path.join(path, _COMMITS)):
        raise HalfMade(
            f"{path!r} holds a store whose making was cut short (the run that made it ended "
            "before its arrays and metadata were all written): it holds no batch. "
            "stx.record(fn, to=path) makes it again; or remove the folder."
        )
    what = None
    if found.state == "value":
        try:
            group = json.loads(bytes(found.value))
            what = group.get("attributes", {}).get("statax")
        except (ValueError, AttributeError):
            what = None
    if not isinstance(what, dict) or what.get("format") != FORMAT:
        raise StoreError(
            f"{path!r} is not a store of captures: it is a folder that holds "
            f"{sorted(os.listdir(path))[:5]} but no zarr.json with statax's metadata "
            f"(format {FORMAT}). Give a new path (or an empty folder), or the path of a store "
            "stx.record made."
        )
    return what


def begin(path: str, metadata: dict) -> None:
    """Start making a store at `path` (absent, empty, or half made: then emptied): `_statax/`
    and the metadata it will have, before anything else."""
    if os.path.isdir(path):
        for name in os.listdir(path):
            where = os.path.join(path, name)
            shutil.rmtree(where) if os.path.isdir(where) else os.remove(where)
    os.makedirs(os.path.join(path, _COMMITS), exist_ok=True)
    kvstore(path).write(_MAKING, json.dumps(metadata, indent=1).encode()).result()


def finish(path: str, metadata: dict) -> None:
    """The store made: its metadata in `zarr.json` (from then on it is a store), and the mark
    of its making gone."""
    group = {"zarr_format": 3, "node_type": "group", "attributes": {"statax": metadata}}
    kv = kvstore(path)
    kv.write(_GROUP, json.dumps(group, indent=1).encode()).result()
    os.remove(os.path.join(path, _MAKING))


def remove_stale_locks(path: str) -> None:
    """Remove the lock files a killed writer left. tensorstore's file store writes a file
    through `<name>.__lock`, then renames it into place; a process killed in between leaves
    that file, and the next write of `<name>` reuses it without truncating it (seen with
    tensorstore 0.1.86: a longer stale file leaves its tail in the new one). Called before any
    process writes to a store it appends to."""
    for folder, _, files in os.walk(path):
        for name in files:
            if name.endswith(".__lock"):
                os.remove(os.path.join(folder, name))


def committed(path: str, processes: int) -> tuple[int, int]:
    """`(batches, rows)` that every one of the store's writing processes has committed."""
    kv = kvstore(path)
    records = []
    for process in range(processes):
        found = kv.read(f"{_COMMITS}commit.{process}").result()
        if found.state != "value":
            return 0, 0
        records.append(json.loads(bytes(found.value)))
    least = min(records, key=lambda record: record["batches"])
    return least["batches"], least["rows"]


def write_commit(path: str, process: int, batches: int, rows: int) -> None:
    record = json.dumps({"batches": batches, "rows": rows}).encode()
    kvstore(path).write(f"{_COMMITS}commit.{process}", record).result()


def new_array(path: str, key: str, row: tuple, dtype: str, chunk: tuple) -> Any:
    """A key's array, empty: `(0, *row)`, growing along axis 0, chunked as `chunk`."""
    ts = tensorstore()
    metadata = {
        "shape": [0, *row],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "dimension_names": ["examples", *(f"axis_{i}" for i in range(1, len(row) + 1))],
    }
    spec = array_spec(path, key) | {"metadata": metadata}
    return ts.open(spec, create=True, delete_existing=True).result()


def open_array(path: str, key: str, read_only: bool = False) -> Any:
    ts = tensorstore()
    mode = {"read": True} if read_only else {"read": True, "write": True}
    return ts.open(array_spec(path, key), **mode).result()


def cut(array, rows: int) -> None:
    """`array` cut (or grown) to `rows` rows, its metadata only."""
    array.resize(
        exclusive_max=[rows, *[None] * (array.rank - 1)], resize_metadata_only=True
    ).result()


def region(index: slice, start: int, length: int) -> slice:
    """A shard's rows (`index` into a batch of `length`) in the store, the batch at `start`."""
    lo, hi, _ = index.indices(length)
    return slice(start + lo, start + hi)


def chunk_shape(value: Any, group: int) -> tuple:
    """A chunk: one shard's columns, and its rows of one batch (several processes: each
    writes its own chunks), or `group` batches' rows (one process, which holds them all);
    fewer rows where that passes `CHUNK_BYTES`."""
    shard = value.sharding.shard_shape(value.shape)
    row = int(np.prod(shard[1:], dtype=np.int64)) * value.dtype.itemsize
    rows = max(1, shard[0] if group == 1 else value.shape[0] * group)
    while rows > 1 and rows * row > CHUNK_BYTES:
        rows = next(d for d in range(rows // 2, 0, -1) if shard[0] % d == 0)
    return (rows, *[max(1, n) for n in shard[1:]])

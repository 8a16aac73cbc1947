"""`record`: run a function batch after batch and append what `pull` returns to a store on
disk, shard by shard, in the background.

A step is one compiled program: the function, its marks (`only=`, `at=`, `summarize=` as in
`pull`), the examples axis moved to the front, positions subsampled, values moved to host
memory; then each process hands the shards it holds (one copy of each) to the writer, which
writes them into their regions of the store while the device runs the next step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import StoreError
from .._drivers.programs import Programs
from .._drivers.pull import pull
from .._monitor.optional import progress_bar
from . import capture, layout, metadata
from .writing import Writer

__all__ = ["Recorder", "record"]

_GROUP_BYTES = 16 << 20  # one process's consecutive batches are one chunk up to this much


def record(
    fn: Callable,
    to: str,
    *,
    only: Any = None,
    at: Any = None,
    summarize: Callable | None = None,
    axis: int | Mapping[str, int] = 0,
    keys: Any = None,
    steps: Any = None,
    ran: bool = False,
    output: bool = True,
    positions: int | None = None,
    position_axis: int = 1,
    seed: int = 0,
    offload: bool = False,
    max_in_flight: int = 1 << 30,
    chunk_batches: int | None = None,
    progress: bool | None = None,
) -> Recorder:
    """Record what `stx.pull(fn)` returns, call after call, into a store at `to`.

    `recorder = stx.record(fn, to="acts.zarr", at=...)` is called as `fn` is and returns `fn`'s
    output (None with `output=False`); each call appends its batch to the store: one zarr v3
    array per key (tensorstore writes them), the examples along axis 0. A value sharded over
    devices is written shard by shard, by the process that holds each shard, into its region:
    nothing is gathered. The writes run in the background and overlap the next call; `flush()`
    (or leaving a `with` block) waits for them. A store that holds batches already is appended
    to, after the last one committed. `stx.open_store(to)` reads it back.

    Args:
        fn: the function, as `pull` takes it.
        to: the store's folder: new, empty, or a store `record` made.
        only: as in `pull`: the marks to record.
        at: as in `pull`: selections that make marks where none were written.
        summarize: as in `pull`; each call's summaries are then one row (the store's rows are
            batches, not examples).
        axis: the axis of each value that counts examples (an int, or `{key: axis}` with 0
            for the keys not given; a key's `.ran` masks follow it); it becomes the store's
            axis 0. Every key must have the same number of examples.
        keys: record only these keys: a key (`"h_2"`), a name for each of its occurrences
            (`"h"`), or a list of them; `None`, every key. For a generation, the loop's key
            alone (`steps=` gives its rows, its examples on axis 1), not the prompt's.
        steps: as in `pull`: every iteration of a `while_loop`, in rows (see "Generation and
            solvers").
        ran: as in `pull`: also store which rows ran (`f"{key}.ran"`), so that the number of
            tokens each prompt generated is `store[f"{key}.ran"][:].sum(1)`.
        output: return `fn`'s output from each call. With `output=False` a call returns None
            and its compiled step computes only what the recorded values need: recording block
            3 of 12 runs blocks 0 to 3 (the compiler drops the rest, as SAELens's
            `stop_at_layer` stops the forward pass).
        positions: keep this many random positions per example (along `position_axis`, of
            every value that has it), as sparse-autoencoder recipes keep k tokens per sequence.
            Drawn on device from `seed` and the batch's number; the positions kept are stored
            too, as `"_positions"` (examples × positions).
        position_axis: the positions' axis, counted with the examples at 0.
        seed: the subsample's seed (in the store's metadata).
        offload: move the captured values to host memory (`pinned_host`) inside the compiled
            program, so that they do not stay on the device; an error where the backend has
            no host memory space.
        max_in_flight: the bytes of batches not yet written that may wait in host memory; at
            the limit, the next call waits for the disk.
        chunk_batches: how many consecutive batches one chunk's rows hold, written and
            committed together (a killed run loses at most these): by default, as many as make
            16 MiB of the largest value, up to 64 (with several processes, one: each process
            writes its own shards' chunks).
        progress: show a progress bar (tqdm): None shows one where tqdm is installed and the
            output is a terminal.
    """
    if not callable(fn):
        raise TypeError(f"stx.record needs a callable, got {fn!r} of type {type(fn).__name__}.")
    if positions is not None:
        if summarize is not None:
            raise ValueError(
                "stx.record: positions= subsamples the positions of captured values, and "
                "summarize= leaves only summaries, which have none. Give one of the two."
            )
        if int(positions) < 1 or int(position_axis) < 1:
            raise ValueError(
                f"stx.record: positions={positions} and position_axis={position_axis}: keep at "
                "least one position, on an axis after the examples' (axis 0)."
            )
    if offload:
        capture.check_host_memory()
    if keys is not None:
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
    pulled = pull(fn, only=only, at=at, summarize=summarize, steps=steps, ran=ran)
    return Recorder(
        pulled,
        str(to),
        axis=axis,
        keys=keys,
        output=bool(output),
        subsample=None if positions is None else (int(positions), int(position_axis), int(seed)),
        offload=bool(offload),
        max_in_flight=max_in_flight,
        chunk_batches=chunk_batches,
        progress=progress,
        selection={
            "only": None if only is None else repr(only),
            "at": [str(selection) for selection in pulled.at],
            "summarize": None if summarize is None else metadata.qualname(summarize),
            "keys": None
            if keys is None
            else sorted(map(str, [keys] if isinstance(keys, str) else keys)),
            "steps": steps,
            "ran": bool(ran),
        },
    )


class Recorder:
    """What `stx.record` returns: call it as the function; `flush()` waits for the writes;
    `close()` (or leaving a `with` block) flushes and stops the writer."""

    def __init__(
        self,
        pulled,
        path,
        *,
        axis,
        keys=None,
        output=True,
        subsample,
        offload,
        max_in_flight,
        chunk_batches,
        progress,
        selection,
    ):
        self.path = path
        axis = tuple(sorted(axis.items())) if isinstance(axis, Mapping) else int(axis)
        self._capture = capture.Capture(pulled, axis, subsample, offload, keys, output)
        self._selection = selection
        self._per_batch = pulled.summarize is not None
        self._process, self._processes = jax.process_index(), jax.process_count()
        try:  # (a path that is not a store fails here)
            existing = layout.read_metadata(path)
        except layout.HalfMade:  # made again, from the start, on the first call
            existing = None
        if existing is not None and existing["processes"] != self._processes:
            raise StoreError(
                f"{path!r} was written by {existing['processes']} processes; this run has "
                f"{self._processes}. Append with as many processes, or record to a new path."
            )
        self.metadata = existing
        self._batches, self._rows = (
            (0, 0) if existing is None else layout.committed(path, existing["processes"])
        )
        self._arrays: dict[str, Any] | None = None  # key -> tensorstore array, from the first call
        self._capacity: dict[str, int] = {}  # key -> rows its array holds (some uncommitted)
        self._step_rows = 1
        self._programs = Programs(keep=8)
        self._chunk_batches = chunk_batches
        self._group = 1  # batches per group (one chunk's rows), set on the first call
        self._pending = 0  # batches of the group not yet closed
        self._open_group: _Group | None = None  # the writer's
        self._writer = Writer(max_in_flight)
        self._bar = progress_bar(
            progress,
            "stx.record",
            "store",
            desc=f"recording to {path}",
            unit="batch",
            initial=self._batches,
        )
        self._closed = False

    # The step: traced at every call (the function as it is now: a model's weights, a global),
    # compiled once per structure of its trace (`Programs`).

    def lower(self, *args, **kwargs):
        """The compiled step's `jax.stages.Lowered` for these arguments: `.compile()` gives
        its HLO (`.as_text()`) and `memory_analysis()`. Its inputs and outputs are flat: the
        constants the function reads and the arguments' arrays; the output's arrays, then the
        captured values'."""
        step = functools.partial(capture.step, self._capture)
        return self._programs.lower(step, jnp.int32(self._batches), args, kwargs)

    # A call.

    def __call__(self, *args, **kwargs):
        if self._closed:
            raise StoreError(f"stx.record to {self.path!r}: the recorder is closed.")
        step = functools.partial(capture.step, self._capture)
        out, values = self._programs(step, jnp.int32(self._batches), args, kwargs)
        rows = self._rows_of(values)
        if self._arrays is None:
            self._open(values)
        else:
            self._check(values)
        pieces, nbytes = [], 0
        for key, value in values.items():
            for shard in value.addressable_shards:
                if shard.replica_id == 0:  # one copy of each region, by the process holding it
                    shard.data.copy_to_host_async()
                    pieces.append((key, shard.index, value.shape[0], shard.data))
                    nbytes += shard.data.nbytes
        batch, offset = self._batches, self._rows
        self._batches, self._rows = batch + 1, offset + rows
        self._pending = (self._pending + 1) % self._group
        closes = self._pending == 0
        job = functools.partial(self._write, batch, offset, rows, pieces, closes)
        self._writer.submit(nbytes, job)
        return out

    def _rows_of(self, values) -> int:
        sizes = {key: v.shape[0] for key, v in values.items()}
        if self._per_batch:
            return 0
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"{k!r}: {n}" for k, n in sizes.items())
            raise StoreError(
                f"stx.record to {self.path!r}: the values have different numbers of examples "
                f"along their examples axis ({shown}). Give each key's examples axis with "
                "axis={key: ...}, or record some keys only with keys=[...] (a generation: "
                "the prompt's call and the loop's rows count examples on other axes)."
            )
        return next(iter(sizes.values()), 0)

    def _write(self, batch, offset, rows, pieces, closes):
        """The writer's job for one batch: its pieces written into their regions, in the
        transaction of its group of batches (one chunk's rows); where it closes the group, the
        transaction committed. What it returns waits for the group's commit; the last batch's
        then writes the commit record."""
        group = self._open_group
        if group is None:
            group = self._open_group = _Group(layout.tensorstore().Transaction(), batch)
        start = batch if self._per_batch else offset
        end = start + (1 if self._per_batch else rows)
        group.last = (batch + 1, offset + rows)
        try:
            with self._failing(batch, group.first):
                for key in {key for key, *_ in pieces}:
                    self._grow(key, end)
                staged = []
                for key, index, length, data in pieces:
                    region = (layout.region(index[0], start, length), *index[1:])
                    array = self._arrays[key].with_transaction(group.transaction)
                    # (a jax array is immutable: its buffer is read in place, not copied)
                    source = np.asarray(data)
                    staged.append(
                        array[region].write(source, can_reference_source_data_indefinitely=True)
                    )
                for future in staged:  # staged in the transaction
                    future.result()
            if closes:
                self._seal()
        except BaseException as error:
            if not group.committing.done():
                group.committing.set_exception(error)
            raise
        return functools.partial(self._committed, group, batch, closes, True)

    def _seal(self):
        """Commit the open group's transaction (its writes begin); a writer's job of its own
        where `flush` closes a group early."""
        group, self._open_group = self._open_group, None
        if group is not None:
            group.committing.set_result(group.transaction.commit_async())
            return functools.partial(self._committed, group, group.last[0] - 1, True, False)
        return lambda commit: None

    def _committed(self, group, batch, closes, counted, commit: bool) -> None:
        """Wait for the group's commit (`closes`: then write the commit record; `counted`: a
        batch's job, which the progress bar counts, not `flush`'s)."""
        if not commit:  # a job before failed: this one ends uncommitted
            return
        with self._failing(batch, group.first):
            group.committing.result().result()
            if closes:
                layout.write_commit(self.path, self._process, *group.last)
        if self._bar is not None and counted:
            self._bar.update(1)

    @contextlib.contextmanager
    def _failing(self, batch: int, committed: int):
        """A failure writing `batch`, whose group begins after the `committed` batches."""
        try:
            yield
        except Exception as error:
            raise StoreError(
                f"stx.record to {self.path!r}: writing batch {batch} failed: {error}. The "
                f"store keeps the {committed} batches committed before it; record again to "
                "append after them."
            ) from error

    def _grow(self, key: str, rows: int) -> None:
        """`key`'s array at least `rows` long: grown to twice what it holds where it is not (so
        its metadata is rewritten a few times, not once a batch), cut back on `close()`. Another
        process may have grown it further meanwhile."""
        if self._capacity.get(key, -1) >= rows:
            return
        array = self._arrays[key]
        try:
            array = array.resize(
                exclusive_max=[
                    max(rows, 2 * self._capacity.get(key, 0), self._step_rows),
                    *[None] * (array.rank - 1),
                ],
                expand_only=True,
                resize_metadata_only=True,
            ).result()
        except ValueError as error:  # grown past that by another process
            if "shrink" not in str(error):
                raise
            array = array.resolve().result()
        self._arrays[key] = array
        self._capacity[key] = int(array.domain.exclusive_max[0])

    # The store: made (or checked) on the first call, when the values' shapes are known.

    def _open(self, values) -> None:
        described = {
            str(key): {
                "path": layout.array_path(str(key)),
                "row_shape": list(v.shape[1:]),
                "dtype": str(v.dtype),
                "rows": "batches" if self._per_batch else "examples",
                "location": key.location,
                "reduce": key.reduce,
            }
            for key, v in values.items()
        }
        if self.metadata is not None:
            self._check(values, described)
            self._check_settings()
            if self._process == 0:
                layout.remove_stale_locks(self.path)
                for key in described:  # a partial batch after the last committed one goes
                    end = self._batches if self._per_batch else self._rows
                    layout.cut(layout.open_array(self.path, key), end)
        self._group = self._group_size(values)
        # Arrays grow by at least four groups' rows at a time (a resize rewrites metadata).
        batch_rows = 1 if self._per_batch else next(iter(values.values())).shape[0]
        self._step_rows = 4 * self._group * batch_rows
        if self.metadata is None and self._process == 0:
            made = metadata.made(
                described, self._processes, self._capture.subsample, self._selection
            )
            layout.begin(self.path, made)
            for key, v in values.items():
                chunk = layout.chunk_shape(v, self._group if self._processes == 1 else 1)
                layout.new_array(self.path, str(key), v.shape[1:], str(v.dtype), chunk)
            layout.finish(self.path, made)
            self.metadata = made
        if self._processes > 1:  # every process opens what process 0 made
            _barrier(f"statax.record.open:{self.path}", self._processes)
            self.metadata = layout.read_metadata(self.path)
        self._arrays = {str(k): layout.open_array(self.path, str(k)) for k in values}

    def _group_size(self, values) -> int:
        """How many batches one chunk's rows hold: with one process, which holds every row,
        as many as make `_GROUP_BYTES` of the largest value (and half the bytes in flight);
        with several, one (each process writes its own shards' chunks)."""
        if self._chunk_batches is not None:
            return max(1, int(self._chunk_batches))
        if self._processes > 1:
            return 1
        largest = max((v.nbytes for v in values.values()), default=1) or 1
        total = sum(v.nbytes for v in values.values()) or 1
        return int(max(1, min(64, _GROUP_BYTES // largest, self._writer.limit // 2 // total)))

    def _check(self, values, described=None) -> None:
        described = described or {
            str(k): {"row_shape": list(v.shape[1:]), "dtype": str(v.dtype)}
            for k, v in values.items()
        }
        problems = metadata.keys_problems(self.metadata["keys"], described)
        if problems:
            raise StoreError(
                f"stx.record to {self.path!r}: this batch does not fit the store: "
                + "; ".join(problems)
                + f". The store keeps its {self._batches_committed()} committed batches. Record "
                "what it holds (the same marks, selections and shapes), or to a new path."
            )

    def _check_settings(self) -> None:
        """How the store's rows were made must be this recorder's (`settings_problems`)."""
        subsample = self._capture.subsample
        problems = metadata.settings_problems(self.metadata, self._selection, subsample)
        if problems:
            raise StoreError(
                f"stx.record to {self.path!r}: the store was recorded otherwise: "
                + "; ".join(problems)
                + f". The store keeps its {self._batches_committed()} committed batches, "
                "unchanged. Record as it was recorded (the same only=, at=, summarize=, "
                "positions= and seed=), or to a new path."
            )

    def _batches_committed(self) -> int:
        return layout.committed(self.path, self._processes)[0]

    # Waiting and closing.

    @property
    def batches(self) -> int:
        """The batches recorded so far (those submitted; `flush()` waits for them)."""
        return self._batches

    def flush(self) -> None:
        """Wait until every batch recorded so far is written and committed."""
        if self._pending:  # the group is not full: commit what it has
            self._pending = 0
            self._writer.submit(0, self._seal)
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            self._trim()
        finally:
            self._writer.close()
            if self._bar is not None:
                self._bar.close()

    def _trim(self) -> None:
        """Each array cut back to what is committed (they grow ahead of it)."""
        if self._arrays is None:
            return
        _barrier(f"statax.record.close:{self.path}", self._processes)
        if self._process == 0:
            for array in self._arrays.values():
                layout.cut(array, self._batches if self._per_batch else self._rows)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _barrier(name: str, processes: int) -> None:
    """Every process waits here for the others (JAX's multi-process runtime)."""
    if processes > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@dataclasses.dataclass
class _Group:
    """Consecutive batches written in one transaction: `committing` holds its commit's future
    once the group closes."""

    transaction: Any
    first: int  # its first batch's number
    committing: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    last: tuple = (0, 0)  # the commit record once it is committed: (batches, rows)

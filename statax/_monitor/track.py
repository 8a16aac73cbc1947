"""`Tracker`: summaries of a training loop, step by step, to any number of sinks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .records import records as make_records

__all__ = ["Tracker"]


class Tracker:
    """Collect summaries every `every` steps and hand them to sinks.

    The jitted training step computes the summaries in-graph (`stx.pull(loss,
    summarize=stx.stats)` for activations, `stx.tree_stats` for weights, gradients and
    optimizer state) and only on the steps where `tracker.due(step)` is true, passed to it as a
    static argument: on the other steps nothing is computed, transferred or done in Python.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> tracker = stx.Tracker(every=2)
        >>> @jax.jit
        ... def summaries(w):
        ...     return {"Weight": stx.tree_stats({"w": w})}
        >>> for step in range(4):
        ...     if tracker.due(step):
        ...         _ = tracker.record(step, summaries(jnp.ones(3) * step))
        >>> [(r["step"], r["name"], r["scalar_stats"]["mean"]) for r in tracker.records]
        [(0, 'w', 0.0), (2, 'w', 2.0)]

    Args:
        every: collect on steps `0, every, 2 * every, ...`.
        sinks: objects with a `write(step, records)` method, e.g. `stx.TensorBoardWriter`.
        keep: keep the records in memory (for `dataframe()`).
    """

    def __init__(self, every: int = 1, sinks: Iterable[Any] = (), keep: bool = True):
        if every < 1:
            raise ValueError(f"Tracker(every=...) must be at least 1, got {every}")
        self.every = int(every)
        self.sinks = list(sinks)
        self.keep = keep
        self.records: list[dict] = []

    def due(self, step: int) -> bool:
        """Whether to collect at `step`."""
        return step % self.every == 0

    def record(
        self, step: int, summaries: Mapping[str, Any], tensor_type: str = "Activation"
    ) -> list[dict]:
        """Bring `summaries` to the host (one transfer) and write them to every sink.

        `summaries` maps names to `stats` dicts, possibly nested; top-level keys
        `"Activation"`, `"Gradient"`, `"Weight"`, `"Optimiser_State"` set the tensor type of
        what is under them, else `tensor_type` applies."""
        new = make_records(step, summaries, tensor_type)
        for sink in self.sinks:
            sink.write(step, new)
        if self.keep:
            self.records.extend(new)
        return new

    def dataframe(self):
        """The kept records as a pandas DataFrame in tandv's schema."""
        from .sinks import to_dataframe

        return to_dataframe(self.records)

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()

"""Where summaries go: TensorBoard event files, pandas DataFrames in tandv's schema, plots."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .optional import require

__all__ = [
    "TensorBoardWriter",
    "plot_exponent_histogram",
    "plot_heatmap",
    "plot_stat",
    "to_dataframe",
]


class TensorBoardWriter:
    """Writes summaries to TensorBoard event files, without TensorFlow.

    Built on the `tensorboard` package's own `EventFileWriter` and protocol buffers, the same
    package whose reader and server display the files, so writer and reader cannot drift apart
    (install with `pip install "statax[tensorboard]"`).

    Scalar statistics go out as scalars tagged `"{tensor_type}/{name}/{stat}"`; the exponent
    histogram of each tensor as a TensorBoard histogram tagged
    `"{tensor_type}/{name}/exponents"` whose x axis is the base-2 exponent: the bucket
    `[n, n + 1)` counts the values with magnitude in `[2**n, 2**(n+1))`, so that TensorBoard's
    linear re-binning keeps the exponent structure. `histogram` logs raw values.

    Args:
        logdir: the directory of the event files (one run).
    """

    def __init__(self, logdir: str):
        require("tensorboard", "tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = str(logdir)
        self._writer = EventFileWriter(self.logdir)

    def _add(self, step: int, values: list) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._writer.add_event(
            Event(wall_time=time.time(), step=int(step), summary=Summary(value=values))
        )

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Log one scalar (a loss, a learning rate)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(step, [Summary.Value(tag=tag, simple_value=float(value))])

    def histogram(self, tag: str, values: Any, step: int, bins: int = 64) -> None:
        """Log the distribution of an array of values."""
        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[np.isfinite(values)]
        if values.size == 0:
            return
        counts, edges = np.histogram(values, bins=bins)
        self._histogram(tag, step, edges[1:], counts, values)

    def _histogram(self, tag, step, limits, counts, values=None, stats=None) -> None:
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        if values is not None:
            low, high, num = values.min(), values.max(), values.size
            total, squares = values.sum(), (values**2).sum()
        else:
            low, high, num, total, squares = stats
        proto = HistogramProto(
            min=float(low),
            max=float(high),
            num=float(num),
            sum=float(total),
            sum_squares=float(squares),
            bucket_limit=[float(x) for x in limits],
            bucket=[float(c) for c in counts],
        )
        self._add(step, [Summary.Value(tag=tag, histo=proto)])

    def write(self, step: int, records: Iterable[dict]) -> None:
        """Log a step's records (as `Tracker` makes them)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for record in records:
            prefix = f"{record['tensor_type']}/{record['name']}"
            for stat, value in record["scalar_stats"].items():
                values.append(Summary.Value(tag=f"{prefix}/{stat}", simple_value=float(value)))
        self._add(step, values)
        for record in records:
            exps = {k: v for k, v in record["exponent_counts"].items() if isinstance(k, int) and v}
            zeros = int(record["scalar_stats"].get("zero_count", 0))
            # The histogram's x axis is the exponent itself: bucket k is [k, k + 1) and holds
            # the values in [2**k, 2**(k+1)). TensorBoard re-bins linearly, which would flatten
            # edges at the powers of two themselves. Exact zeros have no exponent: they are a
            # bucket of their own, two below the smallest exponent, an empty bucket between.
            if zeros:
                exps[min(exps, default=2) - 2] = zeros
            if not exps:
                continue
            keys = range(min(exps), max(exps) + 1)
            counts = [exps.get(k, 0) for k in keys]
            stats = (
                keys[0],
                keys[-1] + 1,
                sum(counts),
                sum(k * c for k, c in zip(keys, counts)),
                sum(k * k * c for k, c in zip(keys, counts)),
            )
            self._histogram(
                f"{record['tensor_type']}/{record['name']}/exponents",
                step,
                [k + 1 for k in keys],
                counts,
                stats=stats,
            )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def to_dataframe(records: Sequence[dict]):
    """Records as a pandas DataFrame in tandv's schema: a column MultiIndex with top levels
    `metadata` (name, type, tensor_type, step, dtype), `scalar_stats` and `exponent_counts`
    (one column per exponent, plus `-inf` and `+inf`), so that tandv's plots accept it."""
    pd = require("pandas", "pandas")
    rows = []
    for record in records:
        row = {("metadata", k): record[k] for k in ("name", "type", "tensor_type", "step", "dtype")}
        row.update({("scalar_stats", k): v for k, v in record["scalar_stats"].items()})
        row.update({("exponent_counts", k): v for k, v in record["exponent_counts"].items()})
        rows.append(row)
    frame = pd.DataFrame(rows)
    exponent_cols = sorted(
        (c for c in frame.columns if c[0] == "exponent_counts"), key=_exponent_order
    )
    frame = frame[[c for c in frame.columns if c[0] != "exponent_counts"] + exponent_cols]
    frame.columns = pd.MultiIndex.from_tuples(frame.columns)
    frame[exponent_cols] = frame[exponent_cols].fillna(0).astype("int64")
    return frame


def _exponent_order(column) -> float:
    """`-inf` (underflow) first, then the exponents in increasing order, then `+inf`."""
    key = column[1]
    return float(key) if isinstance(key, str) else key


def _pyplot():
    require("matplotlib", "plot")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _select(frame, tensor_type):
    return frame[frame[("metadata", "tensor_type")] == tensor_type]


def plot_exponent_histogram(
    frame,
    name: str,
    step: int,
    tensor_type: str = "Activation",
    format: str | None = "float8_e4m3fn",
):
    """Bar chart of one tensor's values per power of two at one step, with the range of
    `format` shaded, and exact zeros (which have no exponent) as a grey bar of their own, left
    of the others. Returns the matplotlib Figure."""
    plt = _pyplot()
    rows = _select(frame, tensor_type)
    row = rows[(rows[("metadata", "name")] == name) & (rows[("metadata", "step")] == step)]
    if row.empty:
        raise KeyError(f"no {tensor_type} {name!r} at step {step} in the frame")
    counts = row["exponent_counts"].iloc[0]
    scalars = row["scalar_stats"].iloc[0]
    zeros = int(scalars.get("zero_count", 0))
    exps = sorted(k for k in counts.index if isinstance(k, int) and counts[k] > 0)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if exps:
        lo, hi = exps[0] - 2, exps[-1] + 2
        xs = list(range(lo, hi + 1))
        ax.bar(xs, [counts.get(x, 0) for x in xs], color="tab:blue")
    if zeros:  # exact zeros have no exponent: a bar of their own, left of the smallest one
        at = (exps[0] if exps else 0) - 4
        ax.bar([at], [zeros], color="tab:gray", label=f"exact zeros ({zeros})")
    if format is not None:
        import ml_dtypes

        info = ml_dtypes.finfo(format)
        ax.axvspan(
            int(info.minexp) - int(info.nmant),
            int(info.maxexp) - 1,
            alpha=0.15,
            color="tab:green",
            label=f"{format} range",
        )
    ax.set(
        xlabel="exponent n (values in [2^n, 2^(n+1)))",
        ylabel="count",
        title=f"{tensor_type} {name}, step {step} (zeros {zeros}, underflow "
        f"{int(counts['-inf'])}, overflow {int(counts['+inf'])})",
    )
    if zeros or format is not None:
        ax.legend()
    fig.tight_layout()
    return fig


def plot_stat(
    frame, stat: str = "rms", tensor_type: str = "Activation", names: Sequence[str] | None = None
):
    """A scalar statistic over steps, one line per tensor. Returns the Figure."""
    plt = _pyplot()
    rows = _select(frame, tensor_type)
    names = list(dict.fromkeys(rows[("metadata", "name")])) if names is None else names
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        r = rows[rows[("metadata", "name")] == name]
        ax.plot(r[("metadata", "step")], r[("scalar_stats", stat)], label=name)
    ax.set(xlabel="step", ylabel=stat, title=f"{tensor_type}: {stat}")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return fig


def plot_heatmap(frame, stat: str = "rms", tensor_type: str = "Activation", log: bool = True):
    """A tensor-by-step heatmap of a scalar statistic (log2 of it by default). Returns the
    Figure."""
    plt = _pyplot()
    pd = require("pandas", "pandas")
    rows = _select(frame, tensor_type)
    flat = pd.DataFrame(
        {
            "name": rows[("metadata", "name")].to_numpy(),
            "step": rows[("metadata", "step")].to_numpy(),
            "value": rows[("scalar_stats", stat)].to_numpy(),
        }
    )
    table = flat.pivot(index="name", columns="step", values="value")
    table = table.reindex(list(dict.fromkeys(flat["name"])))  # the tensors in model order
    values = np.asarray(table.values, dtype=float)
    if log:
        values = np.log2(np.maximum(np.abs(values), np.finfo(float).tiny))
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(table) + 1.5))
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(table)), [str(n) for n in table.index])
    steps = list(table.columns)
    ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set(xlabel="step", title=f"{tensor_type}: {'log2 ' if log else ''}{stat}")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig

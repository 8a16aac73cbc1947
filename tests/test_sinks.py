"""The tracker, TensorBoard, DataFrames and plots, against TensorBoard's own reader and
pandas; and the end-to-end example that uses them all."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import statax as stx

X = jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)


def _train(tmp_path, every=2, steps=6):
    writer = stx.TensorBoardWriter(str(tmp_path / "tb"))
    tracker = stx.Tracker(every=every, sinks=[writer])
    w = jnp.ones((16, 32))

    def summaries(w):
        def loss(w):
            return jnp.mean(stx.save_inter(jnp.tanh(X @ w), name="act") ** 2)

        (value, grad), acts = stx.pull(jax.value_and_grad(loss), summarize=stx.stats)(w)
        return w - 0.1 * grad, {
            "Activation": acts,
            "Weight": stx.tree_stats({"w": w}),
            "Gradient": stx.tree_stats({"w": grad}),
        }

    summaries = jax.jit(summaries)
    for i in range(steps):
        w2, s = summaries(w)
        if tracker.due(i):
            tracker.record(i, s)
        w = w2
    tracker.close()
    return tracker


def test_tracker_and_tensorboard_files_read_back_with_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = _train(tmp_path)
    assert sorted({r["step"] for r in tracker.records}) == [0, 2, 4]
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    tags = accumulator.Tags()
    assert "Activation/act_0/rms" in tags["scalars"]
    assert "Weight/w/mean" in tags["scalars"]
    assert "Gradient/w/exponents" in tags["histograms"]
    rms = accumulator.Scalars("Activation/act_0/rms")
    assert [e.step for e in rms] == [0, 2, 4]
    first = next(r for r in tracker.records if r["name"] == "act_0" and r["step"] == 0)
    np.testing.assert_allclose(rms[0].value, first["scalar_stats"]["rms"], rtol=1e-6)
    histogram = accumulator.Histograms("Activation/act_0/exponents")[0].histogram_value
    exps = {k: v for k, v in first["exponent_counts"].items() if isinstance(k, int) and v}
    # The x axis is the exponent: bucket [n, n + 1) holds the count of exponent n.
    lefts = [histogram.min, *histogram.bucket_limit[:-1]]
    got = {int(left): int(c) for left, c in zip(lefts, histogram.bucket) if c}
    assert got == exps
    assert histogram.min == min(exps) and histogram.max == max(exps) + 1


def test_exact_zeros_are_a_bar_of_their_own_in_tensorboard_and_the_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x = jnp.array([-3.0, -1.0, 0.0, 0.25, 0.5, 1.5, 3.0, -2.0, 6.0])
    relu = jax.nn.relu(x)  # 4 of 9 exactly zero; the rest in [2**-2, 2**3)
    zeros = int(np.sum(np.asarray(relu) == 0))
    assert zeros == 4 and int(stx.stats(relu)["zero_count"]) == zeros
    tracker = stx.Tracker(sinks=[stx.TensorBoardWriter(str(tmp_path))])
    tracker.record(0, {"Activation": {"relu": stx.stats(relu)}})
    tracker.close()
    record = tracker.records[0]
    assert record["scalar_stats"]["zero_count"] == zeros
    exps = {k: v for k, v in record["exponent_counts"].items() if isinstance(k, int) and v}
    assert exps == {-2: 1, -1: 1, 0: 1, 1: 1, 2: 1}  # 0.25, 0.5, 1.5, 3, 6
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    histogram = accumulator.Histograms("Activation/relu/exponents")[0].histogram_value
    lefts = [histogram.min, *histogram.bucket_limit[:-1]]
    got = {int(left): int(c) for left, c in zip(lefts, histogram.bucket) if c}
    assert got == {-4: zeros, **exps}  # two below the smallest exponent, a gap between

    figure = stx.plot_exponent_histogram(tracker.dataframe(), "relu", 0)
    (ax,) = figure.axes
    bars = {(round(p.get_x() + p.get_width() / 2), int(p.get_height())) for p in ax.patches}
    assert (-2 - 4, zeros) in bars  # the grey bar left of the exponents
    assert {(k, v) for k, v in exps.items()} <= bars
    assert "zeros 4" in ax.get_title()
    assert any("exact zeros (4)" in t.get_text() for t in ax.get_legend().get_texts())


def test_dataframe_in_tandv_schema(tmp_path):
    frame = _train(tmp_path).dataframe()
    top = set(frame.columns.get_level_values(0))
    assert top == {"metadata", "scalar_stats", "exponent_counts"}
    assert {"name", "type", "tensor_type", "step", "dtype"} <= set(frame["metadata"].columns)
    assert set(frame[("metadata", "tensor_type")]) == {"Activation", "Weight", "Gradient"}
    exponents = frame["exponent_counts"].columns
    assert "-inf" in exponents and "+inf" in exponents
    assert any(isinstance(c, int) for c in exponents)
    ints = [c for c in exponents if isinstance(c, int)]
    assert list(exponents) == ["-inf", *sorted(ints), "+inf"]
    assert (frame["exponent_counts"].dtypes == "int64").all()
    for dtype in frame[("metadata", "dtype")]:
        ml_dtypes.finfo(dtype)  # parseable, as tandv requires
    assert len(frame["scalar_stats"].columns) >= 1


def test_plots_write_pngs(tmp_path):
    frame = _train(tmp_path).dataframe()
    figures = [
        stx.plot_exponent_histogram(frame, "act_0", 4),
        stx.plot_stat(frame, "rms", "Weight"),
        stx.plot_heatmap(frame, "std", "Activation"),
    ]
    for i, figure in enumerate(figures):
        path = tmp_path / f"{i}.png"
        figure.savefig(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="no Activation 'missing'"):
        stx.plot_exponent_histogram(frame, "missing", 0)


@pytest.mark.parametrize(
    "module, call, extra",
    [
        ("pandas", lambda: stx.to_dataframe([]), "pandas"),
        ("tensorboard", lambda: stx.TensorBoardWriter("/tmp/x"), "tensorboard"),
        ("matplotlib", lambda: stx.plot_stat(None), "plot"),
    ],
)
def test_missing_extra_names_it(monkeypatch, module, call, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=rf'pip install "statax\[{extra}\]"'):
        call()


def test_end_to_end_example_short_run(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_digits", pathlib.Path(__file__).parent.parent / "examples" / "train_digits.py"
    )
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_digits"] = example  # equinox Modules look their module up
    spec.loader.exec_module(example)
    loss, accuracy, frame = example.main(steps=30, every=10, out=tmp_path, progress=False)
    assert np.isfinite(loss) and accuracy > 0.5
    assert set(frame[("metadata", "tensor_type")]) == {
        "Activation",
        "Weight",
        "Gradient",
        "Optimiser_State",
    }
    for name in (
        "exponent_histogram.png",
        "activation_rms.png",
        "gradient_heatmap.png",
        "summaries.pkl",
    ):
        assert (tmp_path / name).exists()
    assert list((tmp_path / "tensorboard").iterdir())

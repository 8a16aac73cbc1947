"""Summaries, sinks and the tracker, against numpy and TensorBoard's own reader."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import statax as stx

VALUES = np.array([0.0, 1.0, -3.0, 1000.0, np.nan, 1e-5, -np.inf, 0.3], np.float32)


def test_stats_against_numpy():
    s = jax.jit(stx.stats)(jnp.asarray(VALUES))
    finite = VALUES[np.isfinite(VALUES)]
    np.testing.assert_allclose(s["mean"], finite.mean(), rtol=1e-6)
    np.testing.assert_allclose(s["std"], finite.std(), rtol=1e-5)
    np.testing.assert_allclose(s["rms"], np.sqrt((finite**2).mean()), rtol=1e-6)
    assert float(s["min"]) == -3.0 and float(s["max"]) == 1000.0 and float(s["max_abs"]) == 1000
    assert float(s["zero_fraction"]) == 1 / 8
    assert int(s["nan_count"]) == 1 and int(s["inf_count"]) == 1
    # Exponent histogram: n with 2**n <= |x| < 2**(n+1), finite and non-zero.
    nonzero = finite[finite != 0]
    expected = {}
    for n in np.floor(np.log2(np.abs(nonzero))).astype(int):
        expected[int(n)] = expected.get(int(n), 0) + 1
    lo = int(s["exponent_min"])
    got = {lo + int(i): int(c) for i, c in enumerate(np.asarray(s["exponent_counts"])) if c}
    assert got == expected
    # float8_e4m3fn: 1000 overflows (max 448), 1e-5 underflows (smallest subnormal 2**-9).
    assert int(s["overflow"]) == 1 and int(s["underflow"]) == 1
    assert np.asarray(s["dtype"]).dtype == np.float32


def test_stats_of_integers_and_bfloat16():
    s = stx.stats(jnp.arange(5))
    assert float(s["mean"]) == 2.0 and np.asarray(s["dtype"]).dtype == np.int32
    s = stx.stats(jnp.array([1.0, 2.0], jnp.bfloat16))
    assert np.asarray(s["dtype"]).dtype == jnp.bfloat16 and float(s["mean"]) == 1.5


@pytest.mark.parametrize(
    "offset, spread, n, dtype",
    [
        (1.0, 1e-4, 65536, np.float32),  # E[x**2] - mean**2 gave 0.0
        (1000.0, 0.01, 4096, np.float32),  # ... and 0.225
        (-3e4, 0.5, 10000, np.float32),
        (1e6, 1.0, 1000, np.float32),
        (0.0, 1e-30, 1000, np.float32),  # tiny values, no offset
        (100.0, 0.5, 4096, jnp.bfloat16),
        (500.0, 0.25, 4096, np.float16),
        (1e8, 1e-3, 1000, np.float64),
    ],
)
def test_stats_mean_and_std_are_stable(offset, spread, n, dtype):
    rng = np.random.default_rng(0)
    x = (offset + spread * rng.standard_normal(n)).astype(dtype)
    x[::97] = np.nan  # non-finite values are left out, and must not disturb the rest
    exact = x.astype(np.float64)
    exact = exact[np.isfinite(exact)]
    with jax.enable_x64(dtype is np.float64):
        s = jax.jit(stx.stats)(jnp.asarray(x))
        np.testing.assert_allclose(s["std"], exact.std(), rtol=2e-3)
        np.testing.assert_allclose(s["mean"], exact.mean(), rtol=1e-6, atol=1e-3 * exact.std())


def model(x):
    h = stx.save_inter(jnp.tanh(x @ jnp.ones((16, 32))), name="hidden")
    return jnp.sum(stx.save_inter(h * 2, name="double"))


X = jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)


def test_summarize_inside_the_compiled_program():
    out, summaries = stx.pull(model, summarize=stx.stats)(X)
    _, inters = stx.pull(model)(X)
    for key in inters:
        np.testing.assert_allclose(summaries[key]["rms"], stx.stats(inters[key])["rms"], rtol=1e-6)
    # Only the summaries leave the device: no output is as large as an activation.
    lowered = jax.jit(stx.pull(model, summarize=stx.stats)).lower(X)
    sizes = [np.prod(o.shape) for o in jax.tree_util.tree_leaves(lowered.out_info)]
    assert max(sizes) < 64 * 32
    # Any function of a pytree will do.
    assert set(stx.pull(model, summarize=jnp.mean)(X)[1]) == {"hidden_0", "double_0"}


def test_describe_names_shapes_stats_and_where():
    _, inters = stx.pull(model)(X)
    text = str(stx.describe(inters))
    lines = text.splitlines()
    assert lines[0].startswith("hidden_0") and "(64, 32)" in lines[0] and "float32" in lines[0]
    assert "nan 0" in lines[0] and "test_monitor.py:" in lines[0]


def test_where_a_value_was_saved_travels_with_its_key():
    line = model.__code__.co_firstlineno + 1  # the save_inter of "hidden"
    where = f"test_monitor.py:{line}"
    _, inters = stx.pull(model)(X)
    summaries = stx.pull(model, summarize=jnp.mean)(X)[1]
    jitted = jax.jit(stx.pull(model))(X)[1]
    for result in (inters, dict(inters), {**inters}, summaries, jitted):
        key = next(k for k in result if k == "hidden_0")
        assert key.location.endswith(where)
        described = str(stx.describe(result)).splitlines()
        assert where in next(row for row in described if row.startswith("hidden_0"))
    assert inters["hidden_0"] is inters[next(iter(inters))]  # keys are plain strings to use


# treescope touches deprecated JAX names on older JAX versions.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_describe_renders_with_treescope_in_a_notebook(monkeypatch):
    description = stx.describe({"x": jnp.ones(2)})
    assert "treescope" in description._repr_html_()  # treescope is in the test extras
    monkeypatch.setitem(sys.modules, "treescope", None)
    assert description._repr_html_().startswith("<pre>x")


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

"""`describe` and where a value was saved (`Key.location`)."""

import sys

import jax
import jax.numpy as jnp
import pytest

import statax as stx


def model(x):
    h = stx.save_inter(jnp.tanh(x @ jnp.ones((16, 32))), name="hidden")
    return jnp.sum(stx.save_inter(h * 2, name="double"))


X = jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)


def test_describe_names_shapes_stats_and_where():
    _, inters = stx.pull(model)(X)
    text = str(stx.describe(inters))
    lines = text.splitlines()
    assert lines[0].startswith("hidden_0") and "(64, 32)" in lines[0] and "float32" in lines[0]
    assert "nan 0" in lines[0] and "test_display.py:" in lines[0]


def test_where_a_value_was_saved_travels_with_its_key():
    line = model.__code__.co_firstlineno + 1  # the save_inter of "hidden"
    where = f"test_display.py:{line}"
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

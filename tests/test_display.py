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


def _table(html_text):
    """The cells of the first HTML table in `html_text`, row by row (header row first)."""
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.inside = [], False

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])
            self.inside = tag in ("td", "th")
            if self.inside:
                self.rows[-1].append("")

        def handle_endtag(self, tag):
            self.inside = False

        def handle_data(self, data):
            if self.inside:
                self.rows[-1][-1] += data

    parser = Cells()
    parser.feed(html_text[: html_text.index("</table>")])
    return parser.rows


def test_describe_is_an_html_table_in_a_notebook_with_the_same_cells_as_its_text(monkeypatch):
    x = jnp.array([1.0, jnp.nan, 3.0])
    _, inters = stx.pull(lambda x: stx.save_inter({"a": x, "n": 3}, name="v"))(x)
    description = stx.describe(inters)
    monkeypatch.setitem(sys.modules, "treescope", None)  # the plain rendering
    page = description._repr_html_()
    rows = _table(page)
    assert rows[0] == [
        "name",
        "shape",
        "dtype",
        "mean",
        "std",
        "min",
        "max",
        "nan",
        "inf",
        "saved at",
    ]
    text = str(description).splitlines()
    assert rows[1][:3] == ["v_0.a", "(3,)", "float32"] and text[0].startswith("v_0.a")
    assert rows[1][3:9] == ["+2", "1", "+1", "+3", "1", "0"]
    assert rows[1][9] == next(iter(inters)).location
    assert '<td class="bad">1</td>' in page  # a NaN count above zero stands out
    assert rows[2][:4] == ["v_0.n", "", "int", "3"]  # a static leaf, as it is
    assert "treescope" not in page


# treescope touches deprecated JAX names on older JAX versions.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_describe_adds_treescopes_rendering_of_the_values_where_installed():
    page = stx.describe({"x": jnp.ones(2)})._repr_html_()  # treescope is in the test extras
    assert _table(page)[1][:3] == ["x", "(2,)", "float32"]
    assert "treescope" in page[page.index("</table>") :]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pulls_dict_displays_as_a_table_in_an_ipython_kernel_and_other_dicts_as_before():
    from IPython.core.interactiveshell import InteractiveShell

    from statax._monitor import display as _display

    shell = InteractiveShell.instance()
    try:
        formatter = shell.display_formatter.formatters["text/html"]
        formatter.for_type(dict, lambda d: "<b>theirs</b>" if "mine" in d else None)
        assert _display.register_notebook_display()
        _, inters = stx.pull(model)(X)
        data, _ = shell.display_formatter.format(inters)
        rows = _table(data["text/html"])
        assert [row[0] for row in rows[1:]] == ["hidden_0", "double_0"]
        assert [row[1] for row in rows[1:]] == ["(64, 32)", "(64, 32)"]
        assert "test_display.py:" in rows[1][-1]
        # Any other dict: the formatter it had before, or none.
        assert shell.display_formatter.format({"mine": 1})[0]["text/html"] == "<b>theirs</b>"
        assert "text/html" not in shell.display_formatter.format({"a": 1})[0]
        assert "text/html" not in shell.display_formatter.format(dict(inters, plain=1))[0]
        shapes = {k: v.shape for k, v in inters.items()}  # (its keys are pull's, not its values)
        assert "text/html" not in shell.display_formatter.format(shapes)[0]
    finally:
        InteractiveShell.clear_instance()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_in_a_notebook_a_mark_typed_into_a_cell_is_located_by_its_cell():
    """As IPython's tracebacks show it ("Cell In[1], line 2"), not by the file IPython gives
    the cell."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        cell = "import statax as stx\ndef f(x):\n    return stx.save_inter(x, name='h')\n"
        result = shell.run_cell(cell, store_history=True)
        assert result.success
        f = shell.user_ns["f"]
        (key,) = stx.pull(f)(jnp.ones(2))[1]
        number = shell.execution_count - 1
        assert key.location == f"Cell In[{number}], line 3"
        assert f"Cell In[{number}], line 3" in str(stx.describe(stx.pull(f)(jnp.ones(2))[1]))
    finally:
        InteractiveShell.clear_instance()


def test_without_a_kernel_nothing_is_registered(monkeypatch):
    from statax._monitor import display as _display

    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert _display.register_notebook_display() is False


def test_a_summarized_result_describes_as_one_row_per_key():
    """`summarize=stx.stats` (as docs/debugging-gradients.md recommends): a row per key, its
    statistics as the columns, the same figures as the raw values' rows."""
    import equinox as eqx

    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 4)
    _, raw = stx.pull(mlp, at=stx.modules("layers[*]"))(x)
    _, table = stx.pull(mlp, at=stx.modules("layers[*]"), summarize=stx.stats)(x)
    summarized, plain = stx.describe(table), stx.describe(raw)
    assert (
        [r.name for r in summarized.rows]
        == list(raw)
        == ["layers[0]_0", "layers[1]_0", "layers[2]_0"]
    )
    for s_row, p_row in zip(summarized.rows, plain.rows, strict=True):
        assert s_row.dtype == "stats" and s_row.stats == p_row.stats
    assert "ArrayImpl" not in str(summarized)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_in_a_notebook_sites_and_lines_name_a_cell_as_marks_do():
    """One naming everywhere: `stx.sites` rows and `stx.lines` keys say "Cell In[n], line k",
    and `stx.lines` takes what they show. The sites table aligns text left, figures right, by
    each cell's own style."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        cell = (
            "import jax.numpy as jnp\nimport statax as stx\n"
            "def f(x):\n    y = jnp.sin(x)\n    return stx.save_inter(y * 2, name='h')\n"
        )
        assert shell.run_cell(cell, store_history=True).success
        f = shell.user_ns["f"]
        number = shell.execution_count - 1
        place = f"Cell In[{number}], line 4"
        found = stx.sites(f)(jnp.ones(3))
        lines = [s.place for s in found.of("line")]
        assert place in lines and not any(".py:" in p for p in lines), lines
        _, got = stx.pull(f, at=stx.lines(place))(jnp.ones(3))
        assert list(got) == [f"{place}_0", "h_0"]
        assert found.bytes(stx.lines(place)) == 24  # (with the mark: what pull returns)
        html = found._repr_html_()
        assert '<td style="text-align:left">line</td>' in html
        assert '<td style="text-align:right">12 B</td>' in html
    finally:
        InteractiveShell.clear_instance()

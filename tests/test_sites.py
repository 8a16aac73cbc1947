"""`stx.sites`: the map of what selections can reach, on every kind of model the selections are
tested on, its shapes and bytes checked against the arrays `pull` returns for each place."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from penzai import pz

import statax as stx

from .test_select import EQX, LINEN, LINEN_PARAMS, XS, NNXModel, ScanNet, X
from .test_select_libraries import IDS, _stateless, gpt2, keras_model, penzai_lm

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")  # (Keras, transformers)


def _arrays(tree) -> list:
    """The array leaves of `tree` (a Python bool beside them is no array)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]


def _arrays_bytes(tree) -> int:
    return sum(x.nbytes for x in _arrays(tree))


def check_against_pull(fn, args, found, per_kind=4):
    """Each mark, scope and module site (the first `per_kind` of each kind), and a primitive:
    its shape, dtype, calls and bytes are those of what `pull` returns for it; and `bytes(at)`
    is the size of all `pull(fn, at=at)` returns."""
    _, marks = stx.pull(fn)(*args)
    for kind in ("mark", "scope", "module", "primitive"):
        for site in found.of(kind)[:per_kind]:
            at = () if kind == "mark" else (site.selection(),)
            _, got = stx.pull(fn, at=list(at))(*args)
            mine = {k: v for k, v in got.items() if kind == "mark" or k not in marks}
            mine = {k: v for k, v in mine.items() if k.rsplit("_", 1)[0] == site.place}
            assert mine, (kind, site.place, list(got))
            first = _arrays(list(mine.values()))[0]
            if kind != "primitive":  # (a primitive's shape is its first equation's)
                assert site.shape == first.shape, site
                assert site.calls == len(mine), site
            assert site.dtype == str(first.dtype), site
            assert site.nbytes == _arrays_bytes(mine), site
            assert found.bytes(*at) == _arrays_bytes(got), site


def test_a_plain_function_scan_scopes_marks_and_lines():
    def f(ws, x):
        def layer(h, w):
            with jax.named_scope("block"):
                h = h + jnp.tanh(h @ w)
            return stx.save_inter(h, name="h"), None

        with jax.named_scope("embed"):
            x = x * 2.0
        return jax.lax.scan(layer, x, ws)[0].sum()

    ws = jnp.stack([jnp.eye(4) * s for s in (0.5, -1.0, 2.0)])
    found = stx.sites(f)(ws, X)
    assert [(s.place, s.shape, s.calls, s.per_call) for s in found.of("scope")] == [
        ("embed", (2, 4), 1, 1),
        ("block", (3, 2, 4), 1, 3),  # per iteration of the scan, stacked
    ]
    assert [(s.place, s.per_call) for s in found.of("mark")] == [("h", 3)]
    tanh = found.find("tanh", "primitive")
    assert (tanh.shape, tanh.calls, tanh.per_call, tanh.nbytes) == ((2, 4), 1, 3, 3 * 2 * 4 * 4)
    layer_line = f.__code__.co_firstlineno + 3  # `h = h + jnp.tanh(h @ w)`
    assert found.find(f"test_sites.py:{layer_line}", "line").per_call == 3
    check_against_pull(f, (ws, X), found)
    assert found.bytes(stx.lines(f"test_sites.py:{layer_line}")) == _arrays_bytes(
        stx.pull(f, at=stx.lines(f"test_sites.py:{layer_line}"))(ws, X)[1]
    )


def test_while_loop_iterations_are_unknown():
    def f(x):
        def body(c):
            with jax.named_scope("step"):
                return c * 1.5

        return jax.lax.while_loop(lambda c: c.sum() < 100.0, body, x)

    found = stx.sites(f)(jnp.ones(3))
    assert found.find("step").per_call is None
    assert "?" in str(found).splitlines()[1]


def test_eqx_modules_under_vmap():
    f = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    found = stx.sites(f)(EQX, X)
    modules = [s.place for s in found.of("module")]  # (in the order called)
    assert modules[:3] == ["blocks[0]", "blocks[0].norm", "blocks[0].lin"]
    assert modules[-1] == "head" and "blocks[2]" in modules
    check_against_pull(f, (EQX, X), found)


@pytest.mark.exhaustive
def test_linen_scopes_and_nn_scan():
    found = stx.sites(LINEN.apply)(LINEN_PARAMS, X)
    assert "Model/Block_0" in [s.place for s in found.of("scope")]
    check_against_pull(LINEN.apply, (LINEN_PARAMS, X), found)
    net = ScanNet()
    params = net.init(jax.random.key(0), X)
    found = stx.sites(net.apply)(params, X)
    dense = found.find("ScanNet/layers/dense", "scope")
    assert (dense.shape, dense.per_call) == ((3, 2, 4), 3)
    check_against_pull(net.apply, (params, X), found)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4)(x))


class _JitMethodNet(nn.Module):
    """Its blocks run inside an `nn.jit` method, which Flax runs under a scope of its own."""

    def setup(self):
        self.block_0 = _Block()
        self.block_1 = _Block()

    def __call__(self, x):
        return self._run(x)

    @nn.jit
    def _run(self, x):
        return self.block_1(self.block_0(x))


def test_linen_modules_inside_an_nn_jit_method_are_listed_as_pull_selects_them():
    """Issue 39, item 10: by module path, not by the method's name stack."""
    net = _JitMethodNet()
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    params = net.init(jax.random.key(0), x)
    found = stx.sites(net.apply)(params, x)
    places = [s.place for s in found.of("scope")]
    assert {"_JitMethodNet/block_0", "_JitMethodNet/block_1"} <= set(places)
    assert not any("._run/" in p for p in places), places
    _, got = stx.pull(net.apply, at=stx.scopes("_JitMethodNet/block_*"))(params, x)
    assert found.bytes(stx.scopes("_JitMethodNet/block_*")) == _arrays_bytes(got) == 64
    check_against_pull(net.apply, (params, x), found, per_kind=6)


class _Flagged(nn.Module):
    """A module that returns a Python bool beside its array, as gemma's blocks return flags."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4)(x)), True


class _FlagNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h, _ = _Flagged(name="flagged")(x)
        _, flag = _Flagged(name="only_flag")(h)
        return h if flag else -h


def test_a_scope_whose_value_holds_a_python_bool_is_listed_as_it_is():
    """Issue 47: a value with a non-array leaf is listed (its first array's shape, or, with no
    array, the leaf's type), as `pull` returns it."""
    net = _FlagNet()
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    params = net.init(jax.random.key(0), x)
    found = stx.sites(net.apply)(params, x)
    flagged = found.find("_FlagNet/flagged", "scope")
    assert (flagged.shape, flagged.dtype) == ((2, 4), "float32")
    _, got = stx.pull(net.apply, at=stx.scopes("_FlagNet/flagged"))(params, x)
    assert got["_FlagNet/flagged_0"][1] is True
    assert flagged.nbytes == got["_FlagNet/flagged_0"][0].nbytes == 32  # (the bool is no array)
    check_against_pull(net.apply, (params, x), found)


def test_nnx_modules():
    model = NNXModel(nnx.Rngs(2))
    f = lambda m, x: m(x)  # noqa: E731
    found = stx.sites(f)(model, X)
    modules = [s.place for s in found.of("module")]
    assert modules[0] == "blocks[0]" and modules[-1] == "head"
    assert {"blocks[1]", "blocks[2].lin"} <= set(modules)
    check_against_pull(f, (model, X), found)


@pytest.mark.parametrize(
    "training", [pytest.param(t, marks=pytest.mark.exhaustive) for t in (True, False)]
)
def test_keras_layers(training):
    model = keras_model()
    call, args = _stateless(model, jnp.ones((3, 4)), training)
    found = stx.sites(call)(*args)
    scopes = [s.place for s in found.of("scope")]
    assert {"dense_a", "bn_a", "drop_a", "block", "block/inner", "head"} <= set(scopes)
    drop = found.find("drop_a")  # (in inference a Dropout makes no equations, and is listed)
    _, got = stx.pull(call, at=drop.selection())(*args)
    assert drop.nbytes == _arrays_bytes(got) == 3 * 8 * 4
    check_against_pull(call, args, found, per_kind=8)


@pytest.mark.parametrize(
    "stack", [pytest.param(s, marks=pytest.mark.exhaustive) for s in (False, True)]
)
def test_penzai_layers(stack):
    model = pz.freeze_params(penzai_lm(stack))
    tokens = pz.nx.wrap(IDS).tag("batch", "seq")
    f = lambda m, t: m(t)  # noqa: E731
    found = stx.sites(f)(model, tokens)
    modules = [s.place for s in found.of("module")]
    block = "body.sublayers[1].stacked_sublayers" if stack else "body.sublayers[1]"
    assert block in modules
    site = found.find(block, "module")
    assert site.per_call == (2 if stack else 1)
    _, got = stx.pull(f, at=site.selection())(model, tokens)
    assert site.nbytes == _arrays_bytes(got) and site.calls == len(got)
    check_against_pull(f, (model, tokens), found, per_kind=2)


@pytest.mark.exhaustive
def test_gpt2_and_the_bytes_of_a_selection_before_it_runs():
    model = gpt2()
    f = lambda params, ids: model(ids, params=params).last_hidden_state  # noqa: E731
    found = stx.sites(f)(model.params, IDS)
    blocks = [s for s in found.of("scope") if s.place.startswith("FlaxGPT2Module/h/")]
    assert {"FlaxGPT2Module/h/0", "FlaxGPT2Module/h/1"} <= {s.place for s in blocks}
    at = stx.scopes("FlaxGPT2Module/h/*")
    assert found.bytes(at) == _arrays_bytes(stx.pull(f, at=at)(model.params, IDS)[1])
    check_against_pull(f, (model.params, IDS), found, per_kind=3)


def test_sites_display_as_a_table_and_html():
    found = stx.sites(LINEN.apply)(LINEN_PARAMS, XS[0])
    text = str(found).splitlines()
    assert text[0].split() == ["kind", "place", "shape", "dtype", "calls", "per", "call", "bytes"]
    assert any(line.split()[:2] == ["scope", "Model/Block_0"] for line in text)
    page = found._repr_html_()
    assert page.count("<tr>") == len(found) + 1 and "Model/Block_0" in page


def test_a_selection_error_lists_the_maps_places_closest_first():
    found = stx.sites(LINEN.apply)(LINEN_PARAMS, X)
    with pytest.raises(stx.SelectionError) as error:
        stx.pull(LINEN.apply, at=stx.scopes("Model/Blok_0"))(LINEN_PARAMS, X)
    listed = str(error.value).split("closest first: ")[1]
    first = listed.split(", ")[0].strip("'")
    assert first == "Model/Block_0" and first in [s.place for s in found.of("scope")]
    with pytest.raises(stx.SelectionError, match="no site 'Model/Blok_0'.*'Model/Block_0'"):
        found.find("Model/Blok_0")

"""Selections through `stx.stateful` (issue 33): `stateful` evaluates the traced program again,
and each equation keeps its traceback, name stack and `ctx` there, as under `pull` alone. Each
case is compared with the same function marked by hand."""

import inspect
import re

import jax
import jax.numpy as jnp
import pytest

import statax as stx
from statax.testing import assert_tree_allclose

X = jnp.linspace(-1.0, 1.0, 6)


def model(x, marked=False):
    with jax.named_scope("enc"):
        h = jnp.sin(x) * 2.0  # the line stx.lines selects below
    if marked:  # what stx.scopes("enc") and the line select: the value leaving the scope
        h = stx.save_inter(h, name="enc")
    count = stx.get_state("count", lambda: jnp.zeros(()))
    stx.set_state(count + h.sum(), "count")
    return jnp.tanh(h) + 1.0


LINE = inspect.getsourcelines(model)[1] + 2
STATE = {"count": jnp.asarray(0.5)}


def by_hand(x):
    return model(x, marked=True)


def test_pull_of_stateful_selects_a_scope_as_the_hand_mark_does():
    got = stx.pull(stx.stateful(model), at=stx.scopes("enc"))(X, state=STATE)
    want = stx.pull(stx.stateful(by_hand))(X, state=STATE)
    assert list(got[1]) == list(want[1]) == ["enc_0"]
    assert_tree_allclose(got, want)
    jitted = jax.jit(stx.pull(stx.stateful(model), at=stx.scopes("enc")))(X, state=STATE)
    assert_tree_allclose(jitted, want, rtol=1e-6)


def test_pull_of_stateful_selects_a_line():
    sel = stx.lines(f"test_select_stateful.py:{LINE}")
    got = stx.pull(stx.stateful(model), at=sel)(X, state=STATE)
    (key,) = got[1]
    assert key == f"test_select_stateful.py:{LINE}_0"
    assert_tree_allclose(got[1][key], stx.pull(stx.stateful(by_hand))(X, state=STATE)[1]["enc_0"])


def test_a_missing_line_through_stateful_lists_the_users_lines_not_statax():
    with pytest.raises(stx.SelectionError) as info:
        stx.pull(stx.stateful(model), at=stx.lines("model.py:5"))(X, state=STATE)
    listed = str(info.value)
    assert f"test_select_stateful.py:{LINE}" in listed
    assert not re.search(r"'_\w+\.py:\d+'", listed), listed  # no statax module listed


@pytest.mark.parametrize("patch", ["value", "hook"])
def test_plant_of_stateful_at_a_scope_as_the_hand_mark(patch):
    new = {"value": jnp.full_like(X, 0.25), "hook": HOOK}[patch]
    got = stx.plant(stx.stateful(model), at=stx.scopes("enc"))({"enc_0": new}, X, state=STATE)
    want = stx.plant(stx.stateful(by_hand))({"enc_0": new}, X, state=STATE)
    assert_tree_allclose(got, want)
    out, state = got
    h = new if patch == "value" else HOOK(jnp.sin(X) * 2.0)
    assert_tree_allclose(out, jnp.tanh(h) + 1.0, rtol=1e-6)
    assert_tree_allclose(state["count"], STATE["count"] + h.sum(), rtol=1e-6)


def HOOK(h):
    return -h


def test_stateful_of_pull_with_a_selection():
    got = stx.stateful(stx.pull(model, at=stx.scopes("enc")))(X, state=STATE)
    want = stx.stateful(stx.pull(by_hand))(X, state=STATE)
    assert_tree_allclose(got, want)


# ---- only= with a predicate that selects nothing (oryx's `reap` with a blocklist) ---------------


def marks(x):
    h = stx.save_inter(jnp.sin(x), name="h")
    return stx.save_inter(h * 2.0, name="out")


def test_a_predicate_that_lets_nothing_through_returns_nothing():
    # Ported from oryx's harvest tests: reap with every tag blocklisted returns {}.
    out, inters = stx.pull(marks, only=lambda meta: meta.name not in {"h", "out"})(X)
    assert inters == {}
    assert_tree_allclose(out, jnp.sin(X) * 2.0)
    out, inters = jax.jit(stx.pull(marks, only=lambda meta: False))(X)
    assert inters == {}
    assert_tree_allclose(out, jnp.sin(X) * 2.0)


def test_a_blocklist_keeps_the_others():
    # Ported from oryx: a blocklist drops only what it names.
    _, inters = stx.pull(marks, only=lambda meta: meta.name != "h")(X)
    assert list(inters) == ["out_0"]


def test_a_name_or_pattern_that_selects_nothing_is_still_an_error():
    with pytest.raises(stx.SelectionError, match="'hh' selects no mark"):
        stx.pull(marks, only="hh")(X)
    with pytest.raises(stx.SelectionError, match="selects no mark"):
        stx.pull(marks, only=re.compile("z.*"))(X)

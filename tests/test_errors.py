import re

import jax
import jax.numpy as jnp
import pytest

import statax as stx
from statax.testing import assert_tree_allclose

from .helpers import python_call, python_call_p, twice_call, twice_call_p


def mark_inside(x):
    return stx.save_inter(x * 2, name="hidden")


LINE = mark_inside.__code__.co_firstlineno + 1


def test_unhandled_primitive_with_a_mark_names_it_the_mark_and_the_fix():
    def f(x):
        return twice_call(mark_inside, x)

    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        with pytest.raises(stx.UnhandledPrimitiveError) as info:
            g(1.0)
        message = str(info.value)
        assert "`twice_call`" in message
        assert re.search(rf"'hidden' at .*test_errors.py:{LINE}", message)
        assert "statax.extend.register_handler(twice_call_p, handler)" in message
        assert info.value.primitive is twice_call_p


def test_unhandled_primitive_error_names_an_importable_primitive():
    # JAX's custom_vmap primitive is `custom_vmap_call` in a jaxpr, but no public name holds it:
    # the error says where it can be imported from, rather than inventing `custom_vmap_call_p`.
    @jax.custom_batching.custom_vmap
    def f(x):
        return stx.save_inter(x * 2, name="h")

    f.def_vmap(lambda size, batched, x: (x * 2, batched[0]))
    with pytest.raises(stx.UnhandledPrimitiveError) as info:
        stx.pull(f)(jnp.ones(3))
    message = str(info.value)
    assert "custom_vmap_call_p" not in message
    match = re.search(
        r"register_handler\((\w+), handler\)` after `from ([\w.]+) import (\w+)`", message
    )
    assert match and match[1] == match[3]
    module = __import__(match[2], fromlist=[match[3]])
    assert getattr(module, match[3]) is info.value.primitive


def test_unhandled_primitive_without_marks_is_left_alone():
    def f(x):
        return stx.save_inter(twice_call(lambda y: y * 3, x), name="after")

    assert_tree_allclose(stx.pull(f)(1.0), (9.0, {"after_0": 9.0}))


def test_a_mark_in_python_code_that_a_primitive_runs_is_an_error_not_dropped():
    # The mark would run when the equation is evaluated or lowered, where no pull sees it:
    # pull finds it by tracing the primitive's impl, and refuses rather than return {}.
    def f(x):
        return python_call(mark_inside, x)

    for g in (stx.pull(f), stx.pull(jax.jit(f)), jax.jit(stx.pull(f))):
        with pytest.raises(stx.UnhandledPrimitiveError) as info:
            g(jnp.ones(2))
        message = str(info.value)
        assert "`python_call`" in message and "rules run Python code" in message
        assert re.search(rf"'hidden' at .*test_errors.py:{LINE}", message)
        assert info.value.primitive is python_call_p
    # Without a mark in it, the same primitive is left alone.
    g = lambda x: stx.save_inter(python_call(jnp.sin, x), name="after")  # noqa: E731
    assert_tree_allclose(stx.pull(g)(1.0), (jnp.sin(1.0), {"after_0": jnp.sin(1.0)}))


def test_handler_returning_wrong_number_of_outputs_is_reported():
    def bad_handler(eqn):
        return eqn, (stx.extend.find_saves(eqn.params["jaxpr"])[0],)

    stx.extend.register_handler(twice_call_p, bad_handler)
    try:
        with pytest.raises(stx.HandlerError, match=r"`twice_call` returned an equation with 1"):
            stx.pull(lambda x: twice_call(mark_inside, x))(1.0)
    finally:
        stx.extend.unregister_handler(twice_call_p)


def test_register_handler_needs_a_primitive():
    with pytest.raises(TypeError, match="needs a jax.extend.core.Primitive"):
        stx.extend.register_handler("cond", lambda eqn: (eqn, ()))


def test_unhandled_primitive_error_is_raised_at_trace_time_not_run_time():
    with pytest.raises(stx.UnhandledPrimitiveError):
        jax.make_jaxpr(stx.pull(lambda x: twice_call(mark_inside, x)))(jnp.ones(2))


def test_a_users_mistake_shows_the_users_frames_and_none_of_statax_or_jax():
    import traceback

    from statax._core.tracebacks import PACKAGE

    def f(x):
        return stx.save_inter(x * 2, name=3)

    line = f.__code__.co_firstlineno + 1
    calls = {
        "pull": lambda: stx.pull(f)(jnp.ones(3)),
        "pull(jit)": lambda: stx.pull(jax.jit(f))(jnp.ones(3)),
        "plant": lambda: stx.plant(f)({}, jnp.ones(3)),
        "grad_inters": lambda: stx.grad_inters(lambda x: jnp.sum(f(x)))(jnp.ones(3)),
        "stateful": lambda: stx.stateful(f)(jnp.ones(3)),
    }
    for how, call in calls.items():
        with pytest.raises(TypeError, match="needs a string name") as info:
            call()
        frames = traceback.extract_tb(info.value.__traceback__)
        files = [frame.filename for frame in frames]
        assert not [f for f in files if f.startswith((PACKAGE, jax.__path__[0]))], how
        assert (frames[-1].filename, frames[-1].lineno) == (__file__, line), how
        assert len(frames) <= 6, (how, files)


def test_errors_print_as_the_public_names_users_catch():
    import traceback

    for name in (
        "SelectionError",
        "StateError",
        "PlantError",
        "ReduceMismatchError",
        "KeyCollisionError",
        "HandlerError",
        "UnhandledPrimitiveError",
        "BranchMismatchError",
        "StatefulWarning",
    ):
        assert getattr(stx, name).__module__ == "statax", name
    try:
        stx.pull(lambda x: x, only=["nothing"])(jnp.ones(2))
    except stx.SelectionError as error:
        shown = "".join(traceback.format_exception_only(error))
        assert shown.startswith("statax.SelectionError: "), shown
    else:
        raise AssertionError("only= naming no mark must raise")


def test_a_string_at_suggests_only_scopes_and_modules():
    with pytest.raises(TypeError, match=r"only='hidden'.*stx\.scopes\('hidden'\).*stx\.modules"):
        stx.pull(lambda x: x, at="hidden")(jnp.ones(2))


def test_only_a_cotangent_key_says_only_selects_a_mark_with_its_cotangent():
    def f(x):
        return jnp.sum(stx.save_inter(jnp.sin(x), name="h"))

    with pytest.raises(stx.SelectionError, match=r"only= takes names.*only='h' with cotangents"):
        stx.pull(jax.grad(f), only="h_0.grad", cotangents=True)(jnp.ones(2))

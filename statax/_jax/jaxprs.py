"""Making, reading and tracing jaxprs and equations, whatever the JAX version (0.8 -- 0.12):
the walk over nested jaxprs, a new equation, a trace at exact input types, debug info.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from jax.extend import linear_util as linear_util_api  # isort: skip


from jax.interpreters import partial_eval as pe_api  # isort: skip

from jax._src import api_util  # isort: skip


from jax._src import core  # isort: skip


from jax._src import linear_util as lu  # isort: skip


from jax._src.lax import lax as lax_internal  # isort: skip


__all__ = [
    "bind",
    "constants_as_inputs",
    "dce",
    "debug_info",
    "extend_debug_info",
    "jaxprs_in_params",
    "new_equation",
    "trace",
    "trace_open",
    "wraps_jaxpr",
    "zeros",
]

# Public in `jax.extend.core` since JAX 0.9; `jax._src.core` before.
jaxprs_in_params = getattr(jex, "jaxprs_in_params", None)
if jaxprs_in_params is None:
    from jax._src.core import jaxprs_in_params  # noqa: F401


def wraps_jaxpr(jaxpr: Any) -> bool:
    """Whether `jaxpr` is a `ClosedJaxpr` wrapping a separate open `Jaxpr` (JAX 0.8 -- 0.10).

    Since JAX 0.11 `ClosedJaxpr` is `Jaxpr` itself, with its consts attached, and `.jaxpr`
    returns the same object: there is nothing to unwrap, and recursing into `.jaxpr` would not
    end."""
    return isinstance(jaxpr, jex.ClosedJaxpr) and jaxpr.jaxpr is not jaxpr


def trace(
    fn: Callable, in_avals: Sequence[Any], name: str = "statax", source: Callable | None = None
) -> jex.ClosedJaxpr:
    """Trace `fn(*args) -> list of arrays` at exactly `in_avals` (shardings, manual axes and
    weak types included, which `jax.make_jaxpr` of `ShapeDtypeStruct`s would not keep), without
    `jax.make_jaxpr`'s work around the trace (a `jit` object, argument names from a signature).
    With `source`, JAX's messages name that function (`"f at file.py:3"`) rather than `name`."""
    wrapped = linear_util_api.wrap_init(
        lambda *args: list(fn(*args)), debug_info=debug_info(name, source)
    )
    jaxpr, _, consts = pe_api.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jex.ClosedJaxpr(jaxpr, consts)


def trace_open(
    fn: Callable, in_avals: Sequence[Any], name: str = "statax", source: Callable | None = None
) -> tuple[jex.Jaxpr, list]:
    """`trace`, as the open jaxpr (its constants as `constvars`) and its constants."""
    wrapped = linear_util_api.wrap_init(
        lambda *args: list(fn(*args)), debug_info=debug_info(name, source)
    )
    jaxpr, _, consts = pe_api.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, consts


def constants_as_inputs(jaxpr: jex.Jaxpr) -> jex.ClosedJaxpr:
    """An open jaxpr as a closed one with no constants, which takes its constants as its first
    inputs (what `pe.convert_constvars_jaxpr` does, deprecated in JAX 0.8; `Jaxpr.replace`
    and `DebugInfo._replace`, JAX 0.8 -- 0.12)."""
    info = jaxpr.debug_info
    if info is not None and isinstance(info.arg_names, tuple):
        info = info._replace(arg_names=("",) * len(jaxpr.constvars) + info.arg_names)
    opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars], debug_info=info)
    return jex.ClosedJaxpr(opened, ())


def debug_info(name: str, source: Callable | None = None) -> Any:
    """A jaxpr's debug info: made by `name`, from `source` where given."""
    where = name if source is None else api_util.fun_sourceinfo(source)
    return lu.DebugInfo(name, where, None, None)


def new_equation(
    invars: Sequence[Any], outvars: Sequence[Any], prim: jex.Primitive, params: dict, effects
) -> jex.JaxprEqn:
    """A new equation (`jax.extend.core.new_jaxpr_eqn` in JAX 0.8 -- 0.11, deprecated there in
    0.12; `jax._src.core`'s in all)."""
    return core.new_jaxpr_eqn(list(invars), list(outvars), prim, params, effects)


def bind(prim: jex.Primitive, args: Sequence[Any], params: dict) -> Any:
    """Bind `prim` with an equation's `params`, as `eval_jaxpr` does (custom derivatives keep
    functions in their params that `bind` takes as leading arguments)."""
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX < 0.9: (subfuns, params)
        subfuns, bind_params = bind_params
        return prim.bind(*subfuns, *args, **bind_params)
    return prim.bind(*args, **bind_params)


def zeros(aval: Any) -> jax.Array:
    """Zeros of exactly `aval`'s type: weak type, sharding and varying manual axes included
    (`lax.zeros_like_shaped_array`, JAX 0.8 -- 0.12)."""
    return lax_internal.zeros_like_shaped_array(aval)


def dce(
    jaxpr: jex.Jaxpr, used_outputs: Sequence[bool], keep: bool | Sequence[bool] = False
) -> tuple[jex.Jaxpr, list[bool]]:
    """`jaxpr` with only `used_outputs`, and which inputs it still takes: those they use and
    those `keep` keeps. `pe_api.dce_jaxpr`, unchanged in JAX 0.8 -- 0.12."""
    return pe_api.dce_jaxpr(
        jaxpr, list(used_outputs), keep if isinstance(keep, bool) else list(keep)
    )


def extend_debug_info(
    debug_info: Any, names: Sequence[str], keep: int | None = None, arg_names: Sequence[str] = ()
) -> Any:
    """The debug info of a jaxpr whose outputs gained `names` at the end (after its first
    `keep` outputs, where given: the others are replaced), and its inputs `arg_names`."""
    if debug_info is None:
        return None
    if arg_names and isinstance(debug_info.arg_names, tuple):
        debug_info = debug_info._replace(arg_names=debug_info.arg_names + tuple(arg_names))
    paths = debug_info.result_paths
    if callable(paths):
        paths = tuple(paths())
    if not isinstance(paths, tuple):
        return debug_info._replace(result_paths=None)
    return debug_info._replace(result_paths=paths[:keep] + tuple(names))

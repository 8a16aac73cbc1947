"""A small custom higher-order primitive, built with public JAX only, for handler tests."""

import jax
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir

twice_call_p = Primitive("twice_call")
twice_call_p.multiple_results = True


def _impl(*args, jaxpr):
    once = jaxpr_as_fun(jaxpr)(*args)
    return jaxpr_as_fun(jaxpr)(*once)


twice_call_p.def_impl(_impl)
twice_call_p.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)
mlir.register_lowering(twice_call_p, mlir.lower_fun(_impl, multiple_results=True))


def twice_call(f, x):
    """`f(f(x))`, staged as one `twice_call` equation holding `f`'s jaxpr."""
    (out,) = twice_call_p.bind(x, jaxpr=jax.make_jaxpr(lambda y: [f(y)])(x))
    return out


# A primitive that keeps a Python function in its params and runs it in its impl and lowering
# (as equinox's filter primitives do): no jaxpr shows what the function does.
python_call_p = Primitive("python_call")
python_call_p.multiple_results = True


def _python_impl(x, *, fn):
    return [fn(x)]


python_call_p.def_impl(_python_impl)
python_call_p.def_abstract_eval(lambda aval, *, fn: [aval])
mlir.register_lowering(python_call_p, mlir.lower_fun(_python_impl, multiple_results=True))


def python_call(fn, x):
    """`fn(x)`, staged as one `python_call` equation whose params hold `fn` itself."""
    (out,) = python_call_p.bind(x, fn=fn)
    return out


# ---- counting XLA compilations (jax.monitoring's event for each backend compile) -------------

_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _duration, **_: (
        _COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


def compilations() -> int:
    """How many programs XLA has compiled in this process so far."""
    return len(_COMPILES)

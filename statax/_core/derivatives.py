"""Running a pulled jaxpr under an equation's own derivative rules (`pulled_with_rule`): for
custom derivatives, linear solves, hijax and equinox primitives, whose rules are theirs while
their marks leave them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from .._jax import jaxprs as _jaxprs
from .._jax import primitives as _primitives
from .exposers import mark, take
from .meta import StateMeta
from .rewrite import pull_jaxpr

__all__ = ["only_in", "pulled_with_rule", "zero_tangent"]


def pulled_with_rule(
    original: Callable,
    primal: jex.ClosedJaxpr,
    args: Sequence,
    *,
    rule: str = "jvp",
    extra: tuple[jex.ClosedJaxpr, tuple[StateMeta, ...]] | None = None,
) -> list:
    """In an exposer, for an equation with rules of its own (custom derivatives, linear solves,
    hijax and equinox primitives): its outputs, computed once by its pulled `primal`, its
    intermediates marked outside.

    `original(*args)` binds the equation as it was (its marks inert); `primal` is a jaxpr that
    computes the same outputs from the same `args` and holds the marks. The pulled `primal`
    runs as a `jax.custom_jvp` (`rule="jvp"`) or `jax.custom_vjp` (`rule="vjp"`, for an
    equation that only has a VJP) whose rule is `original`'s own, so derivatives (and their
    transposes) are the equation's; the intermediates get zero tangents. Only when
    differentiated does the pulled primal also run, behind `stop_gradient`, beside the original
    rule. A loop inside runs once, as unpulled.

    Where a value is planted inside (it takes values in), the function is no longer the one its
    rule describes: it runs as written and is differentiated as written.

    `extra`, `(jaxpr, metas)`: intermediates of the rule itself (see
    `handlers.custom_derivatives`), which `jaxpr` computes from the last of `args`: they are
    computed beside the rule where it runs (the result is differentiated), and are zeros where
    it does not, as a `cond` branch that did not run.
    """
    pulled, metas, ins = pull_jaxpr(primal)
    n = len(primal.out_avals)
    run_pulled = jex.jaxpr_as_fun(pulled)
    run_rule: Callable = lambda *args: ()  # noqa: E731
    if extra is not None:
        closed, more = extra
        metas = (*metas, *more)
        run_rule = _on_last(jex.jaxpr_as_fun(closed), len(closed.in_avals))
    if ins:
        flat = [
            *run_pulled(*args, *take(ins, pulled.in_avals[len(args) :])),
            *_not_run(run_rule, args),
        ]
    else:
        wrap = _with_jvp if rule == "jvp" else _with_vjp
        flat = wrap(original, run_pulled, run_rule, n)(*args)
    mark(flat[n:], metas)
    return list(flat[:n])


def _on_last(fn: Callable, k: int) -> Callable:
    def on_last(*args):
        return fn(*args[len(args) - k :])

    return on_last


def _not_run(run_rule: Callable, args: Sequence) -> list:
    """Zeros in place of what `run_rule` computes, batched under `vmap` as it would be (as the
    rule's own outputs are, which JAX requires of a custom function's primal); the compiler
    removes the computation."""
    return [jnp.where(True, _jaxprs.zeros(jax.typeof(v)), v) for v in run_rule(*args)]


def _with_jvp(original, run_pulled, run_rule, n):
    @jax.custom_jvp
    def run(*args):
        return (*run_pulled(*args), *_not_run(run_rule, args))

    def run_jvp(primals, tangents):
        # Differentiate `original` only where a tangent is not a symbolic zero: the other
        # inputs (a solver's state, say) are constants to it, as they were to the equation.
        live = [i for i, t in enumerate(tangents) if not isinstance(t, _primitives.SymbolicZero)]
        outs, out_tangents = jax.jvp(
            only_in(original, primals, live),
            [primals[i] for i in live],
            [tangents[i] for i in live],
        )
        fixed = list(map(jax.lax.stop_gradient, primals))
        saved = (*run_pulled(*fixed)[n:], *run_rule(*fixed))
        return (*outs, *saved), (*out_tangents, *map(zero_tangent, saved))

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run


def _with_vjp(original, run_pulled, run_rule, n):
    @jax.custom_vjp
    def run(*args):
        return (*run_pulled(*args), *_not_run(run_rule, args))

    live: list[int] = []  # the perturbed arguments, as `fwd` found them for `bwd`
    arity: list[int] = []

    def fwd(*args):
        # Differentiate `original` only in the perturbed arguments: the others are constants
        # to it, as they were to the equation (equinox's `filter_custom_vjp` checks this).
        values = [a.value for a in args]
        live[:] = [i for i, a in enumerate(args) if a.perturbed]
        arity[:] = [len(args)]
        outs, vjp = jax.vjp(only_in(original, values, live), *[values[i] for i in live])
        fixed = list(map(jax.lax.stop_gradient, values))
        saved = (*run_pulled(*fixed)[n:], *run_rule(*fixed))
        return (*outs, *saved), vjp

    def bwd(vjp, cts):
        cts = [_instantiate(ct) for ct in cts[:n]]
        grads = dict(zip(live, vjp(tuple(cts)), strict=True))
        return tuple(grads.get(i) for i in range(arity[0]))

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def _instantiate(ct):
    if not isinstance(ct, _primitives.SymbolicZero):
        return ct
    return zero_tangent(jax.ShapeDtypeStruct(ct.shape, ct.aval.dtype))


def only_in(fn: Callable, args: Sequence, live: Sequence[int]) -> Callable:
    """`fn` as a function of `args[i]` for `i` in `live` only, the others fixed: what a custom
    rule differentiates, so that unperturbed inputs stay constants, as they were to `fn`."""

    def of_live(*xs):
        full = list(args)
        for i, x in zip(live, xs, strict=True):
            full[i] = x
        return fn(*full)

    return of_live


def zero_tangent(x):
    """The zero tangent of a value: zeros of its dtype, or `float0` zeros for an integer."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)

"""Interventions: `plant` puts values into marked places; `grad_inters` differentiates with
respect to them. Both are `pull`'s trace and rewrite with a plant in force (see `_plant`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core.flat_calls import split_callable
from .._core.tracebacks import boundary
from .._select.plan import Plan
from . import nnx as _nnx
from .planting import Add, Planting
from .pull import Pulled, call_pulled, check_steps, pull

__all__ = ["grad_inters", "plant", "planted_pull"]


class _Planted(eqx.Module):
    fn: Callable
    at: tuple = eqx.field(static=True, default=())
    steps: int | None = eqx.field(static=True, default=None)

    @boundary
    def __call__(self, values: Mapping[str, Any], *args, **kwargs):
        if not isinstance(values, Mapping):
            raise TypeError(
                "stx.plant(fn)(values, *args) takes a dict of values first, keyed as pull "
                f"returns them; got {type(values).__name__}."
            )
        # A reduced entry, as `pull` returned it (its `Key` knows), sums up many values: it is
        # not one value of the program, and giving it back plants nothing.
        values = {k: v for k, v in values.items() if getattr(k, "reduce", None) is None}
        planting = Planting.of(values)
        if planting.cotangents:
            Plan(self.at).refuse_cotangents("stx.plant")
        pulled = Pulled(
            self.fn,
            only=None,
            enabled=True,
            summarize=None,
            planting=planting,
            at=self.at,
            cotangents=planting.cotangents,
            steps=self.steps,
        )
        return call_pulled(pulled, args, kwargs, values)[0]


def plant(fn: Callable, *, at: Any = None, steps: int | None = None) -> Callable:
    """Transform `fn` to run with values planted at its marks.

    `plant(fn)(values, *args, **kwargs)` returns `fn(*args, **kwargs)`, computed with each
    marked value that `values` names replaced. Everything downstream uses the replacement;
    work that only fed a replaced value is dropped from the compiled program.

    `values` maps keys, as `pull` returns them (`"h_2"`: the third occurrence of `h`; `"h"`:
    every occurrence), to one of:

    * an array (or a pytree of the marked value's structure): the marked value becomes it.
      Arrays are traced, so new values do not retrace. For a key stacked by a `scan`, it has
      the stacked shape, one row per iteration; in a `while_loop`, one iteration's shape, used
      in every iteration (with `steps=N`: `N` rows, row `i` planted in iteration `i`); under
      an inner `vmap`, the batch axis first (an unbatched value is broadcast);
    * a function of the old value (a hook, compared by identity: define it once), applied in
      every iteration and every example where it is planted, and run nowhere else:
      `lambda v: v * 0` ablates, `lambda v: v + d` steers. A hook with a parameter named
      `step` is also given the iteration of the innermost loop around the mark (a `scan`'s
      or a `while_loop`'s; 0 outside any loop): `lambda v, step: jnp.where(step >= 5, v + d,
      v)` steers from the sixth generated token on.

    With `at=`, the places a selection makes are marks too, keyed as `pull(fn, at=...)` keys
    them (see "Looking inside a model you did not write").

    What `pull` returned can be given back whole: `plant(fn)(pull(fn)(*args)[1], *args)`
    equals `fn(*args)`, and where a `while_loop` holds marks,
    `plant(fn, steps=N)(pull(fn, steps=N)(*args)[1], *args)` does (without `steps=`, a
    `while_loop` gives its last iteration, which `plant` would put into every iteration). A
    marked Python number is planted as a weakly typed array (as `jax.jit` takes a Python
    number argument); the other leaves that are not arrays (a
    string, `None`) must be given as `pull` returned them. The reduced entries `pull` returned
    (their keys have `key.reduce`) sum up many values, not one value of the program: given
    back, they plant nothing (a name saved with `reduce=` given as a plain string is an error).

    In `cond`/`switch`, a replacement applies in the branch that runs. Under an inner `grad`,
    the primal is replaced and derivatives flow through the replacement. Inside a
    custom-derivative function, a planted value changes the function, so it is differentiated
    as written rather than by its custom rule.

    Args:
        fn: any callable, as for `pull`.
        at: places nobody marked, as for `pull`.
        steps: as for `pull`: a `while_loop`'s marks take `steps` rows, one per iteration.

    Returns:
        A callable `(values, *args, **kwargs) -> out`, `values` as above.

    Raises:
        PlantError: a key that names no mark (the error lists the marks, with their sites), a
            replacement or hook result of the wrong shape, dtype or structure, a leaf that is
            not an array given another value than the mark's, or a name saved with `reduce=`.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     h = stx.save_inter(x * 2, name="h")
        ...     return h + 1
        >>> stx.plant(f)({"h_0": jnp.float32(10.0)}, jnp.float32(1.0))
        Array(11., dtype=float32)
        >>> stx.plant(f)({"h": lambda v: v * 0}, jnp.float32(1.0))
        Array(1., dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"stx.plant needs a callable, got {fn!r} of type {type(fn).__name__}.")
    return _Planted(fn, Plan.of(at).at, check_steps(steps, "stx.plant"))


def planted_pull(fn: Callable, at: Any, values: Mapping[str, Any], args: tuple, ran=False):
    """`(out, intermediates)`: one run of `fn(*args)` with `values` planted (as `plant` takes
    them), and what `pull(fn, at=at, ran=ran)` returns of it, the planted values as planted:
    a perturbation's value and the metric's gradient with respect to it from one forward
    pass (attribution patching)."""
    pulled = Pulled(
        fn,
        only=None,
        enabled=True,
        summarize=None,
        ran=ran,
        planting=Planting.of(values),
        at=Plan.of(at).at,
    )
    return call_pulled(pulled, args, {}, values)


def _differentiable(value) -> bool:
    """Whether every leaf of a marked value (as `eval_shape` of `pull` gives it) is an inexact
    array or a Python float or complex (planted as a weakly typed array)."""
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(
        type(x) in (float, complex)
        or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))
        for x in leaves
    )


def _zero(leaf):
    if type(leaf) in (float, complex):
        return jnp.zeros_like(jnp.asarray(leaf))  # weakly typed, as the planted mark
    return jnp.zeros(leaf.shape, leaf.dtype)


def grad_inters(
    fn: Callable,
    argnums: int | Sequence[int] | None = None,
    *,
    has_aux: bool = False,
    only: Any = None,
    at: Any = None,
) -> Callable:
    """Transform a scalar-valued `fn` to return its value and its gradient with respect to
    every marked intermediate.

    The gradient with respect to an intermediate is that with respect to a perturbation added
    where it is marked (zero, so the value is `fn`'s own): `d fn / d h_0` for key `"h_0"`.

    Args:
        fn: a function returning a scalar (or `(scalar, aux)` with `has_aux`).
        argnums: also return the ordinary gradients with respect to these positional
            arguments, as `jax.grad(fn, argnums)` does.
        has_aux: `fn` returns `(scalar, aux)`; the value is then that pair.
        only: differentiate with respect to these marks only (as `pull`'s `only=`).
        at: also differentiate with respect to the places these selections make (as `pull`'s
            `at=`).

    Returns:
        A callable returning `(value, inter_grads)`, or `(value, inter_grads, grads)` with
        `argnums`. `inter_grads` has `pull`'s keys and shapes (stacked in a `scan`, per
        example under a `vmap`) for every unreduced intermediate of a floating dtype.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> def loss(w, x):
        ...     h = stx.save_inter(w * x, name="h")
        ...     return jnp.sum(h**2)
        >>> stx.grad_inters(loss)(jnp.float32(3.0), jnp.arange(3.0))
        (Array(45., dtype=float32), {'h_0': Array([ 0.,  6., 12.], dtype=float32)})
    """

    chosen = Plan.of(at).at

    @boundary
    def run(*args, **kwargs):
        is_node = _nnx.node_test()
        if is_node is not None and any(
            map(is_node, jax.tree_util.tree_leaves((fn, args, kwargs), is_leaf=is_node))
        ):
            return _of_graph_nodes(fn, chosen, argnums, has_aux, only, args, kwargs)
        return _grad_inters(fn, chosen, argnums, has_aux, only, args, kwargs)

    return run


def _grad_inters(fn, chosen, argnums, has_aux, only, args, kwargs):
    shapes = eqx.filter_eval_shape(pull(fn, only=only, at=chosen), *args, **kwargs)[1]
    zeros = {
        key: jax.tree.map(_zero, shape)
        for key, shape in shapes.items()
        if key.reduce is None and _differentiable(shape)  # one occurrence, not reduced
    }

    def of(perturbations, *args):
        values = {key: Add(d) for key, d in perturbations.items()}
        return _Planted(fn, chosen)(values, *args, **kwargs)

    if argnums is None:
        return jax.value_and_grad(of, has_aux=has_aux)(zeros, *args)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    value, (inter_grads, *grads) = jax.value_and_grad(
        of, argnums=(0, *(i + 1 for i in nums)), has_aux=has_aux
    )(zeros, *args)
    return value, inter_grads, grads[0] if isinstance(argnums, int) else tuple(grads)


def _of_graph_nodes(fn, chosen, argnums, has_aux, only, args, kwargs):
    """`grad_inters` of a function of Flax NNX objects (mutable graph nodes, which JAX's
    `grad` cannot take as it takes arrays): split into their state, differentiated as a pure
    function of it, merged back inside; the caller's objects get the state the call left, as
    `pull` leaves it (see `_nnx`)."""
    root, tree, call = split_callable(fn)
    is_node = _nnx.node_test()
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs), is_leaf=is_node)
    packed, args, kwargs, nodes = _nnx.split(leaves, treedef)
    nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(isinstance(args[i], _nnx.Slot) for i in nums):
        raise TypeError(
            "stx.grad_inters(..., argnums=...) names a Flax NNX object: take gradients with "
            "respect to a module's parameters with nnx.grad, and those with respect to the "
            "intermediates here."
        )
    plan = Plan(chosen)
    inner = _nnx.calling(plan.objects.wrap(call, objects=True, fn=fn))

    def pure(packed, *args, **kwargs):
        out, state = inner(packed, *args, **kwargs)
        return (out[0], (out[1], state)) if has_aux else (out, state)

    shifted = None if argnums is None else jax.tree.map(lambda i: i + 1, argnums)
    value, *rest = _grad_inters(pure, plan.places.at, shifted, True, only, (packed, *args), kwargs)
    loss, aux_state = value
    aux, state = aux_state if has_aux else (None, aux_state)
    _nnx.update(nodes, state)
    return ((loss, aux) if has_aux else loss, *rest)

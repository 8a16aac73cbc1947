"""`pull`, the API: what it returns (`Pulled`), how a call goes (the objects and places
selected, Flax NNX's objects split, the compiled path tried), and where a planted run takes its
values. Tracing an entry is `entries`; the eager compiled path, `compiled`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core import context as _context
from .._core import fastpaths as _fastpaths
from .._core import staging as _staging
from .._core.exposers import take
from .._core.flat_calls import split_callable
from .._core.tracebacks import boundary
from .._jax import tracing as _tracing
from .._select.plan import Plan
from . import compiled as _compiled
from . import nnx as _nnx
from . import planting as _plant
from .cache import follows_jit, is_array
from .entries import entry_for, evaluate, inline, summarized
from .naming import selection_of

__all__ = ["pull"]

_NO_PLAN = Plan()


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fn"],
    meta_fields=["only", "enabled", "summarize", "ran", "planting", "at", "cotangents", "steps"],
)
@dataclasses.dataclass(frozen=True)
class Pulled:
    """What `pull` returns: a pytree whose leaves are `fn`'s (as an `eqx.Module`'s would be),
    with plain attributes, which a call reads without `eqx.Module`'s per-access work."""

    fn: Callable
    only: Any
    enabled: bool
    summarize: Any
    ran: bool = False
    planting: Any = None  # for `plant`: a `_plant.Planting`
    at: tuple = ()  # selections (`_select`): marks made where none were written
    cotangents: bool = False  # also the cotangents that flow back through the marks
    steps: Any = None  # every iteration of a `while_loop`, up to this many (per depth)

    @property
    def __wrapped__(self) -> Callable:
        """`fn`: `inspect.signature` gives `fn`'s signature (which tools and
        `jax.jit(..., static_argnames=...)` read), and JAX names a trace by `fn`."""
        return self.fn

    @boundary
    def __call__(self, *args, **kwargs):
        known = self.__dict__.get("_compiled")  # (generation, tree, compiled), once it has run
        current = known is not None and known[0] == _compiled.generation()
        if current and _fastpaths.on and _tracing.eager():
            # An eager call of a pull that has run compiled: straight to it, which takes the
            # call if it is on arrays (see `run_compiled`).
            result = _compiled.run_compiled(known[2], known[1], args, kwargs)
            if result is not None:
                return result
        return call_pulled(self, args, kwargs)


# The work of a call is in functions, not methods: each method access on an `eqx.Module` builds
# a bound-method module, which costs more than the rest of a cached call.


def call_pulled(pulled: Pulled, args, kwargs, values=None):
    """`pulled(*args, **kwargs)`: `(out, intermediates)`; for `plant`, with `values` planted."""
    if pulled.at:  # the objects of an `of=` model mark their calls before anything is flattened
        with Plan(pulled.at).in_force():
            return _call_pulled(pulled, args, kwargs, values)
    return _call_pulled(pulled, args, kwargs, values)


def _call_pulled(pulled: Pulled, args, kwargs, values=None):
    fn = pulled.fn
    if not pulled.enabled:
        return fn(*args, **kwargs), {}
    is_node = _nnx.node_test()  # None unless Flax NNX is imported
    root, tree, call = split_callable(fn)
    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs), is_leaf=is_node)
    plan = traced = _NO_PLAN
    # Marks by object where the objects are live (in NNX's merge), in the program around.
    if pulled.at:
        selected = Plan(pulled.at)
        call = selected.wrap(call, objects=True, fn=fn)
        # Places in the program: put into what `pull` traces; where something is planted, or
        # `ran=` asks for flags, by evaluating the program again with `save_inter`s there.
        planted = values is not None or pulled.planting is not None or _context.PLANTING.value
        plan, traced = selected.split(into_trace=not planted and not pulled.ran)
    eager = (
        _fastpaths.on
        and pulled.steps is None
        and not plan
        and not pulled.cotangents
        and values is None
        and pulled.summarize is None
        and pulled.planting is None
        and all(map(is_array, leaves))
    )
    if eager:
        compiled = _compiled.lookup_compiled(root, (pulled.only, pulled.ran, pulled.at))
        if compiled is not None:
            result = _compiled.run_compiled(compiled, tree, args, kwargs)
            if result is not None:
                # This pull's next calls on arrays go straight here (its `tree` is fixed).
                object.__setattr__(pulled, "_compiled", (_compiled.generation(), tree, compiled))
                return result
    if is_node is not None and any(map(is_node, leaves)):
        # Flax NNX objects: keep their reference semantics, as `nnx.jit` does.
        packed, args, kwargs, nodes = _nnx.split(leaves, treedef)
        leaves, treedef = jax.tree_util.tree_flatten((packed, args, kwargs))
        call = plan.wrap(_nnx.calling(call), objects=False)
        (out, state), inters = _run(pulled, root, call, leaves, treedef, values, False, traced)
        _nnx.update(nodes, state)
        return out, inters
    call = plan.wrap(call, objects=False)
    return _run(pulled, root, call, leaves, treedef, values, eager, traced)


def _run(pulled, root, call, leaves, treedef, values, eager=False, traced: Plan = Plan()):
    only, planting, summarize, ran = pulled.only, pulled.planting, pulled.summarize, pulled.ran
    if values is None and planting is None and summarize is None and _fastpaths.on:
        trace = _staging.staging_trace()
        if trace is not None and _context.PLANTING.value is None:
            with _context.COTANGENTS(pulled.cotangents), _steps(pulled):
                return inline(trace, call, leaves, treedef, only, ran, traced)
    # `plant` traces with its planting in force (within an enclosing plant, that one stays).
    # Where the inputs are differentiated, the rules of custom derivatives run: their marks
    # are keys (see `handlers.custom_derivatives`); where they are not, there are none.
    differentiating = any(map(_tracing.differentiated, leaves))
    with (
        contextlib.nullcontext() if planting is None else _context.PLANTING(planting),
        _context.DIFFERENTIATING(differentiating),
        _context.RAN_MASKS(ran),
        _context.COTANGENTS(pulled.cotangents),
        _steps(pulled),
    ):
        entry, dynamic = entry_for(root, call, leaves, treedef, only, pulled.at, traced)
    if eager and follows_jit(root) and _compiled.one_jit(entry):
        _compiled.compile_entry(root, call, only, ran, pulled.at)
    if values is not None:  # `plant`: its values, checked against the marks
        fed = _plant.feed(entry.ins, entry.in_avals, values, planting, entry.metas)
    elif entry.ins:  # within an enclosing plant: what it plants comes in from outside
        fed = take(entry.ins, entry.in_avals)
    else:
        fed = []
    if summarize is not None:
        return summarized(entry, summarize, ran)(*dynamic, *fed)
    # A planted run inside an enclosing pull: its intermediates (as planted) are marks again.
    remark = planting is not None and bool(_context.PULLING.value)
    return evaluate(entry, [*dynamic, *fed], ran, remark)


def _steps(pulled: Pulled):
    """In force while `pulled` traces: its `steps=` bound (an enclosing pull's stays where it
    sets none)."""
    if pulled.steps is None:
        return contextlib.nullcontext()
    return _context.STEPS(pulled.steps)


def check_steps(steps, who: str):
    """`steps=` as given to `who`: `None`, a positive number of rows, or a tuple of them (or
    `None`), one per depth of `while_loop`s."""
    if steps is None:
        return None

    def rows(n):
        return not isinstance(n, bool) and isinstance(n, (int, np.integer)) and n >= 1

    if isinstance(steps, (tuple, list)) and steps and all(n is None or rows(n) for n in steps):
        return tuple(None if n is None else int(n) for n in steps)
    if not rows(steps):
        raise TypeError(
            f"{who}(..., steps=...) takes a positive int, the most iterations a while_loop "
            "keeps (one row each), a tuple of them (or None), one per depth of while_loops, "
            f"the outermost first, or None (each loop's last iteration); got {steps!r}."
        )
    return int(steps)


def pull(
    fn: Callable,
    *,
    only: Any = None,
    enabled: bool = True,
    summarize: Callable | None = None,
    ran: bool = False,
    at: Any = None,
    cotangents: bool = False,
    steps: int | None = None,
) -> Callable:
    """Transform `fn` to also return every value marked with `save_inter` inside it.

    Args:
        fn: any callable: a function, a jitted/vmapped/differentiated function, an
            `eqx.Module`. Its arguments follow equinox's filter convention: array leaves are
            traced, other leaves are static (as in `eqx.filter_jit`), with one exception: a
            Python float or complex passed directly as an argument is traced, weakly typed, as
            `jax.jit` traces it (so `pull(f)(1.0)` does not retrace for `2.0`). Python ints
            and bools stay static.
        only: collect only some marks: a name or a collection of names (exact, scopes
            included), a compiled regular expression (`re.compile("encoder/.*")`, matched
            against the whole name), or a predicate on `StateMeta`. The others stay plain
            identities, and work that only they needed disappears from the compiled program.
        enabled: `False` turns `pull` off: the function runs as it is and returns
            `(out, {})`, compiling to exactly the unmarked program. Pass it as a static
            argument to switch collection per call under `jit`.
        summarize: a function applied to every intermediate inside the compiled program
            (`stx.stats`, or any function of a pytree); the dict then holds its results, and
            only they leave the device.
        ran: also return, beside each value that may be the zeros of code that did not run (a
            `cond` branch not taken under `jit` or `vmap`, a `while_loop` that ran no
            iteration), whether it ran: for an occurrence `"h_0"`, an entry `"h_0.ran"`, a
            boolean (per example under a `vmap`, per row where a `scan` stacks it); for a name
            saved with `reduce="stack"` or `"collect"`, an entry `f"{name}.ran"` of boolean
            masks with the value's structure: true for each row (`"stack"`: shape
            `(*batch, occurrences)`) or element (`"collect"`: the value's shape) that comes
            from an occurrence that ran. `describe` says which values did not run.
        at: also mark places nobody marked: a selection, or a list of them, as
            `stx.scopes(...)`, `stx.modules(...)`, `stx.primitives(...)` and `stx.lines(...)`
            make (see "Looking inside a model you did not write"). Their values come back as
            marks written there would, beside the marks written by hand.
        cotangents: also return the cotangent that flows back through each mark where `fn`
            differentiates (`jax.grad`, `jax.value_and_grad`, `jax.vjp`, equinox's and NNX's
            inside `fn`): for an occurrence `"h_0"`, `"h_0.grad"`, from the same backward
            pass, stacked as the value is (per iteration in a `scan`, per example under
            `vmap`). `plant` replaces or transforms them by the same keys. See "Debugging
            gradients".

    Returns:
        A callable with `fn`'s signature returning `(out, intermediates)`: `fn`'s output and a
        dict `{f"{name}_{n}": value}`, `n` counting each name's `save_inter` calls from 0 in
        program order. Each key is a `str` that also knows where its value was saved,
        `key.location` (`"file.py:line"`), as `describe` shows. It composes with `jit`,
        `grad` (use `has_aux=True` outside), `vmap`, `jacfwd`, `jacrev`, `hessian` and
        equinox's filtered transforms, in either order. Called where a jaxpr is being staged
        (under `jit`, `make_jaxpr`, in a loop body), it traces `fn` straight into that jaxpr,
        as `fn` alone would be, and stages the marked values as outputs, nothing else;
        called eagerly, it traces `fn` at each call, so that what `fn` reads from outside its
        arguments (a global, a model it closes over) is read as it is now; a function wrapped
        in `jax.jit` (or `eqx.filter_jit`) keeps its trace, as `jax.jit` does.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     stx.save_inter(x ** 2, name="sq")
        ...     return jnp.sum(x)
        >>> out, inters = stx.pull(jax.jit(f))(jnp.arange(3.0))
        >>> inters
        {'sq_0': Array([0., 1., 4.], dtype=float32)}
    """
    if not callable(fn):
        raise TypeError(f"stx.pull needs a callable, got {fn!r} of type {type(fn).__name__}.")
    plan = Plan.of(at)
    if cotangents:
        plan.refuse_cotangents("stx.pull")
    return Pulled(
        fn,
        only=selection_of(only),
        enabled=bool(enabled),
        summarize=summarize,
        ran=bool(ran),
        at=plan.at,
        cotangents=bool(cotangents),
        steps=check_steps(steps, "stx.pull"),
    )

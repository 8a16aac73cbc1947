"""The plan: what a call's selections ask of a driver, in one object.

A driver (`pull`, `plant`, `grad_inters`, `stx.sites`) makes a `Plan` of the selections it was
given and calls it at each step of a call; it never reaches into the selection modules. The
steps, in a call's order:

1. `plan.in_force()`: the selections in JAX's trace context (a `jit` inside is traced again
   for another selection), and the objects of an `of=` model marking their calls, before the
   driver flattens its arguments;
2. `plan.wrap(call, objects=True, fn=fn)`: the call with the objects it selects marked (and
   Linen and Keras modules intercepted), where the live objects are (inside Flax NNX's merge);
3. `plan.split(into_trace)`: which places are put into the jaxpr the driver traces, and which
   are made by evaluating the program again (`wrap(call, objects=False)`);
4. `plan.tracing(only, metas)` around the trace: the modules whose scopes are selected marked
   as they run, and a selected object that was never called an error once it is done;
5. `plan.collected(...)` / `plan.collected_staged(...)`: the places put into what was traced.

`survey(fn, args, kwargs)` is what `stx.sites` asks of them: every module, scope and place
there is to select in a call (and `uncalled_tolerated()`: a selected submodule the call does
not reach is no error while `stx.sites` asks what a selection of every module returns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx

from .._core import context as _context
from .._core.errors import SelectionError
from .keras import with_keras
from .linen import with_linen
from .objects import (
    calls_checked,
    calls_recorded,
    objects_marked,
    uncalled_tolerated,
    with_modules,
)
from .paths import model_roots, module_paths
from .places import collected, collected_staged, with_places
from .report import places_in
from .running import modules_recorded, run_marked
from .vocabulary import Modules, Scopes, Selection, modules, selections

__all__ = ["Plan", "Survey", "survey", "uncalled_tolerated"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A call's selections (`at=`), and what each step of the call does with them."""

    at: tuple[Selection, ...] = ()

    @classmethod
    def of(cls, at: Any) -> Plan:
        """The plan of a driver's `at=` argument (a selection, a sequence of them, or `None`),
        checked (`vocabulary.selections`)."""
        return cls(selections(at))

    def __bool__(self) -> bool:
        return bool(self.at)

    @property
    def objects(self) -> Plan:
        """The selections by object (`stx.modules`)."""
        return Plan(tuple(s for s in self.at if isinstance(s, Modules)))

    @property
    def places(self) -> Plan:
        """The selections of places in the program (`scopes`, `primitives`, `lines`)."""
        return Plan(tuple(s for s in self.at if not isinstance(s, Modules)))

    def split(self, into_trace: bool) -> tuple[Plan, Plan]:
        """`(evaluated, traced)`: with `into_trace`, the places are put into the jaxpr the
        driver traces (`tracing`, `collected`), the rest made as the call runs; without, all
        of them are made as the call runs (by evaluating the program again: where something is
        planted, or `ran=` asks for flags)."""
        if not into_trace:
            return self, Plan()
        return self.objects, self.places

    @contextlib.contextmanager
    def in_force(self):
        """Within, the selections are in JAX's trace context, and the objects of `of=` models
        mark their calls (before the driver flattens its arguments, so that what it rebuilds
        is of the marking class)."""
        with _context.PLACES((*_context.PLACES.value, *self.at)), objects_marked(self.at):
            yield

    def wrap(self, call: Callable, *, objects: bool, fn=None) -> Callable:
        """`call(tree, *args, **kwargs)` (which calls `fn`) with the selections of one kind
        made: by object (`objects=True`, where the live objects are: inside Flax NNX's merge;
        also the Linen and Keras modules that scopes select) or in the program."""
        if objects:
            scopes = tuple(s for s in self.at if isinstance(s, Scopes))
            if scopes:
                call = functools.partial(with_linen, call, scopes)
                call = functools.partial(with_keras, call, scopes)
            chosen = self.objects.at
            return call if not chosen else functools.partial(with_modules, call, chosen, fn)
        chosen = self.places.at
        return call if not chosen else functools.partial(with_places, call, chosen)

    @contextlib.contextmanager
    def tracing(self, only: Any, metas: Callable[[], Sequence]):
        """Around a driver's trace: the modules whose scopes are selected are marked as they
        run, and once it is done, a selected object that was not called and has no mark among
        `metas()` is an error. Yields the places chosen, as a function of nothing, for once the
        trace is done (its scope selections then skip the scopes marked as they ran)."""
        with calls_checked(metas, only), run_marked(self.at) as chosen:
            yield lambda: Plan(chosen())

    def refuse_cotangents(self, caller: str) -> None:
        """Cotangents come from marks made where their values are differentiated: module
        selections and the scopes of Flax Linen and Keras modules are (marked as they run);
        other places in the program are found once the function, and its derivative, are
        traced."""
        for selection in self.at:
            if not isinstance(selection, (Modules, Scopes)):
                raise SelectionError(
                    f"{caller}(fn, at={selection}, cotangents=True): a primitive or a line is "
                    "found in the program once its derivative is traced already, so no "
                    "cotangent can be read there. Select the module that computes it "
                    "(stx.modules, or the scope of a Flax Linen or Keras module), or mark the "
                    "value with stx.save_inter."
                )

    def collected(self, closed, marks: list) -> tuple[Any, list]:
        """`(closed, marks)`, a jaxpr the driver traced and what its collector took, with the
        places selected marked."""
        return collected(closed, marks, self.at)

    def collected_staged(self, trace, start: int, outs: Sequence, collector) -> None:
        """`collected` for a function traced straight into `trace` from `start` on."""
        collected_staged(trace, start, outs, collector, self.at)


@dataclasses.dataclass(frozen=True)
class Survey:
    """What there is to select in a call (`survey`).

    Attributes:
        jaxpr: the call, traced, its submodules marked idly (not pulled).
        paths: the paths of the model's submodules (`stx.modules` takes them), outermost first.
        called: the paths of those called, in the order first called.
        ran: the scope paths of the Linen and Keras modules that ran, in order.
        modules: a selection of every one of `paths`, or `None` where there are none.
    """

    jaxpr: Any
    paths: list[str]
    called: list[str]
    ran: list[str]
    modules: Selection | None

    @property
    def places(self):
        """The scopes and primitives in the jaxpr (`report.places_in`)."""
        return places_in(self.jaxpr.jaxpr.eqns)


def survey(fn: Callable, args: tuple, kwargs: dict) -> Survey:
    """`fn(*args, **kwargs)` traced with everything selectable recorded (no computation runs)."""
    roots = []
    try:
        roots = model_roots(fn, fn, args, kwargs)
    except SelectionError:
        pass
    paths = list(dict.fromkeys(p for root in roots for p in module_paths(root)))
    chosen = modules(*paths) if paths else None

    def traced(*args, **kwargs):  # the function, its submodules marked (idly: not pulled)
        call = functools.partial(with_linen, lambda f, *a, **k: f(*a, **k), ())
        call = functools.partial(with_keras, call, ())  # (their modules recorded)
        at = () if chosen is None else (chosen,)
        with objects_marked(at, (fn, fn, args, kwargs)), run_marked(()):
            return call(fn, *args, **kwargs)

    with calls_recorded() as called, modules_recorded() as ran:
        closed = eqx.filter_make_jaxpr(traced)(*args, **kwargs)[0]
    return Survey(closed, paths, list(called), list(ran), chosen)

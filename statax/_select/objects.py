"""Selections of objects (`stx.modules`): submodules of an equinox or Flax NNX model, or any
callable object in one, found by attribute path and marked where they run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._core.context import within
from .._core.errors import SelectionError
from .._core.meta import StateMeta
from .._core.primitive import save_inter
from .paths import is_leaf, is_module, model_roots, resolve, resolve_in
from .vocabulary import Modules, Selection, describe_selections

__all__ = [
    "calls_checked",
    "calls_recorded",
    "objects_marked",
    "uncalled_tolerated",
]


# ---- objects ---------------------------------------------------------------------------------


@contextlib.contextmanager
def objects_marked(at: tuple[Selection, ...], call: tuple | None = None):
    """Within, the objects that the module selections of `at` select mark their calls. With
    no `call`, those of `of=` models (before `pull` flattens its arguments, so that what it
    rebuilds is of the marking class); with `call`, `(fn, tree, args, kwargs)`, those of the
    model found there (`model_roots`), for selections without `of=`, and those of a copy of an
    `of=` model that a transformation (`jax.jit`, `jax.grad`) rebuilt from its leaves, found
    there by its tree structure."""
    targets: dict[Any, tuple[Any, str, Modules]] = {}
    places: dict[str, tuple[Any, Any]] = {}  # name -> (parent, key): where a callable is held
    swapped = []
    replaced: list[tuple[Any, Any, Any]] = []  # (parent, key, callable) put back after
    with contextlib.ExitStack() as stack:
        if call is None:  # (the outermost pass: the `of=` models' structures, as given)
            given = _OF_STRUCTURES.get()
            new = {
                id(s.of): jax.tree_util.tree_structure(s.of)
                for s in at
                if isinstance(s, Modules) and s.of is not None and id(s.of) not in given
            }
            if new:
                stack.enter_context(within(_OF_STRUCTURES, {**given, **new}))
        try:
            for selection in at:
                if not isinstance(selection, Modules):
                    continue
                if call is None:  # `of=` models, as they are
                    if selection.of is None:
                        continue
                    roots = [selection.of]
                elif selection.of is None:
                    roots = model_roots(*call)
                else:  # an `of=` model a transformation rebuilt from its leaves: by structure
                    roots = _rebuilt(selection.of, call)
                    if not roots:
                        continue
                for path in selection.paths:
                    for name, obj, place in resolve_in(roots, path):
                        if _by_class(obj, place):
                            targets.setdefault(id(obj), (obj, name, selection))
                        else:  # (a function: marked where it is held, one per place)
                            targets.setdefault(name, (obj, name, selection))
                            places[name] = place
            shadows = _shadows(at, call, targets) if call is not None else []
            chosen = [(o, n, s, places.get(n)) for o, n, s in targets.values()]
            for obj, name, selection, place in [*chosen, *shadows]:
                if not _by_class(obj, place):
                    if _is_marking(obj):  # (marked by an outer pass already: an `of=` model's)
                        continue
                    if place is None or place[0] is None:
                        raise SelectionError(
                            f"{describe_selections((selection,))} selects {name!r}, a "
                            f"{type(obj).__name__} that is the model itself or was given by a "
                            "function: a callable that is not an object of a class of its own "
                            "is marked where it is held. Select it by its path in the model."
                        )
                    marked = _marking_call(obj, name, selection.inputs, selection.reduce)
                    _put(*place, obj, marked, selection)
                    replaced.append((*place, marked, obj))
                    continue
                cls = type(obj)
                if getattr(cls, "_statax_marks", None) is None:
                    marking = _marking(cls, name, selection.inputs, selection.reduce)
                    node = not is_leaf(obj)
                    object.__setattr__(obj, "__class__", marking)
                    swapped.append((obj, cls))
                    if node and is_leaf(obj):  # (a pytree node by its exact class: penzai)
                        _register_as(marking, cls)
            if shadows:
                ids = _SHADOWS.get() | {id(o) for o, _, _, _ in shadows}
                stack.enter_context(within(_SHADOWS, ids))
            yield [name for _, name, _ in targets.values()]
        finally:
            for obj, cls in swapped:
                object.__setattr__(obj, "__class__", cls)
            for parent, key, marked, obj in reversed(replaced):
                _put(parent, key, marked, obj)


# The ids of the objects swapped for marking classes only so that trees made from the model (an
# optimizer's state: `optax.adam`'s moments are copies of it) keep its structure: they do not
# mark when called.
_SHADOWS: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "statax_shadows", default=frozenset()
)


def _shadows(at, call, targets: dict) -> list:
    """`(object, name, selection, place)` of the objects at the selected paths in the other
    copies of the model among the arguments (of its class, not it): an optimizer's moments, a
    model's gradients passed in. Swapped with the selected objects, they keep the trees made
    from the model (by `jax.grad` inside the function) and them of one structure."""
    fn, tree, args, kwargs = call
    roots = {id(r): r for r in _roots_quietly(fn, tree, args, kwargs)}
    kinds = {type(r) for r in roots.values()}
    if not kinds or not targets:
        return []
    copies = [
        x
        for x in jax.tree_util.tree_leaves((tree, args, kwargs), is_leaf=lambda x: type(x) in kinds)
        if type(x) in kinds and id(x) not in roots
    ]
    found = []
    for copy in copies:
        for selection in at:
            if not isinstance(selection, Modules) or selection.of is not None:
                continue
            for path in selection.paths:
                try:
                    resolved = resolve(copy, path)
                except (SelectionError, AttributeError, IndexError, KeyError, TypeError):
                    continue
                for name, obj, place in resolved:
                    if not _by_class(obj, place):  # (a function held in a copy: the same)
                        if name in targets and targets[name][0] is obj and place[0] is not None:
                            found.append((obj, name, selection, place))
                    elif id(obj) not in targets and any(
                        n == name and type(o) is type(obj) for o, n, _ in targets.values()
                    ):
                        found.append((obj, name, selection, None))
    kept = {(id(o), id(p[0]) if p else None): (o, n, s, p) for o, n, s, p in found}
    return list(kept.values())


def _roots_quietly(fn, tree, args, kwargs) -> list:
    try:
        return model_roots(fn, tree, args, kwargs)
    except SelectionError:
        return []


def unmarked(tree):
    """`tree` with every object of a marking class made again of its own class (a model that
    the function returns, rebuilt from the marked one: it must not keep marking)."""
    if not any(map(_is_marking, jax.tree_util.tree_leaves(tree, is_leaf=_is_marking))):
        return tree

    def plain(x):
        if isinstance(x, types.FunctionType) and _is_marking(x):  # (a function held)
            return x.__wrapped__
        if not _is_marking(x) or not hasattr(x, "__dict__"):
            return x
        copy = object.__new__(type(x).__mro__[1])
        copy.__dict__.update(x.__dict__)
        return jax.tree_util.tree_map(
            plain, copy, is_leaf=lambda y: y is not copy and _is_marking(y)
        )

    return jax.tree_util.tree_map(plain, tree, is_leaf=_is_marking)


def _is_marking(x) -> bool:
    """Whether `x` marks its calls: of a marking class, or a function a model holds, wrapped."""
    if isinstance(x, types.FunctionType):
        return getattr(x, "_statax_marks", None) is not None
    return getattr(type(x), "_statax_marks", None) is not None


# The names of the selected objects called while a function is traced (`with_modules`), and
# those of the ones it did not call, for `pull` to check against the marks it found
# (`calls_checked`).
_CALLED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "statax_called", default=None
)  # (a dict: in the order called)
_UNCALLED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "statax_uncalled", default=None
)


@contextlib.contextmanager
def calls_checked(metas: Callable[[], Sequence[StateMeta]], only: Any):
    """Around a `pull`'s trace: once it is done, raise where a selected submodule was not
    called and has no mark among `metas()` either. (A `jit` whose cached trace already holds
    the submodule's marks does not call it again, and is no error; one that closes over the
    model and traced it before the selection is.) With `only=`, whose selection no mark of a
    name is known to pass, nothing is checked."""
    with within(_UNCALLED, []) as uncalled:
        yield
    if not uncalled or only is not None or _TOLERATED.get():  # (`stx.sites`: not listed)
        return
    names = {m.name for m in metas()}
    missing = [(name, chosen) for name, chosen in uncalled if name not in names]
    if missing:
        name, chosen = missing[0]
        raise SelectionError(
            f"{describe_selections(chosen)} selects {name!r}, which the function did not call "
            "while pull traced it, and whose marks are not in what it traced. If it is called "
            "from code that was traced before (a jax.jit of a function that closes over the "
            "model), pass the model to that function as an argument, or select a submodule that "
            "runs."
        )


_TOLERATED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "statax_uncalled_tolerated", default=False
)


def uncalled_tolerated():
    """Within, a selected submodule that the function does not call is no error."""
    return within(_TOLERATED, True)


def calls_recorded():
    """Within, the selected objects record their calls; yields their names, in the order
    first called (`stx.sites` lists modules so)."""
    return within(_CALLED, {})


def with_modules(call, chosen: tuple[Modules, ...], fn, tree, *args, **kwargs):
    with (
        calls_recorded() as called,
        objects_marked(chosen) as given,
        objects_marked(chosen, (fn, tree, args, kwargs)) as found,
    ):
        out = unmarked(call(tree, *args, **kwargs))
    uncalled = _UNCALLED.get()
    if uncalled is not None:  # (always, inside a `pull`: see `calls_checked`)
        uncalled.extend((name, chosen) for name in (*given, *found) if name not in called)
    return out


def _register_as(marking: type, cls: type) -> None:
    """Make `marking` (a subclass of `cls` that marks its calls) the pytree node `cls` is, for
    JAX's registry goes by exact class: flattened as `cls` flattens (one level, with its keys),
    and unflattened to `cls` and then to `marking`. Without this, a marked layer is a leaf, and
    a transformation that slices its parameters (penzai's `LayerStack` under `lax.scan`) skips
    them. (Once per marking class; JAX keeps registrations for good.)"""

    def flatten_with_keys(obj):
        object.__setattr__(obj, "__class__", cls)
        try:
            pairs, treedef = jax.tree_util.tree_flatten_with_path(
                obj, is_leaf=lambda x: x is not obj
            )
        finally:
            object.__setattr__(obj, "__class__", marking)
        return [(path[0], child) for path, child in pairs], treedef

    def unflatten(treedef, children):
        obj = jax.tree_util.tree_unflatten(treedef, children)
        object.__setattr__(obj, "__class__", marking)
        return obj

    def flatten(obj):
        pairs, treedef = flatten_with_keys(obj)
        return [child for _, child in pairs], treedef

    jax.tree_util.register_pytree_with_keys(marking, flatten_with_keys, unflatten, flatten)


# While a `pull` runs: the tree structure of each `of=` model as it was given (before its
# submodules' classes were swapped), by id: a copy that `jax.jit` or `jax.grad` rebuilt from
# its leaves has it.
_OF_STRUCTURES: contextvars.ContextVar[dict] = contextvars.ContextVar(
    "statax_of_structures", default={}
)


def _rebuilt(of, call) -> list:
    """The models among the function's and its arguments that are `of` rebuilt from its leaves
    (by `jax.jit`, `jax.grad`, ...): another object of `of`'s tree structure."""
    structure = _OF_STRUCTURES.get().get(id(of))
    fn, tree, args, kwargs = call
    candidates = [tree, fn, *args, *kwargs.values()]
    return [
        c
        for c in candidates
        if c is not of and is_module(c) and jax.tree_util.tree_structure(c) == structure
    ]


def _by_class(obj, place) -> bool:
    """Whether `obj` marks its calls by its class (swapped for a marking subclass): a model
    (`_is_module`), or another callable object that is held nowhere a path can name. Other
    callables a model holds (a function, a `functools.partial`, `jax.nn.relu`, whose class
    cannot be subclassed or assigned, or is JAX's own) are marked where they are held
    (`_marking_call`), one key per call."""
    if is_module(obj):
        return True
    if place is not None and place[0] is not None:
        return False
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return False
    if type(obj).__flags__ & (1 << 10) == 0:  # (not Py_TPFLAGS_BASETYPE: no subclass of it)
        return False
    return not isinstance(obj, functools.partial)  # (its `__class__` cannot be assigned)


def _put(parent, key: str, old, value, selection=None) -> None:
    """Hold `value` where `parent` holds `old` at `key` (`".name"`, `"[0]"`, `"['k']"`, as
    `_children` names them), bypassing a module's own `__setattr__` (which may refuse a change
    made under a transformation: Flax NNX's): an attribute is set on the object itself, and so
    is an item that a container keeps as an attribute of its own (`nnx.List`)."""
    if key.startswith("."):
        object.__setattr__(parent, key[1:], value)
        return
    held = next((k for k, v in getattr(parent, "__dict__", {}).items() if v is old), None)
    if held is not None:  # (keyed by its index as a string, or as an int in Flax 0.12.0)
        vars(parent)[held] = value
        return
    inner = key[1:-1]
    try:
        parent[int(inner) if inner.lstrip("-").isdigit() else inner.strip("'")] = value
    except TypeError as error:  # (a tuple)
        raise SelectionError(
            f"{describe_selections((selection,))} selects a {type(old).__name__} that a "
            f"{type(parent).__name__} holds, which cannot be changed to mark its calls. Select "
            "the module that calls it, or its output's consumer."
        ) from error


def _marked_call(call, name: str, inputs: bool, reduce, args, kwargs):
    """`call(*args, **kwargs)` with its output (and, with `inputs`, its inputs) marked, and the
    call recorded (`calls_recorded`)."""
    called = _CALLED.get()
    if called is not None:
        called[name] = None
    if inputs and kwargs:  # (the inputs are marked as the call has them)
        args, kwargs = save_inter((args, kwargs), name=f"{name}.in", reduce=reduce)
    elif inputs and len(args) == 1:
        args = (save_inter(args[0], name=f"{name}.in", reduce=reduce),)
    elif inputs:
        args = save_inter(args, name=f"{name}.in", reduce=reduce)
    return save_inter(call(*args, **kwargs), name=name, reduce=reduce)


@functools.lru_cache(maxsize=1024)
def _marking_call(fn: Callable, name: str, inputs: bool, reduce: str | None) -> Callable:
    """`fn` (a function, a `functools.partial`: a callable a model holds that is no object of
    a class of its own) as a callable that marks its calls as `name`. (One per callable and
    name, so that a model that holds it keeps one tree structure.)"""

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        return _marked_call(fn, name, inputs, reduce, args, kwargs)

    marked._statax_marks = name
    return marked


@functools.cache
def _marking(cls: type, name: str, inputs: bool, reduce: str | None) -> type:
    """`cls` with a `__call__` that marks its output (and, with `inputs`, its inputs) as
    `name`. (Made once per class and name, and keyed by nothing else: a selection's `of=`
    model is not kept alive by it.)"""
    original = cls.__call__

    def __call__(self, *args, **kwargs):  # noqa: N807
        if id(self) in _SHADOWS.get():  # (a copy of the model kept of its structure)
            return original(self, *args, **kwargs)
        call = functools.partial(original, self)
        return _marked_call(call, name, inputs, reduce, args, kwargs)

    namespace = {"__call__": __call__, "__module__": cls.__module__, "_statax_marks": name}
    sub = type(cls)(cls.__name__, (cls,), namespace)
    sub.__qualname__ = cls.__qualname__
    return sub

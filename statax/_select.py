"""Selections: marks where none were written, for a model nobody edited.

`pull(fn, at=...)`, `plant(fn, at=...)` and `grad_inters(fn, at=...)` take selections, which
make `save_inter`s at the places they select; from there on those are marks like any other.

Two kinds, by how they find their places:

* **Objects** (`modules`): submodules of an equinox or Flax NNX model (or any callable object
  in one), by attribute path. For the call, each selected object's class is swapped for a
  subclass whose `__call__` marks the output (and inputs) and calls the original; the class is
  put back when the call returns. The mark is made where the submodule runs, in whatever trace
  is there (inside a `vmap`, a `scan`, a derivative), so it behaves exactly as a
  `save_inter` written at the end of its `__call__`.
* **Places in the program** (`scopes`, `primitives`, `lines`): the function is traced to a
  jaxpr (its own marks as they would be), the equations are matched, and the jaxpr is then
  evaluated into the trace `pull` is making, with a `save_inter` after each selected place.
  Inside `jit`, `scan`, `while_loop`, `cond`, `jax.checkpoint` and custom derivatives the inner
  jaxpr is evaluated the same way, so a selection there behaves as a mark written there.
  A scope or a line is a region: the values made inside it and read after it (or returned)
  leave it, and are marked, together, where its last equation is. A transformation applied
  inside the function (`vmap`, `jvp`, `grad`), around the selected place, has already been
  applied to the jaxpr: the value there is no longer one a mark written at that place would
  see (its batch axis may be anywhere, a tangent stands beside a primal), so that is an error
  that says to apply the transformation outside, or to select by module.

A selection that matches nothing is an error listing what there is, closest first.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import fnmatch
import functools
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jex
from jax.extend import source_info_util as source_info_api

from . import _compat, _staging
from ._errors import SelectionError
from ._evaluator import bind_equation, evaluate, keep, rewrite
from ._interpreter import flags_for, map_jaxprs
from ._meta import ARRAY, StateMeta
from ._primitive import _LEAF, _SAVE_EFFECTS, COLLECTING, mark_as, save_inter, save_inter_p

__all__ = [
    "Selection",
    "calling",
    "calls_checked",
    "closest",
    "collected",
    "collected_staged",
    "lines",
    "linen_marked",
    "objects_marked",
    "modules",
    "primitives",
    "scopes",
    "selections",
]


class Selection:
    """What `at=` takes (a list of them too): made by `stx.scopes`, `stx.modules`,
    `stx.primitives` and `stx.lines`."""

    reduce: str | None


@dataclasses.dataclass(frozen=True)
class Scopes(Selection):
    patterns: tuple[str, ...]
    reduce: str | None = None
    marked: frozenset[str] = frozenset()  # scopes marked as they ran (Flax Linen modules)

    def region(self, stack: tuple) -> tuple[str, bool] | None:
        """`(path, transformed)` of the outermost scope of `stack` (a name stack's elements)
        that one of the patterns matches, and whether a transformation encloses it; `None`
        also for one marked already."""
        region = _scope_region(self.patterns, stack)
        return None if region is None or region[0] in self.marked else region

    def __str__(self) -> str:
        return f"stx.scopes({', '.join(map(repr, self.patterns))})"


@dataclasses.dataclass(frozen=True)
class Lines(Selection):
    places: tuple[tuple[str, int], ...]
    reduce: str | None = None

    def region(self, eqn) -> str | None:
        """The place (`"file.py:42"`) whose line was running when `eqn` was traced."""
        traceback = eqn.source_info.traceback
        if traceback is None:
            return None
        frames = [(f.file_name, f.line_num) for f in traceback.frames]
        for file, line in self.places:
            if any(n == line and _same_file(f, file) for f, n in frames):
                return f"{file}:{line}"
        return None

    def __str__(self) -> str:
        return f"stx.lines({', '.join(repr(f'{f}:{n}') for f, n in self.places)})"


@dataclasses.dataclass(frozen=True)
class Primitives(Selection):
    names: frozenset[str]
    reduce: str | None = None

    def __str__(self) -> str:
        return f"stx.primitives({', '.join(map(repr, sorted(self.names)))})"


@dataclasses.dataclass(frozen=True)
class Modules(Selection):
    paths: tuple  # strings, or functions of the root (as `eqx.tree_at`'s `where`)
    inputs: bool = False
    reduce: str | None = None
    of: Any = dataclasses.field(default=None, compare=False, hash=False)
    of_id: int | None = None

    def __str__(self) -> str:
        shown = [p if isinstance(p, str) else getattr(p, "__name__", "where") for p in self.paths]
        return f"stx.modules({', '.join(map(repr, shown))})"


def scopes(*patterns: str, reduce: str | None = None) -> Selection:
    """Select the values that leave a named scope: a Flax Linen module's path
    (`"Model/Block_0"`), an equinox layer's (`"eqx.nn.Linear"`), or any `jax.named_scope`.

    A value leaves a scope where it is made inside it and read after it, or returned: a
    module's output, seen in the program. Each call of a scope is one occurrence, its values
    together (a tuple where there are several), keyed by the scope's path
    (`"Model/Block_0_0"`).

    Args:
        *patterns: scope paths from the outermost, `/`-separated; `*` matches within one name
            (`"Model/Block_*"`: every block), `**`-free `fnmatch` patterns.
        reduce: as `save_inter`'s.

    Examples:
        >>> import jax, jax.numpy as jnp, statax as stx
        >>> def f(x):
        ...     with jax.named_scope("block"):
        ...         h = jnp.sin(x) * 2
        ...     return h + 1
        >>> stx.pull(f, at=stx.scopes("block"))(jnp.float32(0.5))[1]
        {'block_0': Array(0.9588511, dtype=float32)}
    """
    return Scopes(_strings(patterns, "stx.scopes"), reduce)


def primitives(*names: str, reduce: str | None = None) -> Selection:
    """Select the outputs of every equation of these primitives (`"dot_general"`,
    `"conv_general_dilated"`), keyed by the primitive's name.

    Examples:
        >>> import jax.numpy as jnp, statax as stx
        >>> f = lambda w, x: jnp.tanh(x @ w)
        >>> stx.pull(f, at=stx.primitives("dot_general"))(2 * jnp.eye(2), jnp.ones(2))[1]
        {'dot_general_0': Array([2., 2.], dtype=float32)}
    """
    return Primitives(frozenset(_strings(names, "stx.primitives")), reduce)


def lines(*places: str, reduce: str | None = None) -> Selection:
    """Select the values that the computation at a source line makes and that are read after
    it: `"model.py:42"` (the end of the file's path, and its line). Keyed by the place."""
    parsed = []
    for place in _strings(places, "stx.lines"):
        match = re.fullmatch(r"(.+):(\d+)", place)
        if match is None:
            raise TypeError(f"stx.lines takes 'file.py:42' places; got {place!r}.")
        parsed.append((match[1], int(match[2])))
    return Lines(tuple(parsed), reduce)


def modules(
    *paths: str | Callable, inputs: bool = False, of: Any = None, reduce: str | None = None
) -> Selection:
    """Select the outputs (and, with `inputs=True`, the inputs) of submodules' calls.

    Args:
        *paths: a path from the model (`"blocks[0].attn"`, `"blocks.0.attn"` and
            `"blocks/0/attn"` alike; `*` for every item of a list or dict: `"blocks[*]"`), or a
            function of the model returning the submodule (`lambda m: m.blocks[0].attn`, as
            `eqx.tree_at`'s `where`).
        inputs: also mark the arguments of each call, keyed `f"{path}.in"`: the argument
            where there is one, the tuple of positional arguments where there are several,
            `(args, kwargs)` where there are keyword arguments.
        of: the model the paths start from. By default the callable itself where it is a
            module (or a method of one), else the first argument that is an `eqx.Module` or a
            Flax NNX module.
        reduce: as `save_inter`'s.

    Keys are the paths (`"blocks[0].attn_0"`): one occurrence per call of the submodule, stacked
    where it runs in a `scan`, batched where it runs in a `vmap`.

    Examples:
        >>> import equinox as eqx, jax, statax as stx
        >>> mlp = eqx.nn.MLP(2, 1, width_size=3, depth=1, key=jax.random.PRNGKey(0))
        >>> _, inters = stx.pull(mlp, at=stx.modules("layers[*]"))(jax.numpy.ones(2))
        >>> {key: value.shape for key, value in inters.items()}
        {'layers[0]_0': (3,), 'layers[1]_0': (1,)}
    """
    for path in paths:
        if not (isinstance(path, str) or callable(path)):
            raise TypeError(f"stx.modules takes paths (strings) or functions; got {path!r}.")
    if not paths:
        raise TypeError("stx.modules needs at least one path.")
    return Modules(tuple(paths), bool(inputs), reduce, of, None if of is None else id(of))


def _strings(values: Sequence, what: str) -> tuple[str, ...]:
    if not values or not all(isinstance(v, str) and v for v in values):
        raise TypeError(f"{what} takes one or more non-empty strings; got {values!r}.")
    return tuple(values)


def selections(at: Any) -> tuple[Selection, ...]:
    """`at=` as a tuple of selections (hashable: part of a trace's cache key)."""
    if at is None:
        return ()
    items = (at,) if isinstance(at, Selection) else at
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, Selection) for s in items):
        raise TypeError(
            "at= takes a selection (stx.scopes, stx.modules, stx.primitives, stx.lines) or a "
            f"list of them; got {at!r}."
        )
    return tuple(items)


def calling(call: Callable, at: tuple[Selection, ...], *, objects: bool, fn=None) -> Callable:
    """`call(tree, *args, **kwargs)` (which calls `fn`) with the selections of one kind made:
    by object (`objects=True`, where the live objects are: inside Flax NNX's merge) or in the
    program."""
    if objects:
        scopes = tuple(s for s in at if isinstance(s, Scopes))
        if scopes:
            call = functools.partial(_with_linen, call, scopes)
        chosen = tuple(s for s in at if isinstance(s, Modules))
        return call if not chosen else functools.partial(_with_modules, call, chosen, fn)
    chosen = tuple(s for s in at if not isinstance(s, Modules))
    return call if not chosen else functools.partial(_with_places, call, chosen)


# ---- objects ---------------------------------------------------------------------------------


@contextlib.contextmanager
def objects_marked(at: tuple[Selection, ...], call: tuple | None = None):
    """Within, the objects that the module selections of `at` select mark their calls. With
    no `call`, those of `of=` models (before `pull` flattens its arguments, so that what it
    rebuilds is of the marking class); with `call`, `(fn, tree, args, kwargs)`, those of the
    model found there (`_roots`), for selections without `of=`."""
    targets: dict[int, tuple[Any, str, Modules]] = {}
    for selection in at:
        if not isinstance(selection, Modules) or (selection.of is None) == (call is None):
            continue
        roots = [selection.of] if call is None else _roots(*call)
        for path in selection.paths:
            for name, obj in _resolve_in(roots, path):
                targets.setdefault(id(obj), (obj, name, selection))
    swapped = []
    try:
        for obj, name, selection in targets.values():
            cls = type(obj)
            if getattr(cls, "_statax_marks", None) is None:
                marking = _marking(cls, name, selection.inputs, selection.reduce)
                object.__setattr__(obj, "__class__", marking)
                swapped.append((obj, cls))
        yield [name for _, name, _ in targets.values()]
    finally:
        for obj, cls in swapped:
            object.__setattr__(obj, "__class__", cls)


# The names of the selected objects called while a function is traced (`_with_modules`), and
# those of the ones it did not call, for `pull` to check against the marks it found
# (`calls_checked`).
_CALLED: contextvars.ContextVar[set | None] = contextvars.ContextVar("statax_called", default=None)
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
    uncalled: list = []
    token = _UNCALLED.set(uncalled)
    try:
        yield
    finally:
        _UNCALLED.reset(token)
    if not uncalled or only is not None:
        return
    names = {m.name for m in metas()}
    missing = [(name, chosen) for name, chosen in uncalled if name not in names]
    if missing:
        name, chosen = missing[0]
        raise SelectionError(
            f"{_describe(chosen)} selects {name!r}, which the function did not call while pull "
            "traced it, and whose marks are not in what it traced. If it is called from code "
            "that was traced before (a jax.jit of a function that closes over the model), pass "
            "the model to that function as an argument, or select a submodule that runs."
        )


def _with_modules(call, chosen: tuple[Modules, ...], fn, tree, *args, **kwargs):
    called: set = set()
    token = _CALLED.set(called)
    try:
        with (
            objects_marked(chosen) as given,
            objects_marked(chosen, (fn, tree, args, kwargs)) as found,
        ):
            out = call(tree, *args, **kwargs)
    finally:
        _CALLED.reset(token)
    uncalled = _UNCALLED.get()
    if uncalled is not None:  # (always, inside a `pull`: see `calls_checked`)
        uncalled.extend((name, chosen) for name in (*given, *found) if name not in called)
    return out


def _is_module(x) -> bool:
    """Whether `x` is an `eqx.Module` or a Flax NNX module (not one of its variables)."""
    if isinstance(x, eqx.Module):
        return True
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def _roots(fn, tree, args, kwargs) -> list:
    """The models paths may start from: the callable where it is a module (or a method of
    one, or wraps one, as `jax.vmap(model)` does), then the arguments that are."""
    wrapped = []
    while fn is not None and len(wrapped) < 8:
        wrapped.append(fn)
        fn = getattr(fn, "__self__", None) or getattr(fn, "__wrapped__", None)
    roots = [c for c in (tree, *wrapped, *args, *kwargs.values()) if _is_module(c)]
    if roots:
        return list({id(r): r for r in roots}.values())
    raise SelectionError(
        "stx.modules found no model to start its paths from: neither the function nor any of "
        "its arguments is an eqx.Module or a Flax NNX module. Pass the model as `of=`: "
        "stx.modules('blocks[0]', of=model)."
    )


def _resolve_in(roots: list, path) -> list[tuple[str, Any]]:
    """`_resolve` in the first of `roots` where `path` is found (a `filter_jit` wrapper is a
    module too, but not the model); where it is in none, the last one's error."""
    for i, root in enumerate(roots):
        try:
            return _resolve(root, path)
        except SelectionError:
            if i == len(roots) - 1:
                raise
    return []


_TOKEN = re.compile(r"\[([^\]]*)\]|([^.\[\]/]+)")


def _resolve(root, path) -> list[tuple[str, Any]]:
    """`[(name, object)]` that `path` selects in `root`."""
    if callable(path) and not isinstance(path, str):
        found = path(root)
        objs = found if isinstance(found, (list, tuple)) else [found]
        return [(_path_of(root, obj), obj) for obj in objs]
    found = [("", root)]
    for match in _TOKEN.finditer(path):
        step = match[1] if match[1] is not None else match[2]
        found = [item for name, obj in found for item in _step(name, obj, step, path)]
    return found


def _children(obj) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)) or (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")):
        try:
            return [(f"[{i}]", obj[i]) for i in range(len(obj))]
        except (TypeError, KeyError):
            pass
    fields = getattr(obj, "__dict__", {})
    return [(f".{k}", v) for k, v in fields.items() if not k.startswith("_")]


def _step(name: str, obj, step: str, path: str) -> list[tuple[str, Any]]:
    children = _children(obj)
    if step == "*":
        return [(_join(name, c), v) for c, v in children if not c.startswith(".")]
    for child, value in children:
        if child in (f".{step}", f"[{step}]", f"['{step}']"):
            return [(_join(name, child), value)]
    if not isinstance(obj, (dict, list, tuple)) and hasattr(obj, step):  # a property, a field
        return [(_join(name, f".{step}"), getattr(obj, step))]
    options = [_join(name, c) for c, _ in children]
    raise SelectionError(
        f"stx.modules({path!r}): {type(obj).__name__} at {name or 'the model'!r} has no "
        f"{step!r}. There is: {closest(_join(name, '.' + step), options)}."
    )


def _join(name: str, child: str) -> str:
    return (name + child).lstrip(".")


def _path_of(root, target) -> str:
    """The path of `target` in `root` (for a `where` function's result), breadth first."""
    seen, queue = {id(root)}, [("", root)]
    while queue:
        name, obj = queue.pop(0)
        if obj is target:
            return name or "model"
        for child, value in _children(obj):
            if id(value) not in seen and not isinstance(value, (str, int, float, jax.Array)):
                seen.add(id(value))
                queue.append((_join(name, child), value))
    raise SelectionError(
        f"stx.modules: the object the function returned ({type(target).__name__}) is not "
        f"found in the model ({type(root).__name__})."
    )


@functools.cache
def _marking(cls: type, name: str, inputs: bool, reduce: str | None) -> type:
    """`cls` with a `__call__` that marks its output (and, with `inputs`, its inputs) as
    `name`. (Made once per class and name, and keyed by nothing else: a selection's `of=`
    model is not kept alive by it.)"""
    original = cls.__call__

    def __call__(self, *args, **kwargs):  # noqa: N807
        called = _CALLED.get()
        if called is not None:
            called.add(name)
        if inputs and kwargs:  # (the inputs are marked as the call has them)
            args, kwargs = save_inter((args, kwargs), name=f"{name}.in", reduce=reduce)
        elif inputs and len(args) == 1:
            args = (save_inter(args[0], name=f"{name}.in", reduce=reduce),)
        elif inputs:
            args = save_inter(args, name=f"{name}.in", reduce=reduce)
        return save_inter(original(self, *args, **kwargs), name=name, reduce=reduce)

    namespace = {"__call__": __call__, "__module__": cls.__module__, "_statax_marks": name}
    sub = type(cls)(cls.__name__, (cls,), namespace)
    sub.__qualname__ = cls.__qualname__
    return sub


# ---- Flax Linen modules: their scopes marked where they run ------------------------------------
#
# Linen runs each module method under a named scope of its path (`Model/Block_0`), and lets an
# interceptor run inside that scope (`nn.intercept_methods`). A selected scope that is a
# module's is marked there, on the method's output, as it runs: inside a `vmap` or a derivative
# as a `save_inter` at the end of the method would be. The program-level pass then skips it.

_LINEN_MARKED: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "statax_linen_marked", default=None
)


def _with_linen(call, chosen: tuple[Scopes, ...], tree, *args, **kwargs):
    linen = sys.modules.get("flax.linen")
    marked = _LINEN_MARKED.get()
    if linen is None or marked is None:
        return call(tree, *args, **kwargs)

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        stack = source_info_api.current_name_stack().stack
        names = [e.name for e in stack if not _is_transform(e)]
        path = "/".join(names)
        for selection in chosen:
            region = _scope_region(selection.patterns, stack)
            if region is not None and region[0] == path:  # this module's own scope
                marked.add(path)
                return mark_as(out, path, _outside_libraries(), selection.reduce)
        return out

    with linen.intercept_methods(interceptor):
        return call(tree, *args, **kwargs)


@contextlib.contextmanager
def linen_marked(chosen: tuple[Selection, ...]):
    """Within, the Linen modules whose scopes `chosen` selects are marked as they run; yields
    `chosen` as a function of nothing, for once they have run: its scope selections then skip
    the scopes marked so."""
    marked: set = set()
    token = _LINEN_MARKED.set(marked)
    try:
        yield lambda: tuple(
            dataclasses.replace(s, marked=frozenset(marked)) if isinstance(s, Scopes) else s
            for s in chosen
        )
    finally:
        _LINEN_MARKED.reset(token)


_LIBRARIES = ("/flax/", "/jax/", "/statax/", "/equinox/", "/contextlib.py")


def _outside_libraries() -> str:
    """`"file:line"` of the innermost frame outside Flax, JAX, equinox and statax."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _LIBRARIES):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ---- places in the program --------------------------------------------------------------------


def _with_places(call, chosen: tuple[Selection, ...], tree, *args, **kwargs):
    from ._pull import flat_function  # (`_pull` calls this module)

    leaves, treedef = jax.tree_util.tree_flatten((tree, args, kwargs))
    dynamic = [eqx.is_array(x) for x in leaves]
    out_info: list = []
    flat = flat_function(call, leaves, treedef, dynamic, out_info)
    arrays = [x for x, d in zip(leaves, dynamic, strict=True) if d]
    with linen_marked(chosen) as after_marking:
        closed = _compat.trace(flat, [jax.typeof(x) for x in arrays], name="select")
    _check_found((closed.jaxpr if _compat.wraps_jaxpr(closed) else closed).eqns, chosen)
    chosen = after_marking()
    outs = iter(_evaluate(closed.jaxpr, closed.consts, arrays, (), chosen))
    out_def, static = out_info[0]
    full = [next(outs) if s is None else s[0] for s in static]
    return jax.tree_util.tree_unflatten(out_def, full)


@dataclasses.dataclass
class _Plan:
    """What `_evaluate` does in one jaxpr: marks after equations (`(name, vars, location,
    reduce)` each) and the selections that go on inside equations (`(stack, selections)`)."""

    after: dict[int, list]
    inside: dict[int, tuple[tuple, tuple]]


def _evaluate(jaxpr, consts, args, stack: tuple, chosen: tuple) -> list:
    """Evaluate `jaxpr` in the current trace, with the selected values marked."""
    plan = _plan(jaxpr.eqns, jaxpr.outvars, stack, chosen)
    reached = {id(jaxpr.eqns[i]): inside for i, inside in plan.inside.items()}

    def step(eqn, invals):
        inside = reached.get(id(eqn))
        if inside is None:
            return bind_equation(eqn, invals)
        again = functools.partial(_again, stack=inside[0], chosen=inside[1])
        return bind_equation(eqn, invals, map_jaxprs(eqn.params, again))

    def after(i, eqn, env):
        for name, variables, location, reduce in plan.after.get(i, ()):
            variables = eqn.outvars if variables is None else variables
            values = [env[v] if isinstance(v, jex.Var) else v.val for v in variables]
            one = len(values) == 1
            marked = mark_as(values[0] if one else tuple(values), name, location, reduce)
            env.update(zip(variables, [marked] if one else marked, strict=True))

    return evaluate(jaxpr, consts, args, step, after)


def _again(sub, *, stack: tuple, chosen: tuple):
    """`sub` (a jaxpr in an equation's params) evaluated again with its selected values
    marked, traced in the current context."""
    closed = sub if isinstance(sub, jex.ClosedJaxpr) else jex.ClosedJaxpr(sub, ())
    new = _compat.trace(
        lambda *args: _evaluate(closed.jaxpr, closed.consts, args, stack, chosen),
        closed.in_avals,
        name="select",
    )
    if isinstance(sub, jex.ClosedJaxpr):
        return new
    assert not new.consts, "an open jaxpr evaluated again closes over nothing"
    return new.jaxpr


def _stack_of(stack: tuple, eqn) -> tuple:
    return (*stack, *eqn.source_info.name_stack.stack)


def _plan(eqns: Sequence, outvars: Sequence, stack: tuple, chosen: tuple) -> _Plan:
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                last_use[v] = i
    returned = {v for v in outvars if isinstance(v, jex.Var)}
    after: dict[int, list] = {}
    outside: list[set[int]] = []  # per selection, the equations outside its regions
    for selection in chosen:
        if isinstance(selection, Primitives):
            for i, eqn in enumerate(eqns):
                if eqn.primitive.name in selection.names:
                    _refuse_transformed(selection, eqn, _stack_of(stack, eqn))
                    # (its outputs, `None`: any it drops are given variables where marked)
                    entry = (eqn.primitive.name, None, _location(eqn), selection.reduce)
                    after.setdefault(i, []).append(entry)
            outside.append(set(range(len(eqns))))
            continue
        regions = _regions(selection, stack, eqns)
        outside.append({i for i, r in enumerate(regions) if r is None})
        for start, end in _runs(regions):
            name, transformed = regions[start]
            made = [v for eqn in eqns[start : end + 1] for v in eqn.outvars]
            leaving = [v for v in made if last_use.get(v, -1) > end or v in returned]
            if not leaving:
                continue
            if transformed:
                _refuse_transformed(selection, eqns[end], _stack_of(stack, eqns[end]))
                # (a line's region: the transformation may be inside it, or around it)
            entry = (name, leaving, _location(eqns[end]), selection.reduce)
            after.setdefault(end, []).append(entry)
    for entries in after.values():  # an inner scope's mark before an outer one's, at one place
        entries.sort(key=lambda e: -e[0].count("/"))
    inside = {}
    for i, eqn in enumerate(eqns):
        if not _holds_jaxprs(eqn.params):
            continue
        subs = list(_compat.jaxprs_in_params(eqn.params))
        going_on = tuple(s for s, out in zip(chosen, outside, strict=True) if i in out)
        inner_stack = _stack_of(stack, eqn)
        if going_on and any(_matches_in(sub, inner_stack, going_on) for sub in subs):
            if not flags_for(eqn).selectable:  # (declared where its handler is registered)
                raise SelectionError(
                    f"{_describe(going_on)} selects values inside `{eqn.primitive}` (at "
                    f"{_location(eqn)}), which a selection does not reach into. Select the "
                    "values around it, or mark them by hand with stx.save_inter."
                )
            inside[i] = (inner_stack, going_on)
    return _Plan(after, inside)


_JAXPR_TYPES = (jex.Jaxpr, jex.ClosedJaxpr)


def _holds_jaxprs(params) -> bool:
    """Whether an equation's params hold a jaxpr (alone or in a tuple): `jaxprs_in_params`'s
    test, without its generator."""
    for value in params.values():
        if isinstance(value, _JAXPR_TYPES) or (
            type(value) is tuple and any(isinstance(v, _JAXPR_TYPES) for v in value)
        ):
            return True
    return False


def _regions(selection, stack: tuple, eqns: Sequence) -> list:
    """`_region` of each of `eqns`; for scopes, once per name stack (equations made in one
    scope share it)."""
    if not isinstance(selection, Scopes):
        return [_region(selection, stack, eqn) for eqn in eqns]
    seen: dict[int, Any] = {}
    regions = []
    for eqn in eqns:
        names = eqn.source_info.name_stack
        key = id(names)
        if key not in seen:
            seen[key] = (names, selection.region((*stack, *names.stack)))  # (names: kept alive)
        regions.append(seen[key][1])
    return regions


def _region(selection, stack: tuple, eqn) -> tuple[str, bool] | None:
    full = _stack_of(stack, eqn)
    if isinstance(selection, Scopes):
        return selection.region(full)
    name = selection.region(eqn)
    return None if name is None else (name, any(_is_transform(e) for e in full))


def _runs(regions: list) -> Iterator[tuple[int, int]]:
    """`(start, end)` of each run of equations in one region, one after the other."""
    start = None
    for i, region in enumerate([*regions, None]):
        if start is not None and (region is None or region[0] != regions[start][0]):
            yield start, i - 1
            start = None
        if region is not None and start is None:
            start = i


def _matches_in(jaxpr, stack: tuple, chosen: tuple) -> bool:
    """Whether any equation of `jaxpr` (at any depth) is selected."""
    return any(
        eqn.primitive.name in selection.names
        if isinstance(selection, Primitives)
        else _region(selection, outer, eqn) is not None
        for outer, eqn in _walk(jaxpr, stack)
        for selection in chosen
    )


def _is_transform(element) -> bool:
    """Whether a name stack's element is a transformation (`vmap`, `jvp`, `transpose`) rather
    than a scope (`jax._src.source_info_util.Transform` and `Scope`, JAX 0.8 -- 0.12)."""
    return type(element).__name__ == "Transform"


@functools.lru_cache(maxsize=4096)
def _scope_region(patterns: tuple[str, ...], stack: tuple) -> tuple[str, bool] | None:
    names: list[str] = []
    transformed = False
    for element in stack:
        if _is_transform(element):
            transformed = True
            continue
        names.append(element.name)
        path = "/".join(names)
        if any(fnmatch.fnmatchcase(path, p) for p in patterns):
            return path, transformed
    return None


def _same_file(file_name: str, file: str) -> bool:
    return file_name == file or file_name.endswith("/" + file.lstrip("/"))


def _location(eqn) -> str:
    """`"file:line"` of the user's code that made `eqn` (kept per traceback's frames: a program
    traced again makes its equations at the same places)."""
    traceback = eqn.source_info.traceback
    codes, lastis = ([], []) if traceback is None else traceback.raw_frames()
    # (Keyed by the code objects' ids, which the entry keeps alive: a code object's own hash
    # reads its contents.)
    key = (*map(id, codes), *lastis)
    hit = _LOCATIONS.get(key)
    if hit is None:
        match = re.match(r"(.*?):(\d+)", source_info_api.summarize(eqn.source_info))
        hit = _LOCATIONS[key] = ("<unknown>" if match is None else f"{match[1]}:{match[2]}", codes)
        if len(_LOCATIONS) > 4096:
            _LOCATIONS.clear()
    return hit[0]


_LOCATIONS: dict = {}


def _refuse_transformed(selection, eqn, stack: tuple) -> None:
    transforms = [e.name for e in stack if _is_transform(e)]
    if not transforms:
        return
    raise SelectionError(
        f"{selection} selects a value (at {_location(eqn)}) that the function computes under "
        f"{' of '.join(f'`{t}`' for t in transforms)}, applied inside it: there the value is "
        "already transformed (batched along an axis a mark would not put first, or beside its "
        "tangent), so no mark at that place would see it. Where you apply the transformation, "
        "apply it outside the pull (`jax.vmap(stx.pull(f, at=...))`, "
        "`jax.grad(stx.pull(f, at=...), has_aux=True)`); where a library applies it (a solver "
        "differentiating your function), mark the value with stx.save_inter. Or select the "
        "submodule with stx.modules, which marks it where it runs."
    )


def _describe(chosen: Sequence[Selection]) -> str:
    return " and ".join(map(str, chosen))


# ---- or marks put into a traced program (what `pull` does with them) ---------------------------


# For `pull` (nothing planted, no `ran=`), cheaper than evaluating the program again (`calling`):
# a pass over the equations `pull` traced. A value selected at the pull's own level is handed to
# its `Collector`, as a `save_inter` there hands its value; one further in (a loop body, a
# branch, a `jit`) gets a collecting mark in the jaxpr there, as a `save_inter` would have bound.


def collected(closed, marks: list, chosen: tuple) -> tuple[Any, list]:
    """`(closed, marks)`, a jaxpr `pull` traced and what its `Collector` took, with the
    places `chosen` selects marked."""
    jaxpr = closed.jaxpr if _compat.wraps_jaxpr(closed) else closed
    num_out = len(jaxpr.outvars) - sum(m.num_arrays for _, m in marks)
    top, rewritten = _collect(jaxpr.eqns, jaxpr.outvars[:num_out], chosen)
    if not top and not rewritten:
        return closed, marks
    merged = _merged(marks, jaxpr.outvars[num_out:], top)
    eqns = [rewritten.get(i, eqn) for i, eqn in enumerate(jaxpr.eqns)]
    new = jaxpr.replace(
        eqns=eqns,
        outvars=[*jaxpr.outvars[:num_out], *(v for _, _, vs in merged for v in vs)],
        effects=set(jaxpr.effects).union(*(e.effects for e in rewritten.values())),
    )
    if _compat.wraps_jaxpr(closed):
        new = jex.ClosedJaxpr(new, closed.consts)
    return new, [(p, m) for p, m, _ in merged]


def collected_staged(trace, start: int, outs: Sequence, collector, chosen: tuple) -> None:
    """`collected` for a function `pull` traced straight into `trace` from `start` on
    (`_staging.staging_trace`): the selected values at its level go to `collector`, the
    equations that hold others are restaged with their marks."""
    eqns = [_staging.as_equation(e) for e in _staging.staged_as_held(trace, start)]
    returned = [v for v in (_staging.var_of(trace, x) for x in outs) if v is not None]
    top, rewritten = _collect(eqns, returned, chosen)
    if rewritten:
        staged = _staging.staged(trace, start)
        new = [rewritten.get(i, eqn) for i, (eqn, _) in enumerate(staged)]
        _staging.restage(trace, start, new, staged)
    if not top:
        return
    found = [(start + p, m, [_staging.tracer_of(trace, v) for v in vs]) for p, m, vs in top]
    merged = _merged(collector.marks, collector.leaves, found)
    collector.marks[:] = [(p, m) for p, m, _ in merged]
    collector.leaves[:] = [x for _, _, xs in merged for x in xs]


def _merged(marks: Sequence, leaves: Sequence, found: list) -> list:
    """`(position, meta, leaves)` of a `Collector`'s `marks` (their `leaves` flat) and of the
    marks `found` at the same level, in program order (the collector's first at a position)."""
    it = iter(leaves)
    given = [(p, m, [next(it) for _ in range(m.num_arrays)]) for p, m in marks]
    return sorted([*given, *found], key=lambda mark: mark[0])


def _collect(eqns: Sequence, returned: Sequence, chosen: tuple) -> tuple[list, dict]:
    """`(top, rewritten)`: the marks at this level, `(position, meta, variables)` (`position`:
    how many equations precede them), and the equations that hold others, by index."""
    _check_found(eqns, chosen)
    plan = _plan(eqns, returned, (), chosen)
    selection = _compat.SELECTION.value  # `pull(fn, only=...)`: the marks it collects
    top = []
    for i, entries in sorted(plan.after.items()):
        for name, variables, location, reduce in entries:
            variables = eqns[i].outvars if variables is None else variables
            meta = _meta_of(name, len(variables), location, reduce)
            if selection is None or selection(meta):
                top.append((i + 1, meta, list(variables)))
    if any(
        _staging.dropped(v) for _, _, vs in top for v in vs
    ):  # an output nothing reads: no value
        raise SelectionError(
            f"{_describe(chosen)} selects an output of a primitive that the program drops; "
            "select the values around it."
        )
    rewritten = {i: _with_marks_inside(eqns[i], inside) for i, inside in plan.inside.items()}
    return top, rewritten


@functools.lru_cache(maxsize=4096)
def _meta_of(name: str, n: int, location: str, reduce) -> StateMeta:
    """The meta of a selected place's mark (made once: metas are immutable)."""
    treedef = _LEAF if n == 1 else jax.tree_util.tree_structure(tuple(range(n)))
    return StateMeta(name, treedef, (ARRAY,) * n, location, reduce=reduce)


def _with_marks_inside(eqn, inside: tuple):
    """`eqn` with its jaxprs marked inside (`inside`: `(stack, selections)`)."""
    params = map_jaxprs(eqn.params, lambda sub: _rebuilt(sub, *inside))
    subs = _compat.jaxprs_in_params(params)
    if any(_compat.SAVE_EFFECT in sub.effects for sub in subs):
        return eqn.replace(params=params, effects=eqn.effects | _SAVE_EFFECTS)
    return eqn.replace(params=params)


def _rebuilt(sub, stack: tuple, chosen: tuple):
    if _compat.wraps_jaxpr(sub):
        return jex.ClosedJaxpr(_inserted(sub.jaxpr, stack, chosen), sub.consts)
    return _inserted(sub, stack, chosen)  # an open jaxpr (or one with its consts, JAX 0.11+)


def _inserted(jaxpr, stack: tuple, chosen: tuple):
    """`jaxpr` (open) with a collecting mark after each selected place, read downstream."""
    plan = _plan(jaxpr.eqns, jaxpr.outvars, stack, chosen)
    if not plan.after and not plan.inside:
        return jaxpr
    selection = _compat.SELECTION.value  # `pull(fn, only=...)`: the marks it collects
    reached = {id(jaxpr.eqns[i]): inside for i, inside in plan.inside.items()}
    outputs_marked = {
        id(jaxpr.eqns[i])
        for i, after in plan.after.items()
        if any(variables is None for _, variables, _, _ in after)  # a primitive's outputs
    }

    def step(eqn, invars, emit):
        new = eqn
        inside = reached.get(id(eqn))
        if inside is not None:
            new = _with_marks_inside(eqn, inside)
        if id(eqn) in outputs_marked:  # (given variables where it drops them)
            new = new.replace(
                outvars=[jex.Var(v.aval) if _staging.dropped(v) else v for v in eqn.outvars]
            )
        return keep(new, invars, emit)

    def after(i, eqn, env, emit):
        for name, variables, location, reduce in plan.after.get(i, ()):
            variables = eqn.outvars if variables is None else variables
            values = [env[v] if isinstance(v, jex.Var) else v for v in variables]
            meta = _meta_of(name, len(values), location, reduce)
            if selection is not None and not selection(meta):
                continue  # not collected: no mark at all
            outs = [jex.Var(v.aval) for v in values]
            params = {"meta": meta, "status": COLLECTING}
            emit(_compat.new_equation(values, outs, save_inter_p, params, _SAVE_EFFECTS))
            env.update(zip(variables, outs, strict=True))

    eqns, outvars = rewrite(jaxpr, step, after)
    effects = set(jaxpr.effects).union(*(e.effects for e in eqns))
    return jaxpr.replace(eqns=eqns, outvars=outvars, effects=effects)


# ---- nothing matched ---------------------------------------------------------------------------


def _wanted(selection) -> list:
    if isinstance(selection, Primitives):
        return sorted(selection.names)
    if isinstance(selection, Scopes):
        return list(selection.patterns)
    return list(selection.places)


def _check_found(eqns: Sequence, chosen: tuple) -> None:
    """Raise where a pattern, primitive or place of `chosen` matches nothing in `eqns` (at
    any depth)."""
    found: set = set()
    wanted = sum(len(_wanted(s)) for s in chosen)
    for stack, eqn in _walk_eqns(eqns, ()):
        if len(found) == wanted:
            return
        for selection in chosen:
            if isinstance(selection, Primitives):
                if eqn.primitive.name in selection.names:
                    found.add((selection, eqn.primitive.name))
            elif isinstance(selection, Scopes):
                full = _stack_of(stack, eqn)
                for pattern in selection.patterns:
                    if _scope_region((pattern,), full) is not None:
                        found.add((selection, pattern))
            else:
                for file, line in selection.places:
                    if Lines(((file, line),)).region(eqn) is not None:
                        found.add((selection, (file, line)))
    for selection in chosen:
        missing = [w for w in _wanted(selection) if (selection, w) not in found]
        if missing:
            _nothing_found(selection, missing[0], eqns)


def _walk_eqns(eqns: Sequence, stack: tuple) -> Iterator[tuple[tuple, Any]]:
    for eqn in eqns:
        yield stack, eqn
        for sub in _compat.jaxprs_in_params(eqn.params):
            yield from _walk(sub, _stack_of(stack, eqn))


def _walk(jaxpr, stack: tuple) -> Iterator[tuple[tuple, Any]]:
    jaxpr = jaxpr.jaxpr if _compat.wraps_jaxpr(jaxpr) else jaxpr
    yield from _walk_eqns(jaxpr.eqns, stack)


def _nothing_found(selection, wanted, eqns) -> None:
    if isinstance(selection, Primitives):
        what, there = f"primitive {wanted!r}", {e.primitive.name for _, e in _walk_eqns(eqns, ())}
        kind = "primitives"
    elif isinstance(selection, Scopes):
        there = set()
        for stack, eqn in _walk_eqns(eqns, ()):
            names = [e.name for e in _stack_of(stack, eqn) if not _is_transform(e)]
            there.update("/".join(names[: k + 1]) for k in range(len(names)))
        what, kind = f"scope {wanted!r}", "scopes"
    else:
        wanted = f"{wanted[0]}:{wanted[1]}"
        there = {_short(_location(e)) for _, e in _walk_eqns(eqns, ())} - {"<unknown>"}
        what, kind = f"line {wanted!r}", "lines (where each equation was made)"
    listed = closest(wanted, sorted(there)) if there else "none"
    raise SelectionError(
        f"{selection}: no {what} in the program. The {kind} there, closest first: {listed}."
    )


def _short(location: str) -> str:
    file, _, line = location.rpartition(":")
    return f"{file.rsplit('/', 1)[-1]}:{line}"


def closest(wanted: str, options: Sequence[str], n: int = 8) -> str:
    """`options`, the closest to `wanted` first (at most `n`, then how many more)."""
    ranked = sorted(
        options, key=lambda o: -difflib.SequenceMatcher(None, wanted.lower(), o.lower()).ratio()
    )
    shown = ", ".join(map(repr, ranked[:n]))
    return shown + (f" (and {len(ranked) - n} more)" if len(ranked) > n else "")

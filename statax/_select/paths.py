"""Paths into a model (`"blocks[0].attn"`): which objects are models, where paths start from,
the objects a path names, and every model's path (what `stx.sites` lists).
"""

from __future__ import annotations

import functools
import re
import sys
import types
from typing import Any

import equinox as eqx
import jax

from .._core.errors import SelectionError
from .report import closest

__all__ = [
    "children",
    "is_leaf",
    "is_module",
    "join",
    "model_roots",
    "module_paths",
    "path_of",
    "resolve",
    "resolve_in",
]


def module_paths(root, limit: int = 4096) -> list[str]:
    """The paths (`"blocks[0].mlp"`) of the callable models inside `root`, outermost first,
    as `stx.modules` takes them: what `stx.sites` lists."""
    paths, seen, queue = [], {id(root)}, [("", root)]
    while queue and len(paths) < limit:
        name, obj = queue.pop(0)
        for child, value in children(obj):
            if id(value) in seen or isinstance(value, (str, int, float, jax.Array)):
                continue
            seen.add(id(value))
            path = join(name, child)
            if is_module(value):
                paths.append(path)
            queue.append((path, value))
    return paths


def is_module(x) -> bool:
    """Whether `x` is a model: an `eqx.Module`, a Flax NNX module (not one of its variables),
    or another callable object that is a pytree node (a penzai layer, a dataclass registered
    with `jax.tree_util`), not a function."""
    if isinstance(x, eqx.Module):
        return True
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(x, nnx.Module):
        return True
    return callable(x) and not isinstance(x, _NOT_MODELS) and not is_leaf(x)


_NOT_MODELS = (type, types.FunctionType, types.MethodType, functools.partial, jax.tree_util.Partial)


def is_leaf(x) -> bool:
    """Whether `x` is a pytree leaf (no node JAX's registry knows)."""
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def model_roots(fn, tree, args, kwargs) -> list:
    """The models paths may start from: the callable where it is a module (or a method of
    one, or wraps one, as `jax.vmap(model)` does), then the arguments that are."""
    wrapped = []
    while fn is not None and len(wrapped) < 8:
        wrapped.append(fn)
        fn = getattr(fn, "__self__", None) or getattr(fn, "__wrapped__", None)
    roots = [c for c in (tree, *wrapped, *args, *kwargs.values()) if is_module(c)]
    if roots:
        return list({id(r): r for r in roots}.values())
    raise SelectionError(
        "stx.modules found no model to start its paths from: neither the function nor any of "
        "its arguments is an eqx.Module or a Flax NNX module. Pass the model as `of=`: "
        "stx.modules('blocks[0]', of=model)."
    )


def resolve_in(roots: list, path) -> list[tuple[str, Any]]:
    """`resolve` in the first of `roots` where `path` is found (a `filter_jit` wrapper is a
    module too, but not the model); where it is in none, the last one's error."""
    for i, root in enumerate(roots):
        try:
            return resolve(root, path)
        except SelectionError:
            if i == len(roots) - 1:
                raise
    return []


_TOKEN = re.compile(r"\[([^\]]*)\]|([^.\[\]/]+)")


def resolve(root, path) -> list[tuple[str, Any, tuple]]:
    """`[(name, object, (parent, key))]` that `path` selects in `root`: where the object is
    held (`(None, None)` for the root, or for an object a function of the model gave)."""
    if callable(path) and not isinstance(path, str):
        found = path(root)
        objs = found if isinstance(found, (list, tuple)) else [found]
        return [(path_of(root, obj), obj, (None, None)) for obj in objs]
    found = [("", root, (None, None))]
    for match in _TOKEN.finditer(path):
        step = match[1] if match[1] is not None else match[2]
        found = [item for name, obj, _ in found for item in step_into(name, obj, step, path)]
    return found


def children(obj) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)) or (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")):
        try:
            return [(f"[{i}]", obj[i]) for i in range(len(obj))]
        except (TypeError, KeyError):
            pass
    fields = getattr(obj, "__dict__", {})
    return [(f".{k}", v) for k, v in fields.items() if not k.startswith("_")]


def step_into(name: str, obj, step: str, path: str) -> list[tuple[str, Any, tuple]]:
    held = children(obj)
    if step == "*":
        items = [(join(name, c), v, (obj, c)) for c, v in held if not c.startswith(".")]
        if items:
            return items
        raise SelectionError(
            f"stx.modules({path!r}): '*' selects the items of a list, tuple or dict, and "
            f"{type(obj).__name__} at {name or 'the model'!r} is none. Name one of its fields: "
            f"{closest(join(name, '.'), [join(name, c) for c, _ in held])}."
        )
    for child, value in held:
        if child in (f".{step}", f"[{step}]", f"['{step}']"):
            return [(join(name, child), value, (obj, child))]
    if not isinstance(obj, (dict, list, tuple)) and hasattr(obj, step):  # a property, a field
        return [(join(name, f".{step}"), getattr(obj, step), (None, None))]
    options = [join(name, c) for c, _ in held]
    raise SelectionError(
        f"stx.modules({path!r}): {type(obj).__name__} at {name or 'the model'!r} has no "
        f"{step!r}. There is: {closest(join(name, '.' + step), options)}."
    )


def join(name: str, child: str) -> str:
    return (name + child).lstrip(".")


def path_of(root, target) -> str:
    """The path of `target` in `root` (for a `where` function's result), breadth first."""
    seen, queue = {id(root)}, [("", root)]
    while queue:
        name, obj = queue.pop(0)
        if obj is target:
            return name or "model"
        for child, value in children(obj):
            if id(value) not in seen and not isinstance(value, (str, int, float, jax.Array)):
                seen.add(id(value))
                queue.append((join(name, child), value))
    raise SelectionError(
        f"stx.modules: the object the function returned ({type(target).__name__}) is not "
        f"found in the model ({type(root).__name__})."
    )

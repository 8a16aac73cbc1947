"""Where an equation is: its scope path (name stack) and its source line, as selections match
them and errors show them.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend import core as jex
from jax.extend import source_info_util as source_info_api

from .._core.registry import rules_for
from .._core.tracebacks import place
from .._jax import jaxprs as _jaxprs


def stack_of(stack: tuple, eqn) -> tuple:
    return (*stack, *eqn.source_info.name_stack.stack)


_JAXPR_TYPES = (jex.Jaxpr, jex.ClosedJaxpr)


def holds_jaxprs(params) -> bool:
    """Whether an equation's params hold a jaxpr (alone or in a tuple, or in a named tuple, as
    `custom_linear_solve` keeps its functions): `jaxprs_in_params`'s test, without its
    generator."""
    for value in params.values():
        if isinstance(value, _JAXPR_TYPES) or (
            isinstance(value, tuple) and any(isinstance(v, _JAXPR_TYPES) for v in value)
        ):
            return True
    return False


def is_transform(element) -> bool:
    """Whether a name stack's element is a transformation (`vmap`, `jvp`, `transpose`) rather
    than a scope (`jax._src.source_info_util.Transform` and `Scope`, JAX 0.8 -- 0.12)."""
    return type(element).__name__ == "Transform"


@functools.lru_cache(maxsize=4096)
def scope_region(patterns: tuple[str, ...], stack: tuple) -> tuple[str, bool] | None:
    """`(path, transformed)` of the outermost scope of `stack` (a name stack's elements) that
    one of `patterns` matches, and whether a transformation encloses it; else `None`."""
    names: list[str] = []
    enclosed: list[bool] = []  # per name: whether a transformation comes before it
    transformed = False
    for element in stack:
        if is_transform(element):
            transformed = True
        else:
            names.append(element.name)
            enclosed.append(transformed)
    k = _outermost(patterns, names)
    return None if k is None else ("/".join(names[:k]), enclosed[k - 1])


def outermost_match(patterns: tuple[str, ...], names: list[str]) -> str | None:
    """The outermost path of `names` (a scope path's parts) that one of `patterns` matches."""
    k = _outermost(patterns, names)
    return None if k is None else "/".join(names[:k])


def _outermost(patterns: tuple[str, ...], names: list[str]) -> int | None:
    """How many of `names` the outermost path that one of `patterns` matches has."""
    for k in range(1, len(names) + 1):
        path = "/".join(names[:k])
        if any(fnmatch.fnmatchcase(path, p) for p in patterns):
            return k
    return None


def same_file(file_name: str, file: str) -> bool:
    return file_name == file or file_name.endswith("/" + file.lstrip("/"))


def location_of(eqn) -> str:
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
        where = "<unknown>" if match is None else place(match[1], int(match[2]))
        hit = _LOCATIONS[key] = (where, codes)
        if len(_LOCATIONS) > 4096:
            _LOCATIONS.clear()
    return hit[0]


_LOCATIONS: dict = {}


def walk_eqns(eqns: Sequence, stack: tuple) -> Iterator[tuple[tuple, Any]]:
    for stack_, eqn, _ in walk_counted(eqns, stack, None):
        yield stack_, eqn


def walk_counted(
    eqns: Sequence, stack: tuple = (), trips: int | None = 1
) -> Iterator[tuple[tuple, Any, int | None]]:
    """`(stack, eqn, trips)` of every equation at any depth, `stack` the name stack's elements
    around it and `trips` the product of the iterations of the loops around it
    (its record's `trips`; `None` inside a `while_loop`, or where `trips` is `None`: not
    counted)."""
    for eqn in eqns:
        yield stack, eqn, trips
        inner = None
        for sub in _jaxprs.jaxprs_in_params(eqn.params):
            if inner is None and trips is not None:
                count = rules_for(eqn).runs_of(eqn)
                inner = None if count is None else trips * count
            sub = sub.jaxpr if _jaxprs.wraps_jaxpr(sub) else sub
            yield from walk_counted(sub.eqns, stack_of(stack, eqn), inner)


def walk(jaxpr, stack: tuple) -> Iterator[tuple[tuple, Any]]:
    jaxpr = jaxpr.jaxpr if _jaxprs.wraps_jaxpr(jaxpr) else jaxpr
    yield from walk_eqns(jaxpr.eqns, stack)


def short_place(location: str) -> str:
    """`"file.py:42"` of a `"/path/to/file.py:42"`; a notebook cell's place as it is."""
    if location.startswith("Cell In["):
        return location
    file, _, line = location.rpartition(":")
    return f"{file.rsplit('/', 1)[-1]}:{line}"


_LIBRARIES = (
    "/flax/",
    "/jax/",
    "/statax/",
    "/equinox/",
    "/keras/",
    "/penzai/",
    "/transformers/",
    "/contextlib.py",
)


def outside_libraries() -> str:
    """`"file:line"` of the innermost frame outside statax, JAX and the model libraries."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _LIBRARIES):
        frame = frame.f_back
    return "<unknown>" if frame is None else place(frame.f_code.co_filename, frame.f_lineno)

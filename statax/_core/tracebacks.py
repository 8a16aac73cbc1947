"""Tracebacks that lead with the user's line and the message: statax hides its own frames, as
JAX and equinox hide theirs.

JAX removes the frames of its own files, and of any path registered with
`register_exclusion`, from the traceback of an exception that leaves a function wrapped by
`api_boundary` (`JAX_TRACEBACK_FILTERING=off` keeps them all). statax registers its package
and wraps the callables users call (what `pull`, `plant`, `grad_inters` and `stateful`
return). `save_inter` is not wrapped: it is on the hot path of tracing, and an error it raises
passes through one of those boundaries, or through `jax.jit`'s, or is two frames deep.

Private names (`jax._src.traceback_util`, checked on JAX 0.8.0 -- 0.12.0.1): `register_exclusion`,
`api_boundary`. Where either is missing, tracebacks are left whole.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

try:
    from jax._src.traceback_util import api_boundary as _api_boundary
    from jax._src.traceback_util import register_exclusion as _register_exclusion
except ImportError:  # pragma: no cover - not in any supported JAX
    _api_boundary = _register_exclusion = None

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # statax/


def boundary(fn: F) -> F:
    """`fn`, wrapped so that an exception leaving it shows no frames of statax or JAX."""
    return fn if _api_boundary is None else _api_boundary(fn)


if _register_exclusion is not None:
    _register_exclusion(PACKAGE)


def place(file: str, line: int) -> str:
    """`"file:line"`, or in a notebook, for code typed into a cell, `"Cell In[3], line 6"`, as
    IPython's own tracebacks show it (its public `compile.format_code_name`; the file that
    IPython gives a cell, `/tmp/ipykernel_.../2730016506.py`, means nothing to a user)."""
    cell = cell_of(file)
    return f"{file}:{line}" if cell is None else f"{cell}, line {line}"


@functools.lru_cache(maxsize=1024)
def cell_of(file: str) -> str | None:
    """`"Cell In[3]"` for a file IPython made of a cell, else `None` (once per file: a file is
    a cell's from the moment it exists)."""
    ipython = sys.modules.get("IPython")  # (never imported here: a notebook has it already)
    shell = ipython.get_ipython() if ipython is not None else None
    named = getattr(getattr(shell, "compile", None), "format_code_name", None)
    label = named(file) if named is not None else None
    return None if not label else f"{label[0]} {label[1]}"

"""A function called with its selections made: objects swapped for marking subclasses, Linen
modules intercepted, places in the program marked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .keras import with_keras
from .linen import with_linen
from .objects import with_modules
from .places import with_places
from .vocabulary import Modules, Scopes, Selection

__all__ = ["calling"]


def calling(call: Callable, at: tuple[Selection, ...], *, objects: bool, fn=None) -> Callable:
    """`call(tree, *args, **kwargs)` (which calls `fn`) with the selections of one kind made:
    by object (`objects=True`, where the live objects are: inside Flax NNX's merge) or in the
    program."""
    if objects:
        scopes = tuple(s for s in at if isinstance(s, Scopes))
        if scopes:
            call = functools.partial(with_linen, call, scopes)
            call = functools.partial(with_keras, call, scopes)
        chosen = tuple(s for s in at if isinstance(s, Modules))
        return call if not chosen else functools.partial(with_modules, call, chosen, fn)
    chosen = tuple(s for s in at if not isinstance(s, Modules))
    return call if not chosen else functools.partial(with_places, call, chosen)

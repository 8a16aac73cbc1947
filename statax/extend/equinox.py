"""What statax knows of equinox's private machinery (`equinox.internal`, equinox 0.13), for
handlers: its filter primitives and `vprim`s, `noinline`, and the masking of its loops' state.
Everything that reads equinox's private names lives in `statax._core.equinox_internals`, so that an
equinox release costs one module."""

from .._core.equinox_internals import *  # noqa: F403 (this namespace is that module's public names)
from .._core.equinox_internals import __all__ as __all__

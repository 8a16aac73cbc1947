"""What statax knows of equinox's private machinery (`equinox.internal`, equinox 0.13), for
handlers: its loops (`eqx.internal.while_loop`'s carry and per-example flag), its filter
primitives and `vprim`s, and `noinline`. Everything that reads equinox's private names lives in
`statax._equinox`, so that an equinox release costs one module."""

from .._equinox import *  # noqa: F403 (this namespace is that module's public names)
from .._equinox import __all__ as __all__

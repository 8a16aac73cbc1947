"""What statax knows of equinox's private machinery (`equinox.internal`, equinox 0.13), for
handlers: its loops (`eqx.internal.while_loop`'s carry and per-example flag), its filter
primitives and `vprim`s, and `noinline`. Everything that reads equinox's private names lives in
`statax._equinox`, so that an equinox release costs one module."""

from .._equinox import equinox_noinline as equinox_noinline
from .._equinox import impl_of as impl_of
from .._equinox import is_bounded_step as is_bounded_step
from .._equinox import is_equinox_primitive as is_equinox_primitive
from .._equinox import loop_running as loop_running
from .._equinox import select_if_vmap as select_if_vmap

__all__ = [
    "equinox_noinline",
    "impl_of",
    "is_bounded_step",
    "is_equinox_primitive",
    "loop_running",
    "select_if_vmap",
]

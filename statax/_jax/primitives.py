"""Where JAX keeps the primitives statax handles and that moved or stay private between
releases (JAX 0.8 -- 0.12): `jit`, `checkpoint`, `shard_map`, the hijax call.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex

__all__ = [
    "HI_PRIMITIVE",
    "JIT_PRIMITIVE",
    "REMAT_PRIMITIVE",
    "SHARD_MAP_PRIMITIVE",
    "UNSPECIFIED_SHARDING",
]


# `jit_p` (named "jit") since JAX 0.7; `pjit_p` before.
JIT_PRIMITIVE: jex.Primitive = getattr(jex.primitives, "jit_p", None) or jex.primitives.pjit_p
# `remat_p` is public in `jax.extend.core.primitives` since JAX 0.9.
REMAT_PRIMITIVE: jex.Primitive = getattr(jex.primitives, "remat_p", None)
if REMAT_PRIMITIVE is None:
    from jax._src.ad_checkpoint import remat_p as REMAT_PRIMITIVE  # noqa: N811
# `shard_map_p` is private in all supported versions.
from jax._src.shard_map import shard_map_p as SHARD_MAP_PRIMITIVE  # noqa: E402

# The sharding that leaves the choice to the compiler, used for the outputs `pull` adds to a jit.
from jax._src.sharding_impls import UNSPECIFIED as UNSPECIFIED_SHARDING  # noqa: E402

# JAX 0.11+ has "hijax" primitives: one `call_hi_primitive` equation whose `_prim` param is a
# Python object with its own params and rules (`lax.custom_root` is one since 0.11). None before.
try:
    from jax._src.hijax import call_hi_primitive_p as HI_PRIMITIVE  # JAX 0.11+
except ImportError:  # JAX 0.8 -- 0.10
    HI_PRIMITIVE = None


SymbolicZero = jax.custom_derivatives.SymbolicZero

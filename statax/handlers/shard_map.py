"""Handler for `shard_map` (`jax.shard_map`).

Reads `jaxpr` (the per-shard body), `mesh`, `in_specs`, `out_specs`, `check_vma` and the
manual axes. The pulled body returns each intermediate with a new leading axis of size 1,
varying over every manual mesh axis, and the shard_map returns it with the out spec
`P(manual_axes)` on that axis: one global array of shape `(num_shards, *local_shape)`, its
shards left where they are (nothing is gathered onto one device). Under `vmap` the batch axis
comes first, `(batch, num_shards, *local_shape)`, as `vmap(pull(f))` gives. `num_shards` is
the product of the sizes of the manual mesh axes (of all of them for a plain `jax.shard_map`),
in mesh order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.sharding import PartitionSpec

from .. import _compat, _reduce
from .._interpreter import (
    handler_from_exposer,
    pull_jaxpr,
    register_handler,
    split_leaves,
)


def _shard_map_exposer(*args, jaxpr, mesh, in_specs, out_specs, check_vma, **params):
    closed, metas = pull_jaxpr(jex.ClosedJaxpr(jaxpr, ()))
    num_out = len(jaxpr.outvars)
    manual = _compat.shard_map_manual_axes(mesh, params)
    axes = tuple(name for name in mesh.axis_names if name in manual)

    # Where a vmap inside batched a mark, its batch axes come first and the shard axis after.
    shard_axis = [m.batch_ndim for m in metas for _ in range(m.num_arrays)]

    def body(*local):
        flat = jex.jaxpr_as_fun(closed)(*local)
        leaves = [
            _compat.vary(jnp.expand_dims(x, k), axes)
            for x, k in zip(flat[num_out:], shard_axis, strict=True)
        ]
        return list(flat[:num_out]), leaves

    outs, leaves = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=(list(out_specs), [PartitionSpec(*[None] * k, axes) for k in shard_axis]),
        check_vma=check_vma,
        axis_names=frozenset(manual),
    )(*args)
    # A reduced name combines over the shards too.
    folded = [
        _reduce.fold_axis(m, part, m.batch_ndim) if m.accumulator and m.reduce else part
        for m, part in zip(metas, split_leaves(leaves, metas), strict=True)
    ]
    return outs, [x for part in folded for x in part], metas


register_handler(_compat.SHARD_MAP_PRIMITIVE, handler_from_exposer(_shard_map_exposer))

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
    pull_open_jaxpr,
    register_handler,
    split_leaves,
)


def _shard_map_exposer(*args, **params):
    jaxpr, mesh, in_specs, out_specs, check_vma, manual = _compat.shard_map_parts(params)
    # The body's occurrences of reduced names are folded inside the new shard_map (where its
    # collectives can be traced), not by pull_jaxpr.
    pulled, raw_metas = pull_open_jaxpr(jaxpr)
    metas = _merged_metas(raw_metas, pulled.outvars[len(jaxpr.outvars) :])
    num_out = len(jaxpr.outvars)
    axes = tuple(name for name in mesh.axis_names if name in manual)

    # Where a vmap inside batched a mark, its batch axes come first and the shard axis after.
    # A name reduced elementwise combines over the shards, with collectives: one value.
    per_shard = [
        None if _reduce.running(m) else m.batch_ndim for m in metas for _ in range(m.num_arrays)
    ]

    def body(*local):
        flat = jex.jaxpr_as_fun(jex.ClosedJaxpr(pulled, ()))(*local)
        _, merged = _reduce.merge(raw_metas, flat[num_out:])
        leaves = []
        for meta, part in zip(metas, split_leaves(merged, metas), strict=True):
            if _reduce.running(meta):
                leaves.extend(_reduce.across_shards(meta, part, axes))
            else:
                leaves.extend(_compat.vary(jnp.expand_dims(x, meta.batch_ndim), axes) for x in part)
        return list(flat[:num_out]), leaves

    specs = [PartitionSpec() if k is None else PartitionSpec(*[None] * k, axes) for k in per_shard]
    outs, leaves = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=(list(out_specs), specs),
        check_vma=check_vma,
        axis_names=frozenset(manual),
    )(*args)
    # "stack" and "collect" accumulators: the shards' occurrences, one after another.
    folded = [
        _reduce.fold_axis(m, part, m.batch_ndim) if _reduce.stacked(m) else part
        for m, part in zip(metas, split_leaves(leaves, metas), strict=True)
    ]
    return outs, [x for part in folded for x in part], metas


def _merged_metas(metas, leaf_vars):
    if not any(m.reduce for m in metas):
        return metas
    found = []
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in leaf_vars]
    jax.eval_shape(lambda *xs: found.append(_reduce.merge(metas, xs)[0]), *shapes)
    return found[0]


register_handler(_compat.SHARD_MAP_PRIMITIVE, handler_from_exposer(_shard_map_exposer))

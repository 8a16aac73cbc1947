"""Handler for `shard_map` (`jax.shard_map`).

Reads `jaxpr` (the per-shard body), `mesh`, `in_specs`, `out_specs`, `check_vma` and the
manual axes. The pulled body returns each intermediate with a new leading axis of size 1,
varying over every manual mesh axis, and the shard_map returns it with the out spec
`P(manual_axes)` on that axis: one global array of shape `(num_shards, *local_shape)`, its
shards left where they are (nothing is gathered onto one device). Under `vmap` the batch axis
comes first, `(batch, num_shards, *local_shape)`, as `vmap(pull(f))` gives. `num_shards` is
the product of the sizes of the manual mesh axes (of all of them for a plain `jax.shard_map`),
in mesh order. A planted value comes in the same way: one global array of shape
`(num_shards, *local_shape)`, each shard taking its own row.

Under `stateful`, state set inside is per shard in the same layout, and a later `shard_map`
reads each shard's row back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.sharding import PartitionSpec

from statax.extend import (
    SHARD_MAP_PRIMITIVE,
    Rules,
    bind,
    handler_from_exposer,
    mark,
    params,
    pull_open_jaxpr,
    reductions,
    register_handler,
    register_rules,
    split_leaves,
    take,
    vary,
)


def _shard_map_exposer(*args, **eqn_params):
    jaxpr, mesh, in_specs, out_specs, check_vma, manual = params.shard_map_parts(eqn_params)
    # The body's occurrences of reduced names are folded inside the new shard_map (where its
    # collectives can be traced), not by pull_jaxpr.
    pulled, raw_metas, ins = pull_open_jaxpr(jaxpr)
    metas = _merged_metas(raw_metas, pulled.outvars[len(jaxpr.outvars) :])
    num_out = len(jaxpr.outvars)
    axes = tuple(name for name in mesh.axis_names if name in manual)
    num_shards = math.prod(mesh.shape[name] for name in axes)

    # Where a vmap inside batched a mark, its batch axes come first and the shard axis after.
    # A name reduced elementwise combines over the shards, with collectives: one value.
    per_shard = [
        None if reductions.running(m) else m.batch_ndim for m in metas for _ in range(m.num_arrays)
    ]
    in_axis = [m.batch_ndim for m in ins for _ in range(m.num_arrays)]

    def body(*local):
        given = [jnp.squeeze(x, k) for x, k in zip(local[len(args) :], in_axis, strict=True)]
        flat = jex.jaxpr_as_fun(jex.ClosedJaxpr(pulled, ()))(*local[: len(args)], *given)
        _, merged = reductions.merge(raw_metas, flat[num_out:])
        leaves = []
        for meta, part in zip(metas, split_leaves(merged, metas), strict=True):
            if reductions.running(meta):
                leaves.extend(reductions.across_shards(meta, part, axes))
            else:
                leaves.extend(vary(jnp.expand_dims(x, meta.batch_ndim), axes) for x in part)
        return list(flat[:num_out]), leaves

    def spec(k):
        return PartitionSpec() if k is None else PartitionSpec(*[None] * k, axes)

    local_in = [x.aval for x in pulled.invars[len(args) :]]
    planted = take(
        ins,
        [
            jax.ShapeDtypeStruct((*a.shape[:k], num_shards, *a.shape[k:]), a.dtype)
            for a, k in zip(local_in, in_axis, strict=True)
        ],
    )
    outs, leaves = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*in_specs, *map(spec, in_axis)),
        out_specs=(list(out_specs), [spec(k) for k in per_shard]),
        check_vma=check_vma,
        axis_names=frozenset(manual),
    )(*args, *planted)
    # Occurrence-axis accumulators ("stack", "collect"): the shards' occurrences, in order.
    folded = [
        reductions.fold_axis(m, part, m.batch_ndim) if reductions.stacked(m) else part
        for m, part in zip(metas, split_leaves(leaves, metas), strict=True)
    ]
    mark([x for part in folded for x in part], metas)
    return outs


def _merged_metas(metas, leaf_vars):
    if not any(m.reduce for m in metas):
        return metas
    found = []
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in leaf_vars]
    jax.eval_shape(lambda *xs: found.append(reductions.merge(metas, xs)[0]), *shapes)
    return found[0]


def _thread_state(eqn, invals, threading):
    # State set inside is per shard: one row per shard, along a new axis after its batch axes
    # (a vmap's, first), split over the manual mesh axes; each shard reads its own row back in
    # a later shard_map. Other state comes in whole, the same on every shard.
    jaxpr, mesh, in_specs, out_specs, check_vma, manual = params.shard_map_parts(eqn.params)
    axes = tuple(a for a in mesh.axis_names if a in manual)
    writes, names = threading.uses(jaxpr).writes, threading.present(jaxpr)
    split = {n: threading.shards(n) == axes for n in names}
    run = threading.threaded(jaxpr, names, writes)
    batch = {n: meta.batch_ndim for n, (meta, _) in writes.items()}
    for n in names:
        batch.setdefault(n, threading.batch_ndim(n))

    def body(args, state):
        state = {
            n: [jnp.squeeze(x, batch[n]) if split[n] else x for x in v] for n, v in state.items()
        }
        outs, new = run(args, state)
        return outs, {
            n: [vary(jnp.expand_dims(x, batch[n]), axes) for x in v] for n, v in new.items()
        }

    def spec(split_: bool, n: str) -> PartitionSpec:
        return PartitionSpec(*[None] * batch[n], axes) if split_ else PartitionSpec()

    state = threading.values(names)
    outs, new = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(list(in_specs), {n: [spec(split[n], n)] * len(v) for n, v in state.items()}),
        out_specs=(
            list(out_specs),
            {n: [spec(True, n)] * len(avals) for n, (_, avals) in writes.items()},
        ),
        check_vma=check_vma,
        axis_names=frozenset(manual),
    )(list(invals), state)
    threading.update(new, writes, shards=axes)
    return outs


# Not `selectable`: its body is traced only inside its mesh's axes (a `pvary` there binds an
# axis name that exists nowhere else), so a selection cannot evaluate it again on its own.
register_handler(
    SHARD_MAP_PRIMITIVE, handler_from_exposer(_shard_map_exposer), thread_state=_thread_state
)


def _rebind_vary(eqn, args):
    # Under `stateful`, a `pvary`/`pcast` equation's operand may already vary over some of its
    # axes (state read per shard, where it was the same on every shard when traced): mark it as
    # varying over the others only. `pvary` in JAX 0.8 -- 0.12; `pcast` with `to="varying"`
    # in 0.9+.
    if eqn.primitive.name == "pcast" and eqn.params.get("to") != "varying":
        return list(bind(eqn.primitive, args, eqn.params))
    axes = tuple(eqn.params.get("axes", eqn.params.get("axis_name", ())))
    return [vary(x, axes) for x in args]


register_rules("pvary", Rules(rebinding=_rebind_vary))
register_rules("pcast", Rules(rebinding=_rebind_vary))

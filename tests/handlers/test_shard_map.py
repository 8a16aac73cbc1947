import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statax as stx
from statax.testing import assert_tree_allclose

MESH = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
X = jax.device_put(jnp.arange(12.0).reshape(4, 3), NamedSharding(MESH, P("x")))


def body(a):
    stx.save_inter(a * 2, name="local")
    stx.save_inter(jnp.sum(a), name="scalar")
    return a + 1


smap = jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"))


def reference(x):
    # Shard k = (i, j) over (x, y) holds rows 2i:2i+2 of x (replicated over y).
    x = np.asarray(x)
    blocks = [x[2 * i : 2 * i + 2] for i in range(2) for _ in range(2)]
    return x + 1, {
        "local_0": np.stack([b * 2 for b in blocks]),
        "scalar_0": np.stack([b.sum() for b in blocks]),
    }


def test_per_shard_values_come_back_as_one_global_array():
    for g in (stx.pull(smap), stx.pull(jax.jit(smap)), jax.jit(stx.pull(smap))):
        out, inters = g(X)
        assert_tree_allclose((out, inters), reference(X))
        # Not gathered: each intermediate stays split over the devices, one shard each.
        for value in inters.values():
            assert value.sharding.spec[0] == ("x", "y")
            assert len({s.device for s in value.addressable_shards}) == 4
        assert out.sharding.is_equivalent_to(smap(X).sharding, out.ndim)


def test_under_vmap_both_orders_agree():
    xs = jnp.stack([X, X * 2])
    expected = jax.tree_util.tree_map(lambda *v: np.stack(v), *[reference(x)[1] for x in xs])
    assert_tree_allclose(stx.pull(jax.vmap(smap))(xs)[1], expected)
    assert_tree_allclose(jax.vmap(stx.pull(smap))(xs)[1], expected)


def test_grad_through_shard_map():
    loss = lambda x: jnp.sum(smap(x) ** 2)  # noqa: E731
    with jax.set_mesh(MESH):  # explicit sharding: eager reductions need the mesh
        grad, inters = stx.pull(jax.grad(loss))(X)
    assert_tree_allclose(grad, 2 * (np.asarray(X) + 1))
    assert_tree_allclose(inters, reference(X)[1])


def test_shard_map_in_jit_in_scan():
    def f(x):
        def step(c, _):
            return jax.jit(smap)(c), None

        return lax.scan(step, x, None, length=2)[0]

    out, inters = stx.pull(f)(X)
    first, second = reference(X)[1], reference(np.asarray(X) + 1)[1]
    expected = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), first, second)
    assert_tree_allclose((out, inters), (np.asarray(X) + 2, expected))


def test_sharded_inputs_keep_their_sharding_through_jit_pull():
    def f(x):
        h = stx.save_inter(jnp.sin(x), name="h")
        return h * 2

    out, inters = jax.jit(stx.pull(f))(X)
    assert out.sharding.is_equivalent_to(X.sharding, X.ndim)
    assert inters["h_0"].sharding.is_equivalent_to(X.sharding, X.ndim)


@pytest.mark.parametrize("mode", ["sum", "mean", "min", "max", "first", "last", "stack", "collect"])
def test_reduced_names_combine_over_shards(mode):
    def local(a):
        stx.save_inter(a * 2, name="r", reduce=mode)
        stx.save_inter(a * 3, name="r", reduce=mode)
        return a

    f = jax.shard_map(local, mesh=MESH, in_specs=P("x"), out_specs=P("x"))
    # Occurrences in order: shard (0, 0) then (0, 1), (1, 0), (1, 1); two per shard.
    blocks = [np.asarray(X)[2 * i : 2 * i + 2] for i in range(2) for _ in range(2)]
    occurrences = [b * k for b in blocks for k in (2, 3)]
    stacked = np.stack(occurrences)
    expected = {
        "sum": stacked.sum(0),
        "mean": stacked.mean(0),
        "min": stacked.min(0),
        "max": stacked.max(0),
        "first": occurrences[0],
        "last": occurrences[-1],
        "stack": stacked,
        "collect": stacked.ravel(),
    }[mode]
    with jax.set_mesh(MESH):
        assert_tree_allclose(stx.pull(f)(X)[1], {"r": expected})
        assert_tree_allclose(jax.jit(stx.pull(f))(X)[1], {"r": expected})

"""Flax NNX's reference semantics under `pull`, as `nnx.jit` keeps them.

NNX objects (modules, optimizers, variables) are mutable graph nodes: a call may update their
state (BatchNorm statistics, RNG counters, an optimizer step). `pull` flattens and rebuilds its
arguments, so on its own it would update rebuilt copies. Here every graph node among the
callable and the arguments is split (together, so shared references stay shared) into a static
graph definition and its state; the traced call merges them back, calls, and returns the new
state beside the output; and the caller's objects are updated with it afterwards.

Only used where Flax is already imported: statax does not depend on it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Slot", "calling", "node_test", "split", "update"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where the k-th graph node was, in the flattened arguments (static, hashable). `depth`
    tells apart the slots of nested splits (`grad_inters` splits, then the `pull` inside it
    splits the variables again): a merge puts back only its own."""

    index: int
    depth: int = 0


@jax.tree_util.register_pytree_node_class
class _Packed:
    """The arguments with their graph nodes taken out: the nodes' state (traced) and graph
    definition (static, so part of `pull`'s cache key)."""

    # The state is kept as its arrays (and their structure): its variables are graph nodes
    # too, which a `pull` of a function of this (`grad_inters`'s) would take out again, and
    # update in its own trace. It is rebuilt where the nodes are merged.
    def __init__(self, graphdef, arrays, state_def, rest, depth):
        self.graphdef, self.arrays, self.state_def = graphdef, arrays, state_def
        self.rest, self.depth = rest, depth

    def tree_flatten(self):
        return (self.arrays, self.rest), (self.graphdef, self.state_def, self.depth)

    @classmethod
    def tree_unflatten(cls, static, children):
        graphdef, state_def, depth = static
        return cls(graphdef, children[0], state_def, children[1], depth)


def node_test() -> Callable[[Any], bool] | None:
    """NNX's test for a graph node, or `None` where Flax NNX is not imported."""
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else nnx.graph.is_graph_node


def split(leaves: list, treedef) -> tuple[_Packed, tuple, dict, tuple]:
    """`(packed, args, kwargs, nodes)` from `(tree, args, kwargs)` flattened with graph nodes as
    leaves: the nodes are taken out into `packed` (which replaces `tree`), leaving `Slot`s in
    their places, so that arguments stay where they were (a Python float stays traced)."""
    nnx = sys.modules["flax.nnx"]
    is_node = nnx.graph.is_graph_node
    nodes = tuple(leaf for leaf in leaves if is_node(leaf))
    graphdef, state = nnx.split(nodes)
    depth = 1 + max((s.depth for s in _slots(leaves)), default=0)
    it = iter(range(len(nodes)))
    rest = [Slot(next(it), depth) if is_node(leaf) else leaf for leaf in leaves]
    tree, args, kwargs = jax.tree_util.tree_unflatten(treedef, rest)
    arrays, state_def = jax.tree_util.tree_flatten(state)
    return _Packed(graphdef, arrays, state_def, tree, depth), args, kwargs, nodes


def calling(call):
    """`call(tree, *args, **kwargs)` for packed arguments: merges the graph nodes back, calls,
    and returns `(out, changed)`: the state's arrays the call changed, `None` for the others
    (found while tracing: an unchanged variable still holds the array merged in), so that a
    call that changes nothing writes nothing back, also from inside a trace that closes over
    the nodes (where NNX refuses any update)."""

    def packed_call(packed: _Packed, *args, **kwargs):
        nnx = sys.modules["flax.nnx"]
        state = jax.tree_util.tree_unflatten(packed.state_def, packed.arrays)
        nodes = nnx.merge(packed.graphdef, state)

        def put_back(leaf):
            own = isinstance(leaf, Slot) and leaf.depth == packed.depth
            return nodes[leaf.index] if own else leaf

        tree, args, kwargs = jax.tree_util.tree_map(
            put_back, (packed.rest, args, kwargs), is_leaf=lambda x: isinstance(x, Slot)
        )
        out = call(tree, *args, **kwargs)
        new = jax.tree_util.tree_leaves(nnx.state(nodes))
        if len(new) != len(packed.arrays):  # variables made or dropped: all of it
            return out, {"whole": nnx.state(nodes)}
        changed = [b if b is not a else None for a, b in zip(packed.arrays, new)]
        return out, changed

    return packed_call


def _slots(tree) -> list[Slot]:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, Slot)]


def update(nodes: tuple, changed) -> None:
    """Update the caller's graph nodes with what the call changed (`calling`'s `changed`)."""
    nnx = sys.modules["flax.nnx"]
    if isinstance(changed, dict):  # the whole state
        nnx.update(nodes, changed["whole"])
        return
    if all(leaf is None for leaf in changed):
        return
    old, state_def = jax.tree_util.tree_flatten(nnx.state(nodes))
    leaves = [a if b is None else b for a, b in zip(old, changed)]
    nnx.update(nodes, jax.tree_util.tree_unflatten(state_def, leaves))

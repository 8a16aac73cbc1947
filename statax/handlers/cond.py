"""Handler for `cond` (`lax.cond`, `lax.switch`).

Reads `branches`. Each branch is pulled; the intermediates of all branches are matched by
(name, occurrence within the branch) into *slots*, in order of first appearance by branch
index (branch 0's first, then any new ones of branch 1, ...; for `lax.cond`, branch 0 is
`false_fun`). Every branch returns every slot, zeros where it has
no such mark, so the cond returns the values of the branch that ran. A slot whose marks differ
between branches in shape, dtype or pytree structure is an error naming both call sites: give
them different names.

Under `vmap` with a batched predicate JAX runs both branches and selects; the slots are outputs
of the cond by then, so each example gets the value of the branch it took.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend.core.primitives import cond_p

from .. import _compat
from .._errors import BranchMismatchError
from .._interpreter import pull_jaxpr, register_exposer, split_leaves


def _slots(pulled):
    """[(key, meta, avals)] over all branches, and per branch {key: index of its meta}."""
    slots, per_branch = {}, []
    for jaxpr, metas in pulled:
        counts, where = {}, {}
        leaf_avals = split_leaves(
            jaxpr.out_avals[len(jaxpr.out_avals) - sum(m.num_arrays for m in metas) :], metas
        )
        for i, (meta, avals) in enumerate(zip(metas, leaf_avals, strict=True)):
            n = counts.get(meta.name, 0)
            counts[meta.name] = n + 1
            # A reduced name has one accumulator per branch, zeros (no occurrence) if absent.
            key = (meta.name, n if meta.reduce is None else "reduced")
            where[key] = i
            if key not in slots:
                slots[key] = (meta, tuple(avals))
            else:
                first, first_avals = slots[key]
                if not _same_slot(first, first_avals, meta, avals):
                    raise BranchMismatchError(first, first_avals, meta, tuple(avals))
        per_branch.append(where)
    return slots, per_branch


def _same_slot(meta_a, avals_a, meta_b, avals_b) -> bool:
    return (
        meta_a.treedef == meta_b.treedef
        and meta_a.static_leaves == meta_b.static_leaves
        and [(a.shape, a.dtype) for a in avals_a] == [(b.shape, b.dtype) for b in avals_b]
    )


def _branch(jaxpr, metas, num_out, slots, where):
    def run(*args):
        flat = jex.jaxpr_as_fun(jaxpr)(*args)
        mine = split_leaves(flat[num_out:], metas)
        leaves = []
        for key, (_, avals) in slots.items():
            if key in where:
                leaves.extend(mine[where[key]])
            else:
                leaves.extend(jnp.zeros(a.shape, a.dtype) for a in avals)
        return [*flat[:num_out], *leaves]

    return run


def _cond_exposer(index, *ops, **params):
    branches = _compat.cond_branches(params)
    num_out = len(branches[0].out_avals)
    pulled = [pull_jaxpr(branch) for branch in branches]
    slots, per_branch = _slots(pulled)
    new_branches = tuple(
        _compat.trace(_branch(jaxpr, metas, num_out, slots, where), branch.in_avals, "branch")
        for branch, (jaxpr, metas), where in zip(branches, pulled, per_branch, strict=True)
    )
    flat = cond_p.bind(index, *ops, **_compat.cond_params(params, new_branches))
    return flat[:num_out], flat[num_out:], tuple(meta for meta, _ in slots.values())


register_exposer(cond_p, _cond_exposer)

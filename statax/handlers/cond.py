"""Handler for `cond` (`lax.cond`, `lax.switch`).

Reads `branches`. Each branch is pulled; the intermediates of all branches are matched by
(name, occurrence within the branch) into *slots*, in order of first appearance by branch
index (branch 0's first, then any new ones of branch 1, ...; for `lax.cond`, branch 0 is
`false_fun`). Every branch returns every slot, zeros where it has no such mark, so the cond
returns the values of the branch that ran. A slot whose marks differ between branches in shape,
dtype or pytree structure is an error naming both call sites: give them different names.
Planted values are matched into slots the same way: every branch takes every slot's value, and
uses those of its own marks.

Under `stateful`, every name some branch sets leaves the cond from the branch that ran (a
branch that does not set it passes its value on).

Under `vmap` with a batched predicate JAX runs both branches and selects; the slots are outputs
of the cond by then, so each example gets the value of the branch it took.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend.core.primitives import cond_p

from statax.extend import (
    Sinking,
    StateError,
    StateMeta,
    batched_state_guard,
    kinds_str,
    mark,
    occurrences,
    params,
    pull_jaxpr,
    register_exposer,
    share_taps,
    split_leaves,
    take,
    trace,
    wraps_jaxpr,
)


class BranchMismatchError(TypeError):
    """Two branches of a `cond` save different kinds of value under one (name, occurrence)."""

    def __init__(self, meta_a: StateMeta, avals_a, meta_b: StateMeta, avals_b):
        def kind(meta, avals):
            return f"{meta.treedef} of {kinds_str(avals)}"

        super().__init__(
            f"The branches of a cond/switch save different values as {meta_a.name!r}: "
            f"{kind(meta_a, avals_a)} at {meta_a.location}, but {kind(meta_b, avals_b)} at "
            f"{meta_b.location}. statax returns one value per name and occurrence from "
            "whichever branch ran, so they must match. To fix: give the two save_inter calls "
            "different names."
        )


BranchMismatchError.__module__ = "statax"  # users catch it as stx.BranchMismatchError


def _slots(per_branch_metas, per_branch_avals):
    """{key: (meta, avals)} over all branches, and per branch {key: index of its meta}."""
    slots, per_branch = {}, []
    for metas, flat_avals in zip(per_branch_metas, per_branch_avals, strict=True):
        where = {}
        pairs = zip(occurrences(metas), metas, split_leaves(flat_avals, metas), strict=True)
        for i, ((_, n), meta, avals) in enumerate(pairs):
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


def _branch(pulled, num_ops, num_out, slots, where, in_slots, in_where):
    def run(*args):
        given = split_leaves(args[num_ops:], [meta for meta, _ in in_slots.values()])
        given = dict(zip(in_slots, given, strict=True))
        mine_in = sorted(in_where, key=in_where.get)  # this branch's planted marks, in order
        flat = jex.jaxpr_as_fun(pulled.jaxpr)(
            *args[:num_ops], *(x for k in mine_in for x in given[k])
        )
        mine = split_leaves(flat[num_out:], pulled.outs)
        leaves = []
        for key, (_, avals) in slots.items():
            if key in where:
                leaves.extend(mine[where[key]])
            else:
                leaves.extend(jnp.zeros(a.shape, a.dtype) for a in avals)
        return [*flat[:num_out], *leaves]

    return run


def _cond_exposer(index, *ops, **eqn_params):
    branches = params.cond_branches(eqn_params)
    num_out = len(branches[0].out_avals)
    pulled = [pull_jaxpr(branch) for branch in branches]
    slots, where = _slots([p.outs for p in pulled], [p.jaxpr.out_avals[num_out:] for p in pulled])
    for key in slots:  # one cotangent per slot, whichever branch's tap reads it
        numbers = [p.outs[w[key]].tap for p, w in zip(pulled, where, strict=True) if key in w]
        if len(set(numbers) - {None}) > 1:
            share_taps([n for n in numbers if n is not None])
    in_slots, in_where = _slots(
        [p.ins for p in pulled], [p.jaxpr.in_avals[len(ops) :] for p in pulled]
    )
    in_metas = [meta for meta, _ in in_slots.values()]
    in_avals = [a for _, avals in in_slots.values() for a in avals]
    new_branches = tuple(
        trace(
            _branch(p, len(ops), num_out, slots, w, in_slots, iw),
            [*branch.in_avals, *in_avals],
            "branch",
        )
        for branch, p, w, iw in zip(branches, pulled, where, in_where, strict=True)
    )
    flat = cond_p.bind(
        index, *ops, *take(in_metas, in_avals), **params.cond_params(eqn_params, new_branches)
    )
    mark(flat[num_out:], [meta for meta, _ in slots.values()])
    return flat[:num_out]


def _cond_state(eqn, invals, threading):
    # Every name some branch sets leaves the cond, from the branch that ran; a branch that
    # does not set it passes its value on.
    index, ops = invals[0], list(invals[1:])
    branches = params.cond_branches(eqn.params)
    per_branch = [threading.uses(b).writes for b in branches]
    writes: dict = {}
    for w in per_branch:
        for n, (meta, avals) in w.items():
            if n not in writes or meta.batch_ndim > writes[n][0].batch_ndim:
                writes[n] = (meta, avals)
    names = threading.present(*branches)
    for n, (meta, _) in writes.items():
        if n not in names and not all(n in w for w in per_branch):
            raise StateError(
                f"The state {n!r} is set in some branches of a cond/switch (at {meta.location}) "
                "and has no value before it, so there would be none after it where another "
                "branch ran. Give it one before the cond (set_state, state=, or get_state with "
                "init=), or set it in every branch."
            )
    names = [n for n in names if n in writes]
    fns = [threading.threaded(b, names, writes) for b in branches]
    outs, new = jax.lax.switch(
        index, [lambda o, s, f=f: f(o, s) for f in fns], ops, threading.values(names)
    )
    threading.update(new, writes)
    return outs


def _readers(eqn) -> list:
    """Per input of a cond equation, the one branch that reads it (None for the index, and for
    an operand several branches read or none)."""
    out = [None]
    opened = [b.jaxpr if wraps_jaxpr(b) else b for b in params.cond_branches(eqn.params)]
    used = [_used(b) for b in opened]
    for i in range(len(eqn.invars) - 1):
        reading = [b for b, branch in enumerate(opened) if branch.invars[i] in used[b]]
        out.append(reading[0] if len(reading) == 1 else None)
    return out


def _used(jaxpr) -> set:
    used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jex.Var)}
    return used | {v for v in jaxpr.outvars if isinstance(v, jex.Var)}


def _moved(eqn, moves: dict):
    """The cond equation with `moves[b]` run first in branch `b`: the operands they define are
    computed there, and what they read from outside comes in as new operands (of every branch,
    read by the one that runs them)."""
    defined = {v for eqns in moves.values() for e in eqns for v in e.outvars}
    free: dict = {}  # (ordered)
    for eqns in moves.values():
        for e in eqns:
            for v in e.invars:
                if isinstance(v, jex.Var) and v not in defined:
                    free.setdefault(v)
    ops = eqn.invars[1:]
    kept = [i for i, v in enumerate(ops) if v not in defined]
    new = []
    for b, branch in enumerate(params.cond_branches(eqn.params)):
        opened = branch.jaxpr if wraps_jaxpr(branch) else branch
        inner = {opened.invars[i]: v for i, v in enumerate(ops) if v in defined}
        rename = lambda v, inner=inner: inner.get(v, v) if isinstance(v, jex.Var) else v  # noqa: E731
        eqns = [e.replace(invars=[rename(v) for v in e.invars]) for e in opened.eqns]
        invars = [*free, *(opened.invars[i] for i in kept)]
        info = opened.debug_info
        if info is not None and isinstance(info.arg_names, tuple):
            info = info._replace(arg_names=("",) * len(invars))
        made = opened.replace(
            invars=invars,
            eqns=[*moves.get(b, ()), *eqns],
            outvars=[rename(v) for v in opened.outvars],
            debug_info=info,
        )
        new.append(jex.ClosedJaxpr(made, branch.consts) if wraps_jaxpr(branch) else made)
    return eqn.replace(
        invars=[eqn.invars[0], *free, *(ops[i] for i in kept)],
        params=params.cond_params(eqn.params, new),
    )


# A branch runs its jaxprs and nothing else: selections reach into them, and it runs no Python.
# A batched predicate: JAX runs every branch for every example and selects.
BATCHING_GUARD = batched_state_guard(
    lambda axis_data, params, dims: dims[0] is not None, what="cond", runs="every branch"
)
register_exposer(
    cond_p,
    _cond_exposer,
    thread_state=_cond_state,
    batching_guard=BATCHING_GUARD,
    selectable=True,
    runs_python=False,
    sinking=Sinking(_readers, _moved),
)

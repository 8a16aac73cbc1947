"""Work moved into the branch that alone needs it: `sink(jaxpr)`.

An equation whose results only one branch of a conditional reads (directly, or through other
such equations) is moved into that branch, so that it runs only where the branch does. This is
what lets a sweep's program skip the run before a patched site (`stx.sweep(reuse=True)`): each
planted mark is a conditional that either takes the base run's value (the patch is at this
site or a later one) or the value the program computes, and what computes that value, back to
the previous site's conditional, moves into the second branch. The program is the same
function; equations with effects are never moved.

What a primitive's branches read, and how its equation is rebuilt with equations moved in,
is the primitive's knowledge: its record's `sinking` (`registry.Rules`, the cond handler's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend import core as jex

from .._jax import jaxprs as _jaxprs
from .exposers import map_jaxprs
from .registry import rules_for

__all__ = ["Sinking", "sink"]


class Sinking(NamedTuple):
    """A primitive's rule for `sink`: `readers(eqn)` says, per input of the equation, the one
    branch that reads it (None: several, or the choice of branch); `moved(eqn, moves)` is the
    equation with `moves[b]` (equations of the enclosing jaxpr, in order) run first in branch
    `b`, the inputs they define computed there."""

    readers: Any
    moved: Any


def sink(jaxpr):
    """`jaxpr` (closed or open, and every jaxpr inside it) with work moved into the branches
    that alone need it."""
    if _jaxprs.wraps_jaxpr(jaxpr):
        return jex.ClosedJaxpr(sink(jaxpr.jaxpr), jaxpr.consts)
    # (what nothing reads reads values too: dropped first, as the compiler would drop it)
    jaxpr, _ = _jaxprs.dce(jaxpr, [True] * len(jaxpr.outvars), keep=True)
    eqns = [
        e.replace(params=map_jaxprs(e.params, sink)) if _has_jaxprs(e) else e for e in jaxpr.eqns
    ]
    at = 0
    while at < len(eqns):
        rule = rules_for(eqns[at]).sinking
        if rule is not None:
            moved = _exclusive(eqns, at, rule.readers(eqns[at]), jaxpr.outvars)
            if moved:
                gone = {j for js in moved.values() for j in js}
                new = rule.moved(eqns[at], {b: [eqns[j] for j in js] for b, js in moved.items()})
                eqns = [e for j, e in enumerate(eqns[:at]) if j not in gone] + [
                    new,
                    *eqns[at + 1 :],
                ]
                at -= len(gone)
        at += 1
    return jaxpr.replace(eqns=eqns)


def _exclusive(eqns: list, at: int, readers: list, outvars) -> dict[int, list[int]]:
    """`{branch: [index, ...]}`: the equations before `eqns[at]` whose results only that branch
    of it reads, directly or through each other (without effects; none the jaxpr returns)."""
    consumers: dict = {}
    for j, eqn in enumerate(eqns):
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, jex.Var):
                consumers.setdefault(v, []).append((j, pos))
    returned = {v for v in outvars if isinstance(v, jex.Var)}
    branch_of: dict[int, int] = {}
    for j in range(at - 1, -1, -1):
        eqn = eqns[j]
        if eqn.effects:
            continue
        owners = set()
        for v in eqn.outvars:  # (one nothing reads, a dropped one, adds no owner)
            if v in returned:
                owners.add(None)
            for k, pos in consumers.get(v, ()):
                owners.add(readers[pos] if k == at else branch_of.get(k))
        if len(owners) == 1 and None not in owners:
            branch_of[j] = owners.pop()
    moved: dict[int, list[int]] = {}
    for j in sorted(branch_of):
        moved.setdefault(branch_of[j], []).append(j)
    return moved


def _has_jaxprs(eqn) -> bool:
    return any(True for _ in _jaxprs.jaxprs_in_params(eqn.params))

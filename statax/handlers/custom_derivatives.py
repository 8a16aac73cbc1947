"""Handlers for `custom_jvp_call` and `custom_vjp_call` (`jax.custom_jvp`, `jax.custom_vjp`,
and what is built from them: equinox's checkpointed while loop, diffrax's adjoints,
optimistix's implicit derivatives).

Reads `call_jaxpr`, the primal function. The equation is rebound as a custom-derivative function
of statax's whose primal is the *pulled* primal: it returns the original outputs followed by
the intermediates, computed once (a loop inside runs once, as unpulled). Its rule delegates to
the original equation (its marks inert), so the custom rule keeps governing derivatives; the
intermediates get zero tangents (they are the primal's values, as under `grad`). Only when the
result is differentiated does the pulled primal also run, beside the original rule, behind
`stop_gradient`, to provide them. A value planted inside changes the function, so its rule no
longer describes it: it then runs and is differentiated as written.

The rule itself (the JVP of a `custom_jvp`, the `fwd` of a `custom_vjp`) is Python, not a
jaxpr: JAX traces it only when it differentiates. So that `jax.jvp(pull(f))` returns what
`pull(jax.jvp(f))` does, the rule is traced here too, and its marks join the primal's like the
branches of a `cond`: a mark of the rule takes the primal's slot of the same name and
occurrence (a rule that calls the primal function repeats its marks); the others are returned
beside the primal's, computed from the primal inputs. A mark of a JVP rule whose value depends
on the tangents is a derivative, not a value of the function at its inputs: it stays in the
rule, collected by a `pull` around the differentiation (`pull(jax.jvp(f))`), as a `custom_vjp`'s
`bwd` marks are.

Under `pull(grad(f))` JAX has already replaced the equation by what it runs: the primal
function for `custom_jvp` (if the JVP rule calls it), `fwd` and `bwd` for `custom_vjp`; their
marks are collected where they run.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from jax.extend import core as jex
from jax.extend.core.primitives import custom_jvp_call_p, custom_vjp_call_p

from statax.extend import (
    StateMeta,
    acts_on,
    bind,
    current_selection,
    dce,
    equations,
    find_saves,
    handler_from_exposer,
    inert,
    map_jaxprs,
    occurrences,
    on_forget,
    params,
    pull_differentiates,
    pull_jaxpr,
    pulled_with_rule,
    pulling,
    register_handler,
    save_inter_p,
    split_leaves,
    wraps_jaxpr,
)


class _RuleMarks(NamedTuple):
    jaxpr: jex.ClosedJaxpr | None  # the non-constant primal inputs -> the leaves of `metas`
    metas: tuple[StateMeta, ...]  # the rule's marks that are not the primal's
    sites: frozenset  # (name, location) of every rule mark `pull` returns (or the primal does)


_NONE = _RuleMarks(None, (), frozenset())
# rule jaxpr (memoized by JAX per equation) -> per selection, its _RuleMarks
_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
on_forget(_RULES.clear)


def _rule_marks(eqn_params: dict) -> _RuleMarks:
    if params.custom_rule_in_library(eqn_params) and not find_saves(
        params.custom_primal(eqn_params)
    ):
        # Tracing every rule would cost as much as tracing the program again (equinox alone
        # puts a custom_jvp behind every `error_if`): a library's rule is searched where its
        # function holds marks (optimistix's implicit rule re-evaluating your residual).
        return _NONE
    try:
        with pulling():  # marks bound as a `pull` binds them (`only=` applies)
            rule = params.custom_rule(eqn_params)
    except (AssertionError, RuntimeError, TypeError, ValueError, NotImplementedError):
        # What a rule that refuses to be differentiated raises (`eqx.nondifferentiable`,
        # equinox's guards on `filter_custom_vjp`'s non-differentiable arguments, lineax's
        # assertion that an operator's structure gets no tangent): it runs no marks, and where
        # JAX would run it, it raises for the user. Anything else is raised.
        return _NONE
    per_selection = _RULES.setdefault(rule.jaxpr, {})
    selection = current_selection()
    if selection not in per_selection:
        per_selection[selection] = _find_rule_marks(eqn_params, rule)
    return per_selection[selection]


def _find_rule_marks(eqn_params: dict, rule: jex.ClosedJaxpr) -> _RuleMarks:
    rule = _as_primal(rule)
    found = _jaxpr_marks(rule.jaxpr)
    if not found:
        return _NONE
    primal_marks = find_saves(params.custom_primal(eqn_params))
    reduced = {m.name for m in primal_marks if m.reduce is not None}
    if set(occurrences(found)) <= set(occurrences(primal_marks)) | {
        (m.name, 0) for m in found if m.name in reduced
    }:
        # Every mark of the rule is one of the primal's (a rule that calls its function, as
        # a checkpointed loop's `fwd` does): nothing more to rewrite.
        return _RuleMarks(None, (), frozenset((m.name, m.location) for m in found))
    pulled, metas, _ = pull_jaxpr(rule)
    primal = pull_jaxpr(params.custom_primal(eqn_params))
    num_primals = params.custom_rule_inputs(eqn_params)
    # The primal's slots: (name, occurrence) -> the avals of its leaves.
    primal_avals = tuple(primal.jaxpr.out_avals[len(params.custom_primal(eqn_params).out_avals) :])
    leaf_avals = split_leaves(primal_avals, primal.outs)
    slots = dict(zip(occurrences(primal.outs), leaf_avals, strict=True))
    outs = split_leaves(range(len(rule.out_avals), len(pulled.out_avals)), metas)
    own, sites, used = [], set(), [False] * len(pulled.out_avals)
    for slot, meta, out in zip(occurrences(metas), metas, outs, strict=True):
        start, stop = out.start, out.stop
        avals = tuple(pulled.out_avals[start:stop])
        leaves = [i in out for i in range(len(pulled.out_avals))]
        _, reads = dce(pulled.jaxpr, leaves)
        if any(reads[num_primals:]):
            continue  # a derivative: left to a `pull` around the differentiation
        sites.add((meta.name, meta.location))
        if slot in slots and (meta.reduce is not None or slots[slot] == avals):
            continue  # the primal's own mark, repeated by a rule that calls it
        own.append(meta)
        used[start:stop] = [True] * (stop - start)
    if not own:
        return _RuleMarks(None, (), frozenset(sites))
    keep = [True] * num_primals + [False] * (len(pulled.in_avals) - num_primals)
    jaxpr, _ = dce(pulled.jaxpr, used, keep)
    return _RuleMarks(jex.ClosedJaxpr(jaxpr, pulled.consts), tuple(own), frozenset(sites))


_CUSTOM = (custom_jvp_call_p, custom_vjp_call_p)
_AS_PRIMAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_primal(jaxpr):
    """`jaxpr` (open or closed) with every custom-derivative call in it, at any depth, a
    `closed_call` of its primal: a rule as it runs when differentiated once (the rules of the
    functions it calls run only under a second differentiation), and without the recursion of
    a rule that calls its own function."""
    if wraps_jaxpr(jaxpr):
        new = _as_primal(jaxpr.jaxpr)
        return jaxpr if new is jaxpr.jaxpr else jex.ClosedJaxpr(new, jaxpr.consts)
    new = _AS_PRIMAL.get(jaxpr)
    if new is None:
        new = _AS_PRIMAL[jaxpr] = jaxpr.replace(eqns=[_eqn_as_primal(e) for e in jaxpr.eqns])
    return new


def _eqn_as_primal(eqn: jex.JaxprEqn) -> jex.JaxprEqn:
    if eqn.primitive in _CUSTOM:
        primal = _as_primal(params.custom_primal(eqn.params))
        return eqn.replace(
            primitive=jex.primitives.closed_call_p,
            params={"call_jaxpr": primal},
            effects=primal.effects,
        )
    return eqn.replace(params=map_jaxprs(eqn.params, _as_primal))


def _jaxpr_marks(jaxpr) -> list[StateMeta]:
    """The marks of `jaxpr` and of the jaxprs in its equations' params, not looking into the
    Python impls of primitives (tracing each would cost as much as tracing the program)."""
    return [
        eqn.params["meta"]
        for eqn in equations(jaxpr)
        if eqn.primitive is save_inter_p and acts_on(eqn.params)
    ]


def _exposer(primitive, rule):
    def exposer(*args, **eqn_params):
        # The equation as it was, its marks inert (an enclosing `pull` must not see them again).
        primal = params.custom_primal(eqn_params)
        kept = params.custom_params(eqn_params, inert(primal))
        marks = _rule_marks(eqn_params)
        if marks.sites:
            sites = marks.sites
            kept = params.custom_rule_params(
                kept, lambda jaxpr: inert(jaxpr, lambda m: (m.name, m.location) in sites)
            )

        def original(*args):
            return tuple(bind(primitive, args, kept))

        # The rule's own marks are keys where the rule runs: the `pull` has differentiated
        # inputs. Where it has none, the rule runs only if a differentiation outside the
        # program `pull` returns (`jax.jvp(jax.jit(pull(f)))`) calls it: they stay inert.
        differentiating = pull_differentiates()
        extra = (marks.jaxpr, marks.metas) if marks.metas and differentiating else None
        return pulled_with_rule(original, primal, args, rule=rule, extra=extra)

    return exposer


def _find_saves(eqn: jex.JaxprEqn) -> tuple[StateMeta, ...]:
    return (*find_saves(params.custom_primal(eqn.params)), *_rule_marks(eqn.params).metas)


def _thread_state(eqn, invals, threading):
    # A function that reads or sets state runs, and is differentiated, as written: its rule
    # does not describe what it does to the state.
    return threading.run(params.custom_primal(eqn.params), invals)


# The params that hold the rules (their names across JAX 0.8 -- 0.12): functions made anew at
# every trace, which a program that is only run does not depend on.
_RULE_PARAMS = {
    "jvp": ("jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
    "vjp": ("fwd_jaxpr_thunk", "bwd", "out_trees"),
}

for _primitive, _rule in ((custom_jvp_call_p, "jvp"), (custom_vjp_call_p, "vjp")):
    # A custom_vjp function has no JVP to call: the rewritten one is a custom_vjp too.
    register_handler(
        _primitive,
        handler_from_exposer(_exposer(_primitive, _rule)),
        find_saves=_find_saves,
        thread_state=_thread_state,
        selectable=True,  # evaluated again, the function keeps its rule
        derivative_params=_RULE_PARAMS[_rule],
    )

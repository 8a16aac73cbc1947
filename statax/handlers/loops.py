"""Handlers for `scan` (`lax.scan`, `lax.map`, `fori_loop` with a static trip count) and
`while` (`lax.while_loop`, `fori_loop` with a dynamic trip count).

`scan` reads `jaxpr`: the pulled body returns its intermediates as extra `ys`, so they leave
stacked along a new leading axis, in the same order as the scan's `ys` (also with
`reverse=True` and any `unroll`).

`while` reads `cond_jaxpr` and `body_jaxpr`. The loop is rewritten to carry, beside its own
state, the predicate, the last values of the body's intermediates (zeros before the first
iteration, so zeros if the body never ran) and those of `cond_fun`'s (its last evaluation,
the one that ended the loop). The predicate is computed once per iteration, at the end of the
body, and the new `cond_fun` only reads it. With `pull(fn, steps=N)` it carries rows instead,
one per iteration (`statax.extend.rows`), and its count, checked against `N` after the loop.

Names saved with `reduce=` combine over iterations instead: a `scan` or `while` carries the
running value of the elementwise modes (no per-iteration storage), a `scan` stacks `"stack"`
and `"collect"` occurrences (in the order of its `ys`), and a `while` refuses those two (its
number of iterations is not known when it is compiled).

equinox's loops (`eqx.internal.while_loop`) are a `while` (kinds "lax" and "checkpointed") or
nested `scan`s of `cond`s (kind "bounded") over a carry `(step, pred, prev_pred, *state)`.
Both get `while` semantics: the last iteration that ran, masked per example with equinox's own
flag `pred` (equinox runs a batch until every example is done and masks its state with it).

Planted values come in as a `scan`'s extra `xs` (one per iteration, stacked like the
intermediates) and as a `while`'s (or a bounded loop's) extra constants (one value, used in every
iteration; with `steps=`, rows read by iteration). A hook's step is the loop's own counter.

Under `stateful`, every name a loop's body sets is part of its carry (an iteration reads what
the one before set, and the last value leaves the loop); the others are read as they are.

Under `vmap`, both leave the loop before JAX batches it and are marked again outside: a scan's
intermediates come back with the batch axis first, then the scan axis; a while loop's with each
example's own last iteration. A `vmap` inside a scan's body is another matter: its values leave
the scan stacked, loop axis first, and their batch axes are no longer leading (`_stacked`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend.core.primitives import scan_p, while_p

from statax.extend import (
    StateError,
    batched_outputs,
    batched_state_guard,
    equations,
    handler_from_exposer,
    inner_steps,
    loop_steps,
    mark,
    params,
    pull_jaxpr,
    reductions,
    register_exposer,
    register_handler,
    restage_equation,
    rows,
    set_steps,
    split_leaves,
    take,
)
from statax.extend import equinox as equinox_internals
from statax.handlers.equinox import is_bounded_step as _is_bounded_step
from statax.handlers.equinox import loop_running as _loop_running


def _scan_exposer(*args, **eqn_params):
    parts = params.scan_parts(eqn_params)
    num_consts, num_carry = parts.num_consts, parts.num_carry
    body, metas, ins = pull_jaxpr(parts.jaxpr)
    num_out = len(parts.jaxpr.out_avals)
    init = args[num_consts : num_consts + num_carry]
    if metas and _is_bounded_step(parts.jaxpr, init):
        outs, leaves, marked = _bounded_loop_scan(args, parts, body, metas, ins)
        mark(leaves, marked)
        return outs
    # Planted values: one per iteration, as extra xs.
    planted = _planted_stacked(ins, body.in_avals[len(args) :], parts.length, parts.reverse)
    if not any(reductions.running(m) for m in metas):
        new_params = params.scan_params(eqn_params, parts._replace(jaxpr=body))
        flat = scan_p.bind(*args, *planted, **new_params)
        mark(_unstack_reduced(metas, split_leaves(flat[num_out:], metas)), _stacked(metas))
        return flat[:num_out]

    # Reduced intermediates are running values in the carry; the others are stacked.
    consts, init, xs = (
        args[:num_consts],
        args[num_consts : num_consts + num_carry],
        args[num_consts + num_carry :],
    )
    avals = split_leaves(body.out_avals[num_out:], metas)
    acc0 = [
        reductions.identity(m, a)
        for m, a in zip(metas, avals, strict=True)
        if reductions.running(m)
    ]

    def step(state, x):
        carry, accs = state
        flat = jex.jaxpr_as_fun(body)(*consts, *carry, *x)
        accs, new_accs, stacked = iter(accs), [], []
        for meta, part in zip(metas, split_leaves(flat[num_out:], metas), strict=True):
            if reductions.running(meta):
                new_accs.append(reductions.combine(meta, next(accs), meta, part))
            else:
                stacked.append(part)
        return (flat[:num_carry], new_accs), (flat[num_carry:num_out], stacked)

    (carry, accs), (ys, rows) = jax.lax.scan(
        step,
        (list(init), acc0),
        [*xs, *planted],
        length=parts.length,
        reverse=parts.reverse,
        unroll=parts.unroll,
    )
    accs = iter(accs)
    rows = iter(_unstack_reduced([m for m in metas if not reductions.running(m)], rows, flat=False))
    mark(
        [x for m in metas for x in (next(accs) if reductions.running(m) else next(rows))],
        _stacked(metas),
    )
    return [*carry, *ys]


def _stacked(metas):
    """The metas of a scan body's intermediates (or planted values) as they leave it stacked
    along the scan's leading axis, ahead of the axes a `vmap` inside the body gave them: those
    axes are no longer leading (`batch_ndim` 0). Reduced names keep their own layout. A
    cotangent's batch axes with loops left to move past (`StateMeta.moves`) stay in front, as
    its value's do (`_unstack_reduced` moves them there)."""
    out = []
    for m in metas:
        if m.batch_ndim and m.reduce is None:
            k = _moving(m)
            m = dataclasses.replace(m, batch_ndim=k, moves=tuple(x - 1 for x in m.moves[:k]))
        out.append(m)
    return tuple(out)


def _moving(meta) -> int:
    """How many leading batch axes of `meta`'s value a loop that stacks it moves in front of
    its own axis (those with loops left in their `vmap`: a prefix, the outer `vmap` first)."""
    k = 0
    while k < len(meta.moves) and meta.moves[k] > 0:
        k += 1
    return k


def _planted_stacked(ins, avals, length: int, reverse: bool) -> list:
    """The values planted in a scan's body (`ins`, one iteration's `avals`), taken in stacked,
    one row per iteration. A planted cotangent's batch axes with loops left to move past are
    given in front, as `pull` returns it; its choice (the first leaf of what a planted mark
    takes in) is one per iteration. Each records the scan: its rows run in order or `reverse`."""
    avals = split_leaves(avals, ins)
    given = []
    for meta, part in zip(ins, avals, strict=True):
        k = _moving(meta)
        for i, a in enumerate(part):
            front = a.shape[:k] if i else ()
            given.append(a.update(shape=(*front, length, *a.shape[len(front) :])))
    taken = split_leaves(
        take(_stacked(ins), given, step=_rows(length), loop=(length, reverse)), ins
    )
    return [
        jnp.moveaxis(x, _moving(meta), 0) if i else x
        for meta, part in zip(ins, taken, strict=True)
        for i, x in enumerate(part)
    ]


def _rows(length: int):
    """For `take`: a hook's step in a scan's body, each row's index (along the loop's axis,
    after the batch axes a cotangent keeps in front: see `_planted_stacked`)."""

    def step(meta, aval):
        k = _moving(meta)
        shape = [1] * len(aval.shape)
        shape[k] = length
        return jnp.broadcast_to(jnp.arange(length, dtype=aval.dtype).reshape(shape), aval.shape)

    return step


def _bounded_loop_scan(args, parts, body, metas, ins):
    """A scan of `eqx.internal.while_loop(kind="bounded")`: a while loop to its user, so its
    intermediates are those of the last iteration that ran (zeros if none), as for `while`,
    not one row per possible step, and a planted value is one value for every step. An
    iteration ran for an example where equinox's step counter moved and its per-example flag
    was still set. With `steps=`, every step in rows, by equinox's step counter: the level that
    holds the body writes them, the levels around it (scans of it) add them up (each row is
    written once). Returns the outputs, the marks' leaves and their metas."""
    for meta in metas:
        reductions.check_in_while(meta)
    steps = loop_steps()[0]
    innermost = steps is not None and not _holds_level(parts.jaxpr)
    num_consts, num_carry = parts.num_consts, parts.num_carry
    num_out = len(parts.jaxpr.out_avals)
    consts = args[:num_consts]
    init, xs = args[num_consts : num_consts + num_carry], args[num_consts + num_carry :]
    in_avals, out_avals = body.in_avals[len(args) :], body.out_avals[num_out:]
    if innermost:  # (one row per step, read at the step)
        planted = take(_stacked(ins), rows.stacked_avals(in_avals, steps), step=_zero_step)
        last0 = rows.empty_rows(metas, out_avals, steps)
    else:
        planted = take(ins, in_avals, step=_zero_step)
        last0 = [jnp.zeros(a.shape, a.dtype) for a in out_avals]

    def step(state, x):
        carry, last = state
        now = rows.row(planted, carry[0]) if innermost else planted
        now = set_steps(ins, now, carry[0])  # (equinox's step counter)
        flat = jex.jaxpr_as_fun(body)(*consts, *carry, *x, *now)
        new_carry = list(flat[:num_carry])
        ran = (new_carry[0] != carry[0]) & carry[1]
        if innermost:
            new = rows.write(metas, last, flat[num_out:], carry[0])
        elif steps is not None:  # rows of the level inside: zeros but where it wrote
            new = _added(metas, last, flat[num_out:])
        else:
            new = _update(metas, last, flat[num_out:])
        last = [jnp.where(ran, b, a) for a, b in zip(last, new, strict=True)]
        return (new_carry, last), flat[num_carry:num_out]

    (carry, last), ys = jax.lax.scan(
        step,
        (list(init), last0),
        list(xs),
        length=parts.length,
        reverse=parts.reverse,
        unroll=parts.unroll,
    )
    if steps is not None and metas:
        where = f"(equinox's, kind 'bounded') holding {metas[0].name!r} ({metas[0].location})"
        last = rows.check_bound(last, carry[0], steps, where)
    return [*carry, *ys], last, (_stacked(metas) if innermost else metas)


def _added(metas, old, new):
    """Rows of a level inside added to those held (a running `reduce=` value combined)."""
    out = []
    for meta, a, b in zip(metas, split_leaves(old, metas), split_leaves(new, metas), strict=True):
        if reductions.running(meta):
            out.extend(reductions.combine(meta, a, meta, b))
        else:
            out.extend(x | y if x.dtype == jnp.bool_ else x + y for x, y in zip(a, b, strict=True))
    return out


def _holds_level(jaxpr) -> bool:
    """Whether a bounded loop's level holds another level (a scan of it) at any depth: then
    the body, and the marks written in it, are further in."""
    for eqn in equations(jaxpr):
        if eqn.primitive is scan_p:
            inner = params.scan_parts(eqn.params)
            init = [v.aval for v in eqn.invars[inner.num_consts :][: inner.num_carry]]
            if _is_bounded_step(inner.jaxpr, init):
                return True
    return False


def _zero_step(meta, aval):
    """For `take`: a placeholder for a hook's step, which a `while_loop` sets inside."""
    return jnp.zeros(aval.shape, aval.dtype)


def _update(metas, old, new):
    """The last value of an unreduced intermediate; the running value of a reduced one."""
    out = []
    for meta, a, b in zip(metas, split_leaves(old, metas), split_leaves(new, metas), strict=True):
        out.extend(reductions.combine(meta, a, meta, b) if reductions.running(meta) else b)
    return out


def _unstack_reduced(metas, stacked, flat=True):
    """Per-iteration occurrence-axis accumulators ("stack", "collect"), stacked by the scan on
    axis 0, folded into one (the iterations' occurrences after the batch axes); other values
    stay stacked."""
    out = []
    for meta, part in zip(metas, stacked, strict=True):
        if meta.accumulator and meta.reduce is not None:
            b = meta.batch_ndim
            part = reductions.fold_axis(meta, [jnp.moveaxis(x, 0, b) for x in part], b)
        elif _moving(meta):  # (a cotangent's batch axes with loops left to move past)
            part = [jnp.moveaxis(x, 0, _moving(meta)) for x in part]
        out.append(list(part))
    return [x for part in out for x in part] if flat else out


# A loop runs its jaxprs and nothing else: selections reach into them, and it runs no Python.
_LOOP = {"selectable": True, "runs_python": False}
_scan_traced = handler_from_exposer(_scan_exposer)


def _scan_handler(eqn):
    # The common case (no reduced names, nothing planted, no cotangent batched outside the loop,
    # not an equinox loop) without tracing the exposer: the equation itself, its body returning
    # the intermediates as extra ys.
    parts = params.scan_parts(eqn.params)
    body = pull_jaxpr(parts.jaxpr)
    if (
        body.ins
        or any(m.reduce is not None or _moving(m) for m in body.outs)
        or _is_bounded_step(
            parts.jaxpr, [x.aval for x in eqn.invars[parts.num_consts :][: parts.num_carry]]
        )
    ):
        return _scan_traced(eqn)
    new = params.scan_params(eqn.params, parts._replace(jaxpr=body.jaxpr))
    return restage_equation(eqn, _stacked(body.outs), **new)


def _scan_state(eqn, invals, threading):
    # Every name the body sets is part of the carry; the others are read as they are.
    parts = params.scan_parts(eqn.params)
    nc, ncar = parts.num_consts, parts.num_carry
    consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    writes = threading.uses(parts.jaxpr).writes if parts.length else {}  # no iteration, no set
    first = [x[-1 if parts.reverse else 0] for x in xs]
    init = threading.carried(
        writes, parts.jaxpr, [*consts, *carry, *first], "scan", may_run_none=False
    )
    body = threading.threaded(parts.jaxpr, list(writes), writes, start=init)

    def step(c, x):
        outs, new = body([*consts, *c[0], *x], c[1])
        return (outs[:ncar], new), outs[ncar:]

    (carry_out, new), ys = jax.lax.scan(
        step,
        (list(carry), {n: s.leaves for n, s in init.items()}),
        list(xs),
        length=parts.length,
        reverse=parts.reverse,
        unroll=parts.unroll,
    )
    threading.update(new, writes)
    return [*carry_out, *ys]


# The common case by its own handler, the rest (and `vmap`) by the exposer; the loop stacks its
# body's marks, and runs it `length` times.
register_handler(
    scan_p,
    _scan_handler,
    exposer=_scan_exposer,
    thread_state=_scan_state,
    stacking=True,
    trips=lambda eqn: eqn.params["length"],
    **_LOOP,
)


def _while_exposer(*args, **eqn_params):
    cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts = params.while_parts(eqn_params)
    cond_consts = args[:cond_nconsts]
    body_consts = args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    steps, inner = loop_steps()  # every iteration in rows (`loop_rows`), or the last one
    with inner_steps(inner):
        cond_fn, cond_metas, cond_ins = pull_jaxpr(cond_jaxpr)
        body_fn, body_metas, body_ins = pull_jaxpr(body_jaxpr)
    for meta in (*cond_metas, *body_metas):
        reductions.check_in_while(meta)
    n = len(init)
    cond_avals, body_avals = (
        cond_fn.in_avals[cond_nconsts + n :],
        body_fn.in_avals[body_nconsts + n :],
    )
    if steps is None:  # planted values: one each, used in every iteration
        cond_planted = take(cond_ins, cond_avals, step=_zero_step)
        body_planted = take(body_ins, body_avals, step=_zero_step)
    else:  # one row per iteration (per evaluation of `cond_fun`)
        cond_planted = take(
            _stacked(cond_ins), rows.stacked_avals(cond_avals, steps + 1), step=_zero_step
        )
        body_planted = take(
            _stacked(body_ins), rows.stacked_avals(body_avals, steps), step=_zero_step
        )
    running = _loop_running(cond_jaxpr, init)

    def evaluate_cond(carry, i):
        planted = cond_planted if steps is None else rows.row(cond_planted, i)
        planted = set_steps(cond_ins, planted, i)
        pred, *leaves = jex.jaxpr_as_fun(cond_fn)(*cond_consts, *carry, *planted)
        return pred, leaves

    def keep(metas, old, new, i):
        return _update(metas, old, new) if steps is None else rows.write(metas, old, new, i)

    def body(state):
        carry, _, body_old, cond_old, i = state
        planted = body_planted if steps is None else rows.row(body_planted, i)
        planted = set_steps(body_ins, planted, i)
        flat = jex.jaxpr_as_fun(body_fn)(*body_consts, *carry, *planted)
        new_carry, body_leaves = list(flat[:n]), keep(body_metas, body_old, flat[n:], i)
        following = i + 1
        if running is not None:
            # An equinox loop under vmap runs every example until all are done and masks its
            # own state with its per-example flag: mask the intermediates (and count) alike.
            ran = carry[running]
            body_leaves = [
                equinox_internals.select_if_vmap(ran, b, a)
                for a, b in zip(body_old, body_leaves, strict=True)
            ]
            following = equinox_internals.select_if_vmap(ran, following, i)
        pred, cond_leaves = evaluate_cond(new_carry, following)
        return (
            new_carry,
            pred,
            body_leaves,
            keep(cond_metas, cond_old, cond_leaves, following),
            following,
        )

    i = jnp.zeros((), jnp.int32)
    pred, cond_leaves = evaluate_cond(init, i)
    body_out = body_fn.out_avals[n:]
    if steps is None:
        body_leaves = [jnp.zeros(a.shape, a.dtype) for a in body_out]
    else:
        body_leaves = rows.empty_rows(body_metas, body_out, steps)
        cond_leaves = rows.write(
            cond_metas,
            rows.empty_rows(cond_metas, cond_fn.out_avals[1:], steps + 1),
            cond_leaves,
            i,
        )
    carry, _, body_leaves, cond_leaves, count = jax.lax.while_loop(
        lambda state: state[1], body, (list(init), pred, body_leaves, cond_leaves, i)
    )
    metas = (*cond_metas, *body_metas)
    if steps is None:
        mark([*cond_leaves, *body_leaves], metas)
    elif metas:
        parts = split_leaves([*cond_leaves, *body_leaves], metas)
        leaves = [
            x
            for m, part in zip(metas, parts, strict=True)
            for x in (part if reductions.running(m) else _unstack_reduced([m], [part]))
        ]
        where = f"holding {metas[0].name!r} ({metas[0].location})"
        leaves = rows.check_bound(leaves, count, steps, where)
        mark(leaves, _stacked(metas))
    return carry


def _while_state(eqn, invals, threading):
    cond, body_jaxpr, cn, bn = params.while_parts(eqn.params)
    cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    for meta, _ in threading.uses(cond).writes.values():
        raise StateError(
            f"set_state({meta.name!r}) at {meta.location} runs in a while_loop's cond_fun, "
            "which decides whether to go on and must not change state. Set it in body_fun."
        )
    writes = threading.uses(body_jaxpr).writes
    init = threading.carried(
        writes, body_jaxpr, [*bconsts, *carry], "while_loop", may_run_none=True
    )
    body = threading.threaded(body_jaxpr, list(writes), writes, start=init)
    test = threading.threaded(cond, list(writes), {}, start=init)
    carry_out, new = jax.lax.while_loop(
        lambda c: test([*cconsts, *c[0]], c[1])[0][0],
        lambda c: body([*bconsts, *c[0]], c[1]),
        (list(carry), {n: s.leaves for n, s in init.items()}),
    )
    threading.update(new, writes)
    return carry_out


def _predicate_batched(axis_data, eqn_params, dims) -> bool:
    cond, body, cn, bn = params.while_parts(eqn_params)
    batched = [d is not None for d in dims]
    cconsts, bconsts, carry = batched[:cn], batched[cn : cn + bn], batched[cn + bn :]
    while True:  # the carries batched after any number of iterations
        out = batched_outputs(body, axis_data, [*bconsts, *carry])
        grown = [a or b for a, b in zip(carry, out, strict=True)]
        if grown == carry:
            break
        carry = grown
    return batched_outputs(cond, axis_data, [*cconsts, *carry])[0]


# It runs its body as many times as its predicate says (not known when traced). A predicate
# batched after any number of iterations: JAX runs every iteration for every example.
register_exposer(
    while_p,
    _while_exposer,
    thread_state=_while_state,
    trips=lambda eqn: None,
    batching_guard=batched_state_guard(
        _predicate_batched, what="while_loop", runs="every iteration"
    ),
    **_LOOP,
)

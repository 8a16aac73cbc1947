"""statax's own state in JAX's trace context, and the effects its primitives carry.

Each state (`PULLING`, `SCOPE`, `PLANTING`, `SELECTION`, `PLACES`, `STATEFUL`, `RAN_MASKS`,
`DIFFERENTIATING`, `COTANGENTS`, `STEPS`) is part of JAX's trace context, so that `jax.jit`
keeps the traces made under one apart from the others. Leans on `jax._src.config` and
`jax._src.effects` (JAX 0.8 -- 0.12; listed in `docs/maintaining.md`).
"""

from __future__ import annotations

import contextlib
import contextvars

from jax._src import config as jax_config  # isort: skip


from jax._src import effects as effects_lib  # isort: skip


__all__ = [
    "COTANGENTS",
    "DIFFERENTIATING",
    "NO_EFFECTS",
    "PLACES",
    "PLANTING",
    "PULLING",
    "RAN_MASKS",
    "SAVE_EFFECT",
    "SCOPE",
    "SELECTION",
    "STATEFUL",
    "STATE_EFFECT",
    "STEPS",
    "within",
]


class SaveEffect(effects_lib.Effect):
    """Carried by a mark while a `pull` traces it, so that no transformation drops it.

    JAX removes effect-free equations whose outputs are unused in many places (dead-code
    elimination, and tracing that drops such equations as it goes, as the linearisation of
    JAX 0.9+ does); an effect keeps them. `pull` removes every mark it collects, and its effect
    with it, so the programs it returns carry no effect. Marks traced outside a `pull` carry no
    effect and cost nothing.
    """

    def __repr__(self) -> str:
        return "SaveEffect"


class StateEffect(effects_lib.Effect):
    """Carried by `get_state` and `set_state` (which exist only while `stateful` traces), for
    the reason `SaveEffect` is: no transformation may drop a read or a write of state.
    `stateful` replaces every one of them, so the programs it returns carry no effect."""

    def __repr__(self) -> str:
        return "StateEffect"


NO_EFFECTS: frozenset = frozenset()  # (what JAX's own `no_effects` is)
SAVE_EFFECT = SaveEffect()
STATE_EFFECT = StateEffect()
for _allowed in (
    effects_lib.control_flow_allowed_effects,
    effects_lib.custom_derivatives_allowed_effects,
    effects_lib.remat_allowed_effects,
    effects_lib.lowerable_effects,
    effects_lib.partial_eval_kept_effects,
):
    _allowed.add_type(SaveEffect)
    _allowed.add_type(StateEffect)

# Whether a `pull` is tracing. Part of JAX's trace context, so that `jax.jit` caches the traces
# it makes inside a `pull` (whose marks carry `SaveEffect`) apart from the others.
PULLING = jax_config.bool_state(
    "statax_pulling",
    False,
    "Internal to statax: true while statax.pull traces a function.",
    include_in_trace_context=True,
)

# The prefix of `statax.scope`s in force ("encoder/attn/"), also part of the trace context, so
# that a function `jax.jit` traced in one scope is traced again in another.
SCOPE = jax_config.string_or_object_state(
    "statax_scope",
    "",
    "Internal to statax: the prefix of the statax.scope in force.",
    include_in_trace_context=True,
)


# The `plant` in force (a `statax._plant.Planting`: which names take values in from outside,
# and their hooks), or None; part of the trace context as the selection is.
PLANTING = jax_config.string_or_object_state(
    "statax_planting",
    None,
    "Internal to statax: the plant in force.",
    include_in_trace_context=True,
)


# The selection of the `pull` tracing (`pull(fn, only=...)`), a predicate on StateMeta or None;
# part of the trace context for the same reason as the scope.
SELECTION = jax_config.string_or_object_state(
    "statax_selection",
    None,
    "Internal to statax: the selection (pull's only=) in force.",
    include_in_trace_context=True,
)


# The selections (`pull(fn, at=...)`) of the `pull`s tracing, outermost first, or `()`. Part of the
# trace context, since what they mark is decided where a function runs (a Linen or Keras module
# as it is called, a place in the program once traced): a `jax.jit` inside the function, or a
# trace kept by statax, made for one selection must not answer for another.
PLACES = jax_config.string_or_object_state(
    "statax_places",
    (),
    "Internal to statax: the selections (pull's at=) in force.",
    include_in_trace_context=True,
)


# The state a `stateful` traces with (a `statax._stateful.Given`: the names passed in and the
# kinds of their values), or None outside one; part of the trace context, so that a function
# `jax.jit` traced for one kind of state is traced again for another.
STATEFUL = jax_config.string_or_object_state(
    "statax_stateful",
    None,
    "Internal to statax: the state passed to the statax.stateful tracing.",
    include_in_trace_context=True,
)


# Whether the `pull` tracing returns masks of the occurrences that ran (`pull(fn, ran=True)`):
# then each mark it collects carries a boolean beside its value. Part of the trace context.
RAN_MASKS = jax_config.bool_state(
    "statax_ran_masks",
    False,
    "Internal to statax: true while statax.pull(fn, ran=True) traces a function.",
    include_in_trace_context=True,
)

# The bound on a `while_loop`'s iterations that the `pull` tracing keeps every one of
# (`pull(fn, steps=N)`), or None: each loop then gives its last iteration. Part of the trace
# context.
STEPS = jax_config.string_or_object_state(
    "statax_steps",
    None,
    "Internal to statax: the steps= bound while statax.pull(fn, steps=N) traces a function.",
    include_in_trace_context=True,
)

# Whether the `pull` tracing has inputs that are being differentiated (`jax.jvp(pull(f))`,
# `jax.grad(pull(f))`): then the rules of custom derivatives run, and their marks are keys.
# Part of the trace context, so that the trace made for one is not used for the other.
DIFFERENTIATING = jax_config.bool_state(
    "statax_differentiating",
    False,
    "Internal to statax: true while statax.pull traces a function whose inputs are differentiated.",
    include_in_trace_context=True,
)

# Whether the `pull` tracing returns the cotangents that flow back through its marks
# (`pull(fn, cotangents=True)`): then a differentiated mark taps its tangents
# (`_core.cotangents`). Part of the trace context.
COTANGENTS = jax_config.bool_state(
    "statax_cotangents",
    False,
    "Internal to statax: true while statax.pull(fn, cotangents=True) traces a function.",
    include_in_trace_context=True,
)


@contextlib.contextmanager
def within(var: contextvars.ContextVar, value):
    """Within, `var` holds `value` (which it yields); after, what it held before. For
    statax's own context variables, which are not part of JAX's trace context."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)

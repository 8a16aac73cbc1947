"""`statax.extend`: what a handler author needs, in the spirit of `jax.extend`.

The user API (`save_inter`, `pull`, ...) is at the top level of `statax`. This module holds the
rest: the handler contract (`Rewrite`, `Rules`, `register_handler`, `register_exposer`, ...),
the walk (`pull_jaxpr`, `pull_open_jaxpr`), the helpers the built-in handlers use, and three
namespaces: `statax.extend.params` (reading and writing the params of JAX's higher-order primitives,
whatever the JAX version names them), `statax.extend.reductions` (the reduction modes) and
`statax.extend.rows` (a `while_loop`'s iterations in rows).
Every built-in handler in `statax/handlers/` is written with these names only, JAX's public
API and its own library (an allowlist that `tests/test_layers.py` checks). `statax.extend`
itself imports the engine (`statax._core`) and the version shims (`statax._jax`), nothing
above them. `statax.extend.equinox` holds what statax knows of equinox's private machinery
(its filter primitives, `noinline` and the masking of its loops' state).
"""

from .._core.derivatives import only_in as only_in
from .._core.derivatives import pulled_with_rule as pulled_with_rule
from .._core.derivatives import zero_tangent as zero_tangent
from .._core.errors import StateError as StateError
from .._core.errors import error_if as error_if
from .._core.evaluator import equations as equations
from .._core.exposers import handler_from_exposer as handler_from_exposer
from .._core.exposers import inert as inert
from .._core.exposers import map_jaxprs as map_jaxprs
from .._core.exposers import mark as mark
from .._core.exposers import register_exposer as register_exposer
from .._core.exposers import set_steps as set_steps
from .._core.exposers import split_leaves as split_leaves
from .._core.exposers import take as take
from .._core.marks import acts_on as acts_on
from .._core.marks import current_selection as current_selection
from .._core.marks import find_saves as find_saves
from .._core.marks import find_saves_in_impl as find_saves_in_impl
from .._core.marks import inner_steps as inner_steps
from .._core.marks import loop_steps as loop_steps
from .._core.marks import pull_differentiates as pull_differentiates
from .._core.marks import pulling as pulling
from .._core.marks import trace_impl as trace_impl
from .._core.marks import traced_impl as traced_impl
from .._core.meta import ARRAY as ARRAY
from .._core.meta import StateMeta as StateMeta
from .._core.meta import kinds_str as kinds_str
from .._core.meta import occurrences as occurrences
from .._core.meta import share_taps as share_taps
from .._core.primitive import save_inter_p as save_inter_p
from .._core.registry import Exposer as Exposer
from .._core.registry import Handler as Handler
from .._core.registry import Rewrite as Rewrite
from .._core.registry import Rewritten as Rewritten
from .._core.registry import Rules as Rules
from .._core.registry import on_forget as on_forget
from .._core.registry import register_family as register_family
from .._core.registry import register_handler as register_handler
from .._core.registry import register_rules as register_rules
from .._core.registry import unregister_family as unregister_family
from .._core.registry import unregister_handler as unregister_handler
from .._core.rewrite import call_equation as call_equation
from .._core.rewrite import extend_equation as extend_equation
from .._core.rewrite import pull_jaxpr as pull_jaxpr
from .._core.rewrite import pull_open_jaxpr as pull_open_jaxpr
from .._core.rewrite import restage_equation as restage_equation
from .._core.sinking import Sinking as Sinking
from .._core.thread_state import Threading as Threading
from .._core.thread_state import batched_state_guard as batched_state_guard
from .._jax.jaxprs import bind as bind
from .._jax.jaxprs import dce as dce
from .._jax.jaxprs import trace as trace
from .._jax.jaxprs import wraps_jaxpr as wraps_jaxpr
from .._jax.primitive_params import vary as vary
from .._jax.primitives import HI_PRIMITIVE as HI_PRIMITIVE
from .._jax.primitives import JIT_PRIMITIVE as JIT_PRIMITIVE
from .._jax.primitives import REMAT_PRIMITIVE as REMAT_PRIMITIVE
from .._jax.primitives import SHARD_MAP_PRIMITIVE as SHARD_MAP_PRIMITIVE
from .._jax.primitives import SymbolicZero as SymbolicZero
from .._jax.tracing import batched_outputs as batched_outputs
from . import equinox as equinox
from . import params as params
from . import reductions as reductions
from . import rows as rows

__all__ = [
    "ARRAY",
    "Exposer",
    "HI_PRIMITIVE",
    "Handler",
    "JIT_PRIMITIVE",
    "REMAT_PRIMITIVE",
    "Rewrite",
    "Rewritten",
    "Rules",
    "SHARD_MAP_PRIMITIVE",
    "Sinking",
    "StateError",
    "StateMeta",
    "SymbolicZero",
    "Threading",
    "acts_on",
    "batched_outputs",
    "batched_state_guard",
    "bind",
    "call_equation",
    "current_selection",
    "dce",
    "equations",
    "equinox",
    "error_if",
    "extend_equation",
    "find_saves",
    "find_saves_in_impl",
    "handler_from_exposer",
    "inert",
    "inner_steps",
    "kinds_str",
    "loop_steps",
    "map_jaxprs",
    "mark",
    "occurrences",
    "on_forget",
    "only_in",
    "params",
    "pull_differentiates",
    "pull_jaxpr",
    "pull_open_jaxpr",
    "pulled_with_rule",
    "pulling",
    "reductions",
    "register_exposer",
    "register_family",
    "register_handler",
    "register_rules",
    "restage_equation",
    "rows",
    "save_inter_p",
    "set_steps",
    "share_taps",
    "split_leaves",
    "take",
    "trace",
    "trace_impl",
    "traced_impl",
    "unregister_family",
    "unregister_handler",
    "vary",
    "wraps_jaxpr",
    "zero_tangent",
]

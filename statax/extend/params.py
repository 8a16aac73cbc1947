"""Reading and writing the params of JAX's higher-order primitives, whatever the JAX version in
use names them: a view of each family (`*_parts`) and a way back (`*_params`). A handler that
reads params through these survives a JAX release that renames them (they live in
`statax._jax.primitive_params`, with the rest of what statax reads of JAX's internals). Each
`*_parts` gives a named tuple of the family's parts, read by field (`scan_parts(params).jaxpr`)."""

from .._core.custom_rules import custom_rule as custom_rule
from .._core.custom_rules import custom_rule_in_library as custom_rule_in_library
from .._core.custom_rules import custom_rule_inputs as custom_rule_inputs
from .._core.custom_rules import custom_rule_params as custom_rule_params
from .._jax.jaxprs import jaxprs_in_params as jaxprs_in_params
from .._jax.primitive_params import call_jaxpr as call_jaxpr
from .._jax.primitive_params import call_params as call_params
from .._jax.primitive_params import checkpoint_options as checkpoint_options
from .._jax.primitive_params import cond_branches as cond_branches
from .._jax.primitive_params import cond_params as cond_params
from .._jax.primitive_params import custom_params as custom_params
from .._jax.primitive_params import custom_primal as custom_primal
from .._jax.primitive_params import hi_expand as hi_expand
from .._jax.primitive_params import hi_jaxprs as hi_jaxprs
from .._jax.primitive_params import jit_jaxpr as jit_jaxpr
from .._jax.primitive_params import jit_params as jit_params
from .._jax.primitive_params import linear_solve_params as linear_solve_params
from .._jax.primitive_params import linear_solve_parts as linear_solve_parts
from .._jax.primitive_params import scan_params as scan_params
from .._jax.primitive_params import scan_parts as scan_parts
from .._jax.primitive_params import shard_map_parts as shard_map_parts
from .._jax.primitive_params import while_parts as while_parts

__all__ = [
    "call_jaxpr",
    "call_params",
    "checkpoint_options",
    "cond_branches",
    "cond_params",
    "custom_params",
    "custom_primal",
    "custom_rule",
    "custom_rule_in_library",
    "custom_rule_inputs",
    "custom_rule_params",
    "hi_expand",
    "hi_jaxprs",
    "jaxprs_in_params",
    "jit_jaxpr",
    "jit_params",
    "linear_solve_params",
    "linear_solve_parts",
    "scan_params",
    "scan_parts",
    "shard_map_parts",
    "while_parts",
]

"""The reduction modes of `save_inter(..., reduce=...)` (one table, `MODES`), and what handlers
of loops, branches and shards do with reduced intermediates: start, combine and fold
accumulators."""

from .._core.reduce import MODES as MODES
from .._core.reduce import Mode as Mode
from .._core.reduce import across_shards as across_shards
from .._core.reduce import check_in_while as check_in_while
from .._core.reduce import combine as combine
from .._core.reduce import fold_axis as fold_axis
from .._core.reduce import identity as identity
from .._core.reduce import merge as merge
from .._core.reduce import running as running
from .._core.reduce import stacked as stacked

__all__ = [
    "MODES",
    "Mode",
    "across_shards",
    "check_in_while",
    "combine",
    "fold_axis",
    "identity",
    "merge",
    "running",
    "stacked",
]

"""The reduction modes of `save_inter(..., reduce=...)` (one table, `MODES`), and what handlers
of loops, branches and shards do with reduced intermediates: start, combine and fold
accumulators."""

from .._reduce import MODES as MODES
from .._reduce import Mode as Mode
from .._reduce import across_shards as across_shards
from .._reduce import check_in_while as check_in_while
from .._reduce import combine as combine
from .._reduce import finalize as finalize
from .._reduce import fold_axis as fold_axis
from .._reduce import identity as identity
from .._reduce import merge as merge
from .._reduce import running as running
from .._reduce import stacked as stacked

__all__ = [
    "MODES",
    "Mode",
    "across_shards",
    "check_in_while",
    "combine",
    "finalize",
    "fold_axis",
    "identity",
    "merge",
    "running",
    "stacked",
]

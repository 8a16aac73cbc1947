"""Every iteration of a `while_loop` in rows (`pull(fn, steps=N)`): what a loop's handler keeps
of its marks, iteration by iteration, and the check of its bound."""

from .._core.loop_rows import check_bound as check_bound
from .._core.loop_rows import empty_rows as empty_rows
from .._core.loop_rows import row as row
from .._core.loop_rows import stacked_avals as stacked_avals
from .._core.loop_rows import write as write

__all__ = ["check_bound", "empty_rows", "row", "stacked_avals", "write"]

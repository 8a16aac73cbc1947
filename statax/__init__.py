"""statax: pull intermediate values out of JAX functions.

Mark a value with `save_inter(value, name=...)` anywhere inside a function, and
`pull(fn)(*args)` returns `(out, intermediates)`, through `jit`, `grad`, `vmap` and the rest.
"""

import importlib.metadata

from . import _display
from . import extend as extend
from . import handlers as handlers  # registers the built-in handlers
from ._display import describe as describe
from ._errors import HandlerError as HandlerError
from ._errors import KeyCollisionError as KeyCollisionError
from ._errors import PlantError as PlantError
from ._errors import ReduceMismatchError as ReduceMismatchError
from ._errors import SelectionError as SelectionError
from ._errors import StateError as StateError
from ._errors import StatefulWarning as StatefulWarning
from ._errors import UnhandledPrimitiveError as UnhandledPrimitiveError
from ._interventions import grad_inters as grad_inters
from ._interventions import plant as plant
from ._meta import StateMeta as StateMeta
from ._primitive import save_inter as save_inter
from ._pull import Key as Key
from ._pull import pull as pull
from ._records import records as records
from ._scope import scope as scope
from ._select import lines as lines
from ._select import modules as modules
from ._select import primitives as primitives
from ._select import scopes as scopes
from ._sinks import TensorBoardWriter as TensorBoardWriter
from ._sinks import plot_exponent_histogram as plot_exponent_histogram
from ._sinks import plot_heatmap as plot_heatmap
from ._sinks import plot_stat as plot_stat
from ._sinks import to_dataframe as to_dataframe
from ._stateful import get_state as get_state
from ._stateful import set_state as set_state
from ._stateful import stateful as stateful
from ._stats import stats as stats
from ._stats import tree_stats as tree_stats
from ._track import Tracker as Tracker
from .handlers.cond import BranchMismatchError as BranchMismatchError

_display.register_notebook_display()  # in Jupyter or Colab, pull's dicts display as tables

try:
    __version__ = importlib.metadata.version("statax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0.0.0"

__all__ = [
    "BranchMismatchError",
    "HandlerError",
    "Key",
    "KeyCollisionError",
    "PlantError",
    "ReduceMismatchError",
    "SelectionError",
    "StateError",
    "StateMeta",
    "StatefulWarning",
    "TensorBoardWriter",
    "Tracker",
    "UnhandledPrimitiveError",
    "describe",
    "extend",
    "get_state",
    "grad_inters",
    "lines",
    "modules",
    "plant",
    "plot_exponent_histogram",
    "plot_heatmap",
    "plot_stat",
    "primitives",
    "pull",
    "records",
    "save_inter",
    "scope",
    "scopes",
    "set_state",
    "stateful",
    "stats",
    "to_dataframe",
    "tree_stats",
]

"""statax: pull intermediate values out of JAX functions.

Mark a value with `save_inter(value, name=...)` anywhere inside a function, and
`pull(fn)(*args)` returns `(out, intermediates)`, through `jit`, `grad`, `vmap` and the rest.
"""

import importlib.metadata

from . import extend as extend
from . import handlers as handlers
from ._core.errors import CotangentsError as CotangentsError
from ._core.errors import HandlerError as HandlerError
from ._core.errors import KeyCollisionError as KeyCollisionError
from ._core.errors import PlantError as PlantError
from ._core.errors import ReduceMismatchError as ReduceMismatchError
from ._core.errors import SelectionError as SelectionError
from ._core.errors import StateError as StateError
from ._core.errors import StatefulWarning as StatefulWarning
from ._core.errors import StoreError as StoreError
from ._core.errors import SweepError as SweepError
from ._core.errors import UnhandledPrimitiveError as UnhandledPrimitiveError
from ._core.meta import StateMeta as StateMeta
from ._core.primitive import save_inter as save_inter
from ._core.scope import scope as scope
from ._core.state import get_state as get_state
from ._core.state import set_state as set_state
from ._drivers.gradients import NonFinite as NonFinite
from ._drivers.gradients import first_nonfinite as first_nonfinite
from ._drivers.interventions import grad_inters as grad_inters
from ._drivers.interventions import plant as plant
from ._drivers.naming import Key as Key
from ._drivers.pull import pull as pull
from ._drivers.sites import Site as Site
from ._drivers.sites import Sites as Sites
from ._drivers.sites import sites as sites
from ._drivers.stateful import stateful as stateful
from ._monitor import display as _display
from ._monitor.display import describe as describe
from ._monitor.records import records as records
from ._monitor.sinks import TensorBoardWriter as TensorBoardWriter
from ._monitor.sinks import plot_exponent_histogram as plot_exponent_histogram
from ._monitor.sinks import plot_heatmap as plot_heatmap
from ._monitor.sinks import plot_stat as plot_stat
from ._monitor.sinks import to_dataframe as to_dataframe
from ._monitor.stats import stats as stats
from ._monitor.stats import tree_stats as tree_stats
from ._monitor.track import Tracker as Tracker
from ._patching.result import SweepResult as SweepResult
from ._patching.sweep import sweep as sweep
from ._select.vocabulary import lines as lines
from ._select.vocabulary import modules as modules
from ._select.vocabulary import primitives as primitives
from ._select.vocabulary import scopes as scopes
from ._store.reading import Store as Store
from ._store.reading import StoredArray as StoredArray
from ._store.reading import open_store as open_store
from ._store.record import Recorder as Recorder
from ._store.record import record as record
from .handlers.cond import BranchMismatchError as BranchMismatchError

_display.register_notebook_display()  # in Jupyter or Colab, pull's dicts display as tables

try:
    __version__ = importlib.metadata.version("statax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0.0.0"

__all__ = [
    "BranchMismatchError",
    "CotangentsError",
    "HandlerError",
    "Key",
    "KeyCollisionError",
    "NonFinite",
    "PlantError",
    "Recorder",
    "ReduceMismatchError",
    "SelectionError",
    "Site",
    "Sites",
    "StateError",
    "StateMeta",
    "StatefulWarning",
    "Store",
    "StoreError",
    "StoredArray",
    "SweepError",
    "SweepResult",
    "TensorBoardWriter",
    "Tracker",
    "UnhandledPrimitiveError",
    "describe",
    "extend",
    "first_nonfinite",
    "get_state",
    "grad_inters",
    "lines",
    "modules",
    "open_store",
    "plant",
    "plot_exponent_histogram",
    "plot_heatmap",
    "plot_stat",
    "primitives",
    "pull",
    "record",
    "records",
    "save_inter",
    "scope",
    "scopes",
    "set_state",
    "sites",
    "stateful",
    "stats",
    "sweep",
    "to_dataframe",
    "tree_stats",
]

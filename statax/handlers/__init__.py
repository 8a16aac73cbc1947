"""Handlers that let `pull` see inside JAX's higher-order primitives (internal).

One module per primitive family; importing this package registers them all. Each module opens
with what it reads from the equation's params, how intermediates leave, and its limits.
"""

from . import calls as calls
from . import cond as cond
from . import custom_derivatives as custom_derivatives
from . import equinox as equinox
from . import hijax as hijax
from . import loops as loops
from . import shard_map as shard_map
from . import solves as solves

"""Handlers that let `pull` see inside JAX's higher-order primitives (internal).

One module per primitive family; importing this package registers them all. Each module opens
with what it reads from the equation's params, how intermediates leave, and its limits.
"""

from statax.handlers import callbacks as callbacks
from statax.handlers import calls as calls
from statax.handlers import cond as cond
from statax.handlers import custom_derivatives as custom_derivatives
from statax.handlers import equinox as equinox
from statax.handlers import hijax as hijax
from statax.handlers import loops as loops
from statax.handlers import shard_map as shard_map
from statax.handlers import solves as solves

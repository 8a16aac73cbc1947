"""Optional dependencies: imported where they are used, with an error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise an ImportError that says which statax extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{module.split('.')[0]} is needed for this and is not installed. "
            f'Install it with: pip install "statax[{extra}]"'
        ) from error

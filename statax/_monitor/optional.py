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


def progress_bar(progress: bool | None, caller: str, extra: str, **options):
    """A tqdm bar for `caller`'s `progress=`: `False`, none; `None`, one where tqdm is installed
    and the output is a terminal; `True`, one always (an ImportError naming the extra that
    installs tqdm, where it is not installed). `options` go to tqdm; `None` for no bar."""
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError(
                f"{caller}(progress=True) needs tqdm. Install it with: "
                f'pip install "statax[{extra}]"'
            ) from None
        return None
    return tqdm(disable=None if progress is None else False, **options)

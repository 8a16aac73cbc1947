"""What a store says of itself (its metadata: keys, how its rows were made, versions), and
whether a recording fits it: the keys and their rows (`keys_problems`), and how the rows were
made (`settings_problems`)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata

import jax

from .capture import POSITIONS
from .layout import FORMAT

__all__ = ["keys_problems", "made", "qualname", "settings_problems", "subsample_of"]


def keys_problems(held: dict, described: dict) -> list[str]:
    """What does not fit: keys new or missing, rows of another kind, shape or dtype."""
    problems = [f"keys {sorted(set(described) - set(held))} are new"] * bool(
        set(described) - set(held)
    ) + [f"keys {sorted(set(held) - set(described))} are missing"] * bool(
        set(held) - set(described)
    )
    for key in sorted(set(described) & set(held)):
        now, then = described[key], held[key]
        if "rows" in now and now["rows"] != then["rows"]:
            problems.append(
                f"{key!r}'s rows are {now['rows']}, where the store's are {then['rows']}"
            )
        if (now["row_shape"], now["dtype"]) != (then["row_shape"], then["dtype"]):
            problems.append(
                f"{key!r} is {now['dtype']}{tuple(now['row_shape'])} per row, where the "
                f"store holds {then['dtype']}{tuple(then['row_shape'])}"
            )
    return problems


def settings_problems(metadata: dict, selection: dict, subsample) -> list[str]:
    """How the store's rows were made (`summarize=`, the subsample and its seed) against a
    recorder's: rows made another way, of the same shapes, would be mixed in silently. (The
    marks and selections show in the keys, which `keys_problems` compares.)"""
    held = {
        "summarize=": metadata["selection"].get("summarize"),
        "subsample": metadata.get("subsample"),
    }
    now = {"summarize=": selection["summarize"], "subsample": subsample_of(subsample)}
    return [
        f"its {what} is {held[what]!r}, this recorder's {now[what]!r}"
        for what in now
        if held[what] != now[what]
    ]


def made(keys, processes, subsample, selection) -> dict:
    """The metadata of a store made now."""
    return {
        "format": FORMAT,
        "keys": keys,
        "rows": "batches" if any(k["rows"] == "batches" for k in keys.values()) else "examples",
        "selection": selection,
        "subsample": subsample_of(subsample),
        "processes": processes,
        "versions": {
            "statax": _version("statax"),
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "tensorstore": _version("tensorstore"),
        },
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def subsample_of(subsample) -> dict | None:
    """The subsample as the metadata holds it."""
    if subsample is None:
        return None
    return dict(zip(("positions", "axis", "seed"), subsample)) | {"key": POSITIONS}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def qualname(f) -> str:
    """A function as the metadata names it: its module and name, and a digest of its code (two
    lambdas of one module are told apart; the same function, moved in its file, is not)."""
    name = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
    code = getattr(f, "__code__", None)
    if code is not None:
        name += f" (code {hashlib.sha1(_code_bytes(code)).hexdigest()[:12]})"
    return name


def _code_bytes(code) -> bytes:
    """A code object's bytecode, constants and names (nested code objects by their own)."""
    consts = [_code_bytes(c) if hasattr(c, "co_code") else repr(c).encode() for c in code.co_consts]
    return b"|".join([code.co_code, *consts, repr(code.co_names).encode()])

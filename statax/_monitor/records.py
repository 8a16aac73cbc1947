"""Summaries on the host: one record per tensor and step, as tandv's schema has them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from .stats import SCALARS

__all__ = ["records"]


def _is_stats(x: Any) -> bool:
    return isinstance(x, Mapping) and "exponent_counts" in x and "mean" in x


def records(step: int, summaries: Mapping[str, Any], tensor_type: str = "Activation") -> list[dict]:
    """Flatten `summaries` (possibly nested, e.g. `{"Weight": tree_stats(params), ...}`, leaves
    being `stats` dicts) into one record per tensor: name, type, tensor_type, step, dtype,
    scalar stats, exponent counts with `-inf` (underflow) and `+inf` (overflow)."""
    summaries = jax.device_get(summaries)
    out = []
    for tensor_type_, name, st in _walk(summaries, tensor_type):
        lo = int(st["exponent_min"])
        counts = np.asarray(st["exponent_counts"])
        exponents = {lo + int(i): int(counts[i]) for i in np.flatnonzero(counts)}
        exponents["-inf"] = int(st.get("underflow", 0))
        exponents["+inf"] = int(st.get("overflow", 0))
        out.append(
            {
                "name": name,
                "type": "",
                "tensor_type": tensor_type_,
                "step": int(step),
                "dtype": str(np.asarray(st["dtype"]).dtype) if "dtype" in st else "float32",
                "scalar_stats": {k: float(st[k]) for k in SCALARS if k in st},
                "exponent_counts": exponents,
            }
        )
    return out


_TENSOR_TYPES = ("Activation", "Gradient", "Weight", "Optimiser_State")


def _walk(tree, tensor_type, prefix=()) -> Iterator[tuple[str, str, Mapping]]:
    if _is_stats(tree):
        yield tensor_type, path_name_from(prefix), tree
        return
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if not prefix and key in _TENSOR_TYPES:
                yield from _walk(value, key, ())
            else:
                yield from _walk(value, tensor_type, (*prefix, str(key)))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _walk(value, tensor_type, (*prefix, f"[{i}]"))


def path_name_from(parts) -> str:
    name = ""
    for part in parts:
        name += part if part.startswith("[") or not name else f".{part}"
    return name

"""What a recording step computes on the device: `pull`'s values, each with its examples first
(or a row per batch), a subsample of positions, and the move to host memory."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from .._core.errors import StoreError
from .._core.meta import RAN
from .._drivers.naming import Key, keys_named

__all__ = ["POSITIONS", "Capture", "check_host_memory", "step", "subsample"]

POSITIONS = "_positions"  # the key of the positions a subsample kept


@dataclasses.dataclass(frozen=True)
class Capture:
    """What a step does after `pull`."""

    pulled: Any
    axis: int | tuple  # an int, or `(key, axis)` pairs
    subsample: tuple | None
    offload: bool
    keys: tuple | None = None  # the entries of `keys=` (keys or names), or None: every key
    output: bool = True  # whether the step returns the function's output (else: None)

    def axes_of(self, inters: dict) -> dict:
        """Each key's examples axis from `axis={entry: axis}`, an entry naming a key or every
        occurrence of a name; an entry that names none is an error."""
        axes = {}
        for entry, axis in self.axis:
            found = _named("axis", f"{{{entry!r}: {axis}}}", entry, inters)
            axes.update(dict.fromkeys(found, axis))
        for key in inters:  # a `.ran` mask with its value's axis
            base = str(key).removesuffix(RAN)
            if key not in axes and base != str(key) and base in axes:
                axes[key] = axes[base]
        return axes

    def kept(self, inters: dict) -> dict:
        """The keys `keys=` names, with their `.ran` masks (every key without it)."""
        if self.keys is None:
            return inters
        chosen = set()
        for entry in self.keys:
            chosen.update(_named("keys", repr(list(self.keys)), entry, inters))
        return {
            k: v for k, v in inters.items() if k in chosen or str(k).removesuffix(RAN) in chosen
        }

    def device_values(self, inters: dict, batch) -> dict[str, jax.Array]:
        """What is stored, on device: each value's leaves by key, examples first (a row per
        batch under `summarize=`), subsampled, on host memory if offloaded."""
        per_batch = self.pulled.summarize is not None
        inters = self.kept(inters)
        axes = self.axes_of(inters) if isinstance(self.axis, tuple) else {}
        values = {}
        for key, value in inters.items():
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                name = key if not path else f"{key}{jax.tree_util.keystr(path)}"
                leaf = jnp.asarray(leaf)
                if per_batch:
                    leaf = leaf[None]
                else:
                    a = axes.get(key, 0) if isinstance(self.axis, tuple) else self.axis
                    if leaf.ndim <= a:
                        raise StoreError(
                            f"stx.record: {name!r} (saved at {_location(key)}) has shape "
                            f"{leaf.shape}, with no axis {a} to count examples along. Pass "
                            f"axis={{{str(key)!r}: ...}}, or leave it out with only=."
                        )
                    leaf = jnp.moveaxis(leaf, a, 0)
                values[Key(name, _location(key), getattr(key, "reduce", None))] = leaf
        if self.subsample is not None:
            values = subsample(values, *self.subsample, batch)
        if self.offload:
            values = {k: jax.device_put(v, jax.memory.Space.Host) for k, v in values.items()}
        return values


def step(capture: Capture, batch, args: tuple, kwargs: dict):
    """The step, traced into the recorder's compiled program: `(out, values)`, `out` None
    where the output is not asked for (the compiler then drops what only it needs: the layers
    after the last one recorded)."""
    out, inters = capture.pulled(*args, **kwargs)
    return (out if capture.output else None), capture.device_values(inters, batch)


def subsample(values: dict, k: int, axis: int, seed: int, batch) -> dict:
    """Keep `k` random positions (sorted) per example along `axis` of every value that has it;
    the same positions in each, drawn from `seed` and the batch's number."""
    having = {key: v.shape[axis] for key, v in values.items() if v.ndim > axis}
    if len(set(having.values())) != 1:
        shown = ", ".join(f"{k!r}: {n}" for k, n in having.items()) or "none has one"
        raise StoreError(
            f"stx.record(positions={k}, position_axis={axis}): the values must have one length "
            f"along axis {axis} to subsample it ({shown}). Leave the others out with only=."
        )
    length = next(iter(having.values()))
    if k > length:
        raise StoreError(
            f"stx.record(positions={k}): the values have {length} positions along axis {axis}; "
            f"keep at most {length}."
        )
    examples = next(iter(values.values())).shape[0]
    key = jax.random.fold_in(jax.random.key(seed), batch)
    kept = jnp.sort(jnp.argsort(jax.random.uniform(key, (examples, length)), axis=1)[:, :k], 1)
    out = {}
    for name, v in values.items():
        if name in having:
            shape = [examples] + [1] * (v.ndim - 1)
            shape[axis] = k
            v = jnp.take_along_axis(v, kept.reshape(shape), axis=axis)
        out[name] = v
    out[Key(POSITIONS, "stx.record(positions=...)")] = kept.astype(jnp.int32)
    return out


def _named(option: str, given: str, entry, inters) -> list:
    """The keys `entry` of an option names (a key, or a name for each of its occurrences)."""
    found = keys_named(entry, inters)
    if not found:
        raise StoreError(
            f"stx.record({option}={given}): {entry!r} names no key the function returns (a "
            f"key, 'h_0', or a name, 'h', for each of its occurrences). The keys: "
            f"{list(inters)}."
        )
    return found


def _location(key) -> str:
    return getattr(key, "location", "")


@functools.cache
def _host_memory_on(platform: str) -> str | None:
    probe = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Host))
    try:
        kind = probe(jnp.zeros(1)).sharding.memory_kind
    except Exception as error:  # XLA has no host placement here
        return str(error).splitlines()[0]
    return None if kind == "pinned_host" else f"its outputs stay in {kind!r} memory"


def check_host_memory() -> None:
    platform = jax.devices()[0].platform
    why = _host_memory_on(platform)
    if why is not None:
        raise ValueError(
            f"stx.record(offload=True): this backend ({platform}, JAX {jax.__version__}) cannot "
            f"place values in host memory inside a compiled program ({why}). Record without "
            "offload=True: values then leave the device as they are written."
        )

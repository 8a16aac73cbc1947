"""What a sweep is asked, checked: its inputs, its batch size, its sites and their axes, the
runs they ran in, and whether attribution can take a gradient at them. Each error says what
was wrong, where the site was saved, and what to do."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import SweepError
from .._core.meta import KeyName
from .._drivers.naming import keys_named

__all__ = [
    "arguments",
    "axes_name_sites",
    "axes_of",
    "axis_sizes",
    "batch_size",
    "check_ran",
    "differentiable",
    "same_shapes",
    "sites",
]


def _site(key) -> str:
    """A site as an error names it: its key and where its value was saved."""
    return f"site {key!r} (saved at {getattr(key, 'location', '?')})"


def batch_size(size) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SweepError(
            f"stx.sweep: batch_size={size!r}; it is how many patches run at once, an int of 1 "
            "or more."
        )


def axes_name_sites(axes: dict, keys: list) -> None:
    """Per-site axes name sites of the sweep (where they mix the two forms, `axes_of` says)."""
    if not all(isinstance(v, Mapping) for v in axes.values()):
        return
    unknown = [entry for entry in axes if not keys_named(entry, keys)]
    if unknown:
        raise SweepError(
            f"stx.sweep(axes=...): {unknown} name no site of the sweep (a key, 'h_0', or a "
            f"name, 'h', for each of its occurrences). The sites: {keys}."
        )


def check_ran(ran: dict) -> None:
    """A site in a branch not taken (in either run) is an error, as one that never ran."""
    missing = [k for k, flag in ran.items() if not bool(np.all(flag))]
    if missing:
        where = ", ".join(f"{k!r} (saved at {getattr(k, 'location', '?')})" for k in missing)
        raise SweepError(
            f"stx.sweep: the sites {where} did not run in the clean or the corrupted run (a "
            "branch not taken): patching them changes nothing. Leave them out with sites=."
        )


def arguments(args, which: str) -> tuple:
    if not isinstance(args, tuple):
        raise SweepError(
            f"stx.sweep: {which}= is a tuple of fn's positional arguments, got "
            f"{type(args).__name__}. For one argument x, pass ({which}=(x,))."
        )
    return args


def sites(asked, values: dict) -> list:
    """The keys `asked` names (keys or names; one string is one), every key by default."""
    if not values:
        raise SweepError(
            "stx.sweep: the function has no site to patch: no save_inter ran in the clean run, "
            "and at= selected nothing. Mark values with stx.save_inter, or select places with "
            "at= (stx.modules(...), stx.scopes(...)); stx.sites(fn)(*clean) maps them."
        )
    if asked is None:
        return list(values)
    keys, missing = [], []
    for site in [asked] if isinstance(asked, str) else asked:
        found = keys_named(site, values)
        keys += [k for k in found if k not in keys]
        if not found:
            missing.append(site)
    if missing:
        raise SweepError(
            f"stx.sweep: the sites {missing} did not run in the clean run: no mark or selected "
            f"place of that key or name saved a value (a branch not taken, a name misspelt). "
            f"The sites that ran: {list(values)}."
        )
    return keys


def differentiable(keys, values: dict) -> None:
    """Attribution takes a gradient at every site: a site of integers (token ids) has none."""
    for key in keys:
        dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(values[key])}
        if any(not jnp.issubdtype(d, jnp.inexact) for d in dtypes):
            raise SweepError(
                f"stx.sweep(method='attribution'): {_site(key)} holds "
                f"{', '.join(sorted(dtypes))} values, which have no gradient to take the "
                "first-order term from. Leave it out with sites=, or sweep it with "
                "method='exact'."
            )


def same_shapes(keys, clean: dict, corrupted: dict) -> None:
    for key in keys:
        if key not in corrupted:
            raise SweepError(
                f"stx.sweep: {_site(key)} ran in the clean run but not in the corrupted "
                "one. Patch sites that run in both."
            )
        shapes = [[x.shape for x in jax.tree.leaves(v)] for v in (clean[key], corrupted[key])]
        if shapes[0] != shapes[1]:
            raise SweepError(
                f"stx.sweep: {_site(key)} has shape {shapes[0]} in the clean run and "
                f"{shapes[1]} in the corrupted one: the two "
                "inputs must give every site one shape (the same batch, the same length; pad "
                "the prompts to one length)."
            )


def axes_of(key, axes: dict, per_site: bool) -> dict:
    """A site's axes: the sweep's, or its own (by key, then by name) where they are per site."""
    if not per_site:
        return axes
    if not all(isinstance(v, Mapping) for v in axes.values()):
        raise SweepError(
            "stx.sweep: axes= is either {name: axis} for every site, or {site: {name: axis}} "
            f"for each; it mixes the two: {axes}."
        )
    name = KeyName.parse(str(key)).name
    return dict(axes.get(key, axes.get(name, {})))


def axis_sizes(key, value, axes: dict) -> tuple[int, ...]:
    leaves = jax.tree.leaves(value)
    sizes = []
    for name, axis in axes.items():
        lengths = {leaf.shape[axis] for leaf in leaves if -leaf.ndim <= axis < leaf.ndim}
        if len(lengths) != 1 or any(not -leaf.ndim <= axis < leaf.ndim for leaf in leaves):
            shapes = [leaf.shape for leaf in leaves]
            raise SweepError(
                f"stx.sweep: {_site(key)} has no "
                f"axis {axis} ({name!r}) to patch along: its value's shape is "
                f"{shapes[0] if len(shapes) == 1 else shapes}. Give axes= that every site has, "
                "or sweep the sites apart."
            )
        sizes.append(lengths.pop())
    return tuple(sizes)

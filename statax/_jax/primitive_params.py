"""Views of the params of JAX's higher-order primitives (`*_parts`) and ways back (`*_params`),
whatever the JAX version in use names them (JAX 0.8 -- 0.12): the handler API's parameter views,
re-exported as `statax.extend.params`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex

from .jaxprs import jaxprs_in_params
from .primitives import UNSPECIFIED_SHARDING

__all__ = [
    "JAX_VERSION",
    "LinearSolveParts",
    "ScanParts",
    "ShardMapParts",
    "WhileParts",
    "call_jaxpr",
    "call_params",
    "cond_branches",
    "cond_params",
    "custom_params",
    "custom_primal",
    "hi_expand",
    "hi_jaxprs",
    "jit_call_params",
    "jit_jaxpr",
    "jit_params",
    "linear_solve_params",
    "linear_solve_parts",
    "scan_params",
    "scan_parts",
    "shard_map_manual_axes",
    "shard_map_parts",
    "vary",
    "while_parts",
]

# (major, minor, patch) of the JAX in use; branches below name the versions they cover.
JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__[:3])


# ---- what handlers read from and write to equations' params --------------------------------
#
# Handlers never read JAX's param names themselves: a rename in a new JAX release is a change
# here. Each primitive family has a view (`*_parts`) and a way back (`*_params`).


class ScanParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr  # (consts, carry, xs) -> (carry, ys)
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int


# JAX 0.11 replaced scan's `num_consts`/`num_carry` (and, in 0.8 -- 0.9, `linear` and
# `_split_transpose`) by `ft_in`/`ft_out`: `FlatTree`s of (consts, carry, xs) and (carry, ys).
_SCAN_FLAT_TREES = JAX_VERSION >= (0, 11)
if _SCAN_FLAT_TREES:
    from jax._src import flattree as ft  # JAX 0.11+


def scan_parts(params: dict) -> ScanParts:
    """The parts of a `scan` equation, whatever JAX names them."""
    if _SCAN_FLAT_TREES:  # JAX 0.11+
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    else:  # JAX 0.8 -- 0.10
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    return ScanParts(
        params["jaxpr"],
        num_consts,
        num_carry,
        params["length"],
        params["reverse"],
        params["unroll"],
    )


def scan_params(params: dict, parts: ScanParts) -> dict:
    """`params` of a `scan` equation rewritten to `parts` (whose jaxpr may have more ys, or more
    consts, carries or xs, than the original)."""
    jaxpr, num_consts, num_carry = parts.jaxpr, parts.num_consts, parts.num_carry
    num_xs = len(jaxpr.in_avals) - num_consts - num_carry
    num_ys = len(jaxpr.out_avals) - num_carry
    new = dict(params, jaxpr=jaxpr, length=parts.length, reverse=parts.reverse, unroll=parts.unroll)
    if _SCAN_FLAT_TREES:  # JAX 0.11+
        new["ft_in"] = ft.pack((ft.nones(num_consts), ft.nones(num_carry), ft.nones(num_xs)))
        new["ft_out"] = ft.pack((ft.nones(num_carry), ft.nones(num_ys)))
        return new
    new.update(num_consts=num_consts, num_carry=num_carry)
    if "linear" in params:  # JAX 0.8 -- 0.9
        new["linear"] = (False,) * len(jaxpr.in_avals)
    return new


class WhileParts(NamedTuple):
    cond_jaxpr: jex.ClosedJaxpr  # (cond_consts, carry) -> pred
    body_jaxpr: jex.ClosedJaxpr  # (body_consts, carry) -> carry
    cond_nconsts: int
    body_nconsts: int


def while_parts(params: dict) -> WhileParts:
    """The parts of a `while` equation (names unchanged in JAX 0.8 -- 0.12)."""
    return WhileParts(
        params["cond_jaxpr"], params["body_jaxpr"], params["cond_nconsts"], params["body_nconsts"]
    )


def cond_branches(params: dict) -> tuple:
    """The branches of a `cond` equation (`lax.cond`'s false branch first)."""
    return tuple(params["branches"])


def cond_params(params: dict, branches: Sequence) -> dict:
    return dict(params, branches=tuple(branches))


def jit_jaxpr(params: dict) -> jex.ClosedJaxpr:
    return params["jaxpr"]


def jit_params(params: dict, jaxpr: jex.ClosedJaxpr) -> dict:
    """A `jit` equation's params for `jaxpr`, which takes the original inputs followed by new
    ones and returns the original outputs followed by new ones: those get unspecified sharding
    and default layout (the compiler chooses), and are not donated."""
    k = len(jaxpr.out_avals) - len(params["out_shardings"])
    i = len(jaxpr.in_avals) - len(params["in_shardings"])
    return dict(
        params,
        jaxpr=jaxpr,
        out_shardings=(*params["out_shardings"], *(UNSPECIFIED_SHARDING,) * k),
        out_layouts=(*params["out_layouts"], *(None,) * k),
        in_shardings=(*params["in_shardings"], *(UNSPECIFIED_SHARDING,) * i),
        in_layouts=(*params["in_layouts"], *(None,) * i),
        donated_invars=(*params["donated_invars"], *(False,) * i),
    )


@functools.cache
def _empty_jit_params() -> dict:
    (eqn,) = jax.make_jaxpr(jax.jit(lambda: ()))().eqns
    return dict(eqn.params)


def jit_call_params(jaxpr: jex.ClosedJaxpr, name: str) -> dict:
    """The params of a new `jit` equation that calls `jaxpr` (unspecified shardings, default
    layouts, nothing donated, `inline` as `jax.jit` has it: `False` before JAX 0.12,
    `Inline.AUTO` since): binding `JIT_PRIMITIVE` with them stages one equation into a trace,
    where evaluating `jaxpr` would stage each of its equations again."""
    return dict(jit_params(_empty_jit_params(), jaxpr), name=name)


def call_jaxpr(params: dict):
    """The function of a `closed_call`/`call`/`checkpoint` equation (closed or open jaxpr)."""
    return params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]


def checkpoint_options(params: dict) -> dict:
    """`jax.checkpoint`'s keyword arguments that a `checkpoint` equation was made with."""
    return {"prevent_cse": params.get("prevent_cse", True), "policy": params.get("policy")}


def call_params(params: dict, jaxpr) -> dict:
    key = "call_jaxpr" if "call_jaxpr" in params else "jaxpr"
    return dict(params, **{key: jaxpr})


def custom_primal(params: dict) -> jex.ClosedJaxpr:
    """The primal function of a `custom_jvp_call`/`custom_vjp_call` equation."""
    return params["call_jaxpr"]


def custom_params(params: dict, primal: jex.ClosedJaxpr) -> dict:
    return dict(params, call_jaxpr=primal)


class LinearSolveParts(NamedTuple):
    jaxprs: Any  # namedtuple (matvec, vecmat, solve, transpose_solve), some None
    const_lengths: Any  # namedtuple of the same fields: how many consts each takes


def linear_solve_parts(params: dict) -> LinearSolveParts:
    return LinearSolveParts(params["jaxprs"], params["const_lengths"])


def linear_solve_params(params: dict, jaxprs) -> dict:
    return dict(params, jaxprs=jaxprs)


class ShardMapParts(NamedTuple):
    jaxpr: jex.Jaxpr  # the per-shard body, an open jaxpr
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    check_vma: bool
    manual_axes: frozenset  # the mesh axes this shard_map makes manual (`handlers/shard_map`)


def shard_map_parts(params: dict) -> ShardMapParts:
    mesh = params["mesh"]
    return ShardMapParts(
        params["jaxpr"],
        mesh,
        tuple(params["in_specs"]),
        tuple(params["out_specs"]),
        params["check_vma"],
        shard_map_manual_axes(mesh, params),
    )


def hi_jaxprs(params: dict) -> list:
    """The jaxprs a `call_hi_primitive` equation holds in its object's params."""
    return list(jaxprs_in_params(params["_prim"].params))


def hi_expand(params: dict) -> Callable:
    """`f(*flat_args) -> flat outputs`: what a `call_hi_primitive` equation computes, in terms
    of ordinary primitives (its forward pass; its own rules still govern derivatives)."""
    prim = params["_prim"]

    def expand(*flat):
        out = prim.expand(*prim.in_tree.unflatten(flat))
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != prim.out_tree:
            raise TypeError(f"{prim} expanded to {tree}, not its declared {prim.out_tree}")
        return leaves

    return expand


def shard_map_manual_axes(mesh, params: dict) -> frozenset:
    """The mesh axes a `shard_map` equation makes manual (`manual_axes` in JAX 0.8,
    `newly_manual_axes` later; all of the mesh's axes if neither is there)."""
    for key in ("manual_axes", "newly_manual_axes"):
        if key in params:
            return frozenset(params[key])
    return frozenset(mesh.axis_names)


def vary(x, axes: tuple) -> Any:
    """`x` marked as varying over the manual `axes` (a no-op for axes it already varies on)."""
    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):  # JAX 0.10+
        varying = aval.manual_axis_type.varying
    else:  # JAX 0.8 -- 0.9
        varying = getattr(aval, "vma", frozenset(axes))
    missing = tuple(a for a in axes if a not in varying)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # JAX 0.9+
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX 0.8

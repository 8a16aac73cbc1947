"""statax's fast paths, behind one switch.

Each fast path does what a plain path beside it does, for less: it changes no value, key or
program that a user or a library sees. They are:

* **straight staging**: a mark is staged into the jaxpr being traced as one equation
  (`_staging.stage`, `_staging.observe`), rather than by `bind`;
* **call-site caches**: `save_inter` on a staged array at a call site seen before only looks
  up the params it made there;
* **inline pulls**: `pull` where a jaxpr is being staged (under `jit`, in a loop body) traces
  the function straight into it and hands the marks made at its own level to a `Collector`,
  rather than tracing apart and calling the rewrite as one `jit` equation;
* **the eager compiled path**: `pull(jax.jit(f))` called on arrays runs one `jax.jit` of its
  own evaluation, rather than the per-call Python work;
* **marks with no outputs**: outside a `pull`, a mark is an equation that only reads its value
  (the program reads on from the value itself), rather than an identity with outputs.

`STATAX_FAST_PATHS=0` in the environment turns them all off (CI runs the suite both ways).
Where the JAX internals they lean on are missing (`probe`), they are off too, and statax
works on the plain paths.
"""

from __future__ import annotations

import contextlib
import os

from . import staging as _staging

__all__ = ["enabled", "on", "probe"]

# JAX's private modules, as `_staging` (whose fast paths these are) holds them.
core, pe, source_info_util = _staging.core, _staging.pe, _staging.source_info_util

# What the fast paths read of JAX's internals (JAX 0.8 -- 0.12); `docs/maintaining.md` lists
# them. (object, attribute) pairs, checked at import.
REQUIRED = [
    (pe, "DynamicJaxprTrace"),
    (pe, "DynamicJaxprTracer"),
    (pe, "TracingEqn"),
    (pe, "JaxprStackFrame"),
    (pe.DynamicJaxprTrace, "emit_eqn"),
    (pe.JaxprStackFrame, "get_eqns"),
    (core, "JaxprEqn"),
    (core, "DropVar"),
    (source_info_util, "_source_info_context"),
]


def probe() -> str | None:
    """Why the fast paths cannot run on this JAX (an internal they read is missing), or
    `None` where they can."""
    for obj, name in REQUIRED:
        if not hasattr(obj, name):
            return f"{getattr(obj, '__name__', obj)}.{name} is missing"
    fields = getattr(pe.JaxprStackFrame, "__annotations__", {})  # declared, JAX 0.8 -- 0.12
    for name in ("tracing_eqns", "auto_dce"):
        if name not in fields:
            return f"JaxprStackFrame.{name} is missing"
    return None


MISSING = probe()  # why they are off on this JAX, or None
_WANTED = os.environ.get("STATAX_FAST_PATHS", "1").strip().lower() not in ("0", "false", "no")
on = _WANTED and MISSING is None  # read where each fast path decides


@contextlib.contextmanager
def enabled(flag: bool):
    """Within, the fast paths are on (where this JAX has what they need) or off."""
    global on
    old, on = on, bool(flag) and MISSING is None
    try:
        yield
    finally:
        on = old

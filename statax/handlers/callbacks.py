"""Primitives that hold Python functions in their params and run no code of a user's that
marks: declared so (`runs_python=False` in their records), `pull` does not trace their impl
to look for marks.

* Host callbacks (`jax.pure_callback`, `jax.experimental.io_callback`, `jax.debug.callback`,
  `jax.debug.print`) run their function on the host, on values, when the program runs: no
  trace is there to collect a mark, and tracing them would run the user's callback.
* JAX's PRNG primitives (`random_seed`, `random_wrap`) hold the key implementation, JAX's own
  functions.

By name, since JAX keeps these primitives private (JAX 0.8 -- 0.12).
"""

from __future__ import annotations

from statax.extend import Rules, register_rules

for _name in ("pure_callback", "io_callback", "debug_callback", "debug_print"):
    register_rules(_name, Rules(runs_python=False))
for _name in ("random_seed", "random_wrap"):
    register_rules(_name, Rules(runs_python=False))

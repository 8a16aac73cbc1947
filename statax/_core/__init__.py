"""The engine: `save_inter` and its rules, the one evaluator, the handler registry and its
flags, staging, named state and its threading, metas and errors.

It imports only the version shims (`statax._jax`): the drivers, selections, monitoring and the
handlers sit above it (`tests/test_layers.py` checks the direction).

Reading order, from the bottom floor up (each module imports only those on the floors below
it, and `statax._jax`):

0. `context` (statax's config states in JAX's trace context, and its effects), `meta`
   (`StateMeta`), `evaluator` (the one walk over a jaxpr), `jax_rules` (registering rules),
   `tracebacks`, `flat_calls` (how a driver calls a function, flat), `python_rules`,
   `custom_rules`, `equinox_internals` (equinox's private machinery);
1. `registry` (what statax knows of each primitive: one `Rules` record each), `staging`
   (marks staged straight into a trace), `cotangents` (the tap that marks a cotangent),
   `scope`, `errors`;
2. `fastpaths` (the one switch), `reduce` (`reduce=` modes);
3. `primitive` (`save_inter_p` and all of its rules);
4. `marks` (finding marks, at any depth);
5. `rewrite` (`pull_jaxpr`: marks made outputs), `batching` (statax's batching rules);
6. `exposers` (loops and branches: marks taken out, and put back outside), `loop_rows`
   (every iteration of a `while_loop`, in rows);
7. `derivatives` (marks in custom derivative rules);
8. `state`, 9. `thread_state` (named state, and threading it through every primitive).

Three callback slots let a lower floor call up, where an import would run the wrong way:

* `registry.on_forget(callback)`: when the handlers change, every cache of searches and
  rewrites is dropped (`marks`, `rewrite`, `exposers`, and above: `_drivers.cache`,
  `_drivers.compiled`, `handlers.custom_derivatives`);
* `registry.on_change(callback)`: when a primitive's record is registered or removed, what
  is installed with it in JAX follows (`batching` installs statax's batching rule where the
  record asks for one, and gives JAX's back where it no longer does);
* `cotangents.on_transpose(mark)`: the tap's transpose marks the cotangent as a `save_inter`
  would (`primitive._mark_cotangent`), collected and planted under its key.
"""

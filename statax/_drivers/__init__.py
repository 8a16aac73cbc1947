"""The drivers: `pull`, `plant`, `grad_inters` and `stateful`. Each traces the function, hooks
the one evaluator (`_core.evaluator`), caches what it made, and names what comes out. They use
selections and the engine, never the other way round.
"""

"""The engine: `save_inter` and its rules, the one evaluator, the handler registry and its
flags, staging, named state and its threading, metas and errors.

It imports only the version shims (`statax._jax`): the drivers, selections, monitoring and the
handlers sit above it (`tests/test_layers.py` checks the direction).
"""

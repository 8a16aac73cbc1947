"""Version shims: what statax reads of JAX that is private or changes between releases.

Each name here hides one such thing (a param's name, a rule table's signature, where a
primitive lives), with the JAX versions it was written against, so that a new JAX release is
an afternoon's work. Nothing here is statax's own logic: that lives in modules named for what
they do (`_core.staging`, `_core.context`, `_core.batching`, ...), and `docs/maintaining.md`
lists every private name each of them reads (`tools/private_names.py`).

Tested against JAX 0.8.0 -- 0.12.0.1 (see `pyproject.toml` and `docs/maintaining.md`). A branch
on the version or on behaviour says, in a comment, which versions each side covers.
"""

"""Generation with libraries that pull in TensorFlow (KerasHub, through `tensorflow-text`) or
their own stack (gemma): an environment of their own, outside the README's test command. The
command is in `envs/generation/README.md`."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # (before Keras is imported)

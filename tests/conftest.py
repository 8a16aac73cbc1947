import os

# Several CPU devices for sharding and shard_map tests; must be set before JAX is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# Keras 3 runs on JAX here (the test extra installs Keras, not TensorFlow).
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402


@pytest.fixture
def allow_rank_promotion():
    """The model libraries (Keras's `Dense`, transformers) broadcast ranks implicitly, which the
    suite otherwise raises on."""
    with jax.numpy_rank_promotion("allow"):
        yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "exhaustive: the runs at size (random programs at size, the composition matrix with the "
        "fast paths off, each real model in its every variant): not in the README's test "
        "command, which deselects them (pyproject's addopts: -m 'not exhaustive'); run them "
        "with -m exhaustive, as CI does",
    )
    config.addinivalue_line(
        "markers",
        "fast_paths: checks how a fast path works inside (see statax/_core/fastpaths.py); skipped "
        "where they are off (STATAX_FAST_PATHS=0), where the plain paths give the same values "
        "and keys by other means",
    )


def pytest_collection_modifyitems(config, items):
    from statax._core import fastpaths as _fastpaths

    if _fastpaths.on:
        return
    skip = pytest.mark.skip(reason="a fast path's inner working; the fast paths are off")
    for item in items:
        if "fast_paths" in item.keywords:
            item.add_marker(skip)

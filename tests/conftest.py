import os

# Several CPU devices for sharding and shard_map tests; must be set before JAX is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

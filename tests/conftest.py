"""Strict, simulated-device settings for every test (as optax and equinox do)."""

import os

# Eight simulated CPU devices for multi-device tests; must precede the jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Helper modules are imported by tests, not collected: _mp_worker.py is a
# jax.distributed worker script that runs on import.
collect_ignore_glob = ["_*.py", "*/_*.py"]

"""Strict, simulated-device settings for every test (as optax and equinox do)."""

import os
import types

# Eight simulated CPU devices for multi-device tests; must precede the jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Helper modules are imported by tests, not collected: _mp_worker.py is a
# jax.distributed worker script that runs on import.
collect_ignore_glob = ["_*.py", "*/_*.py"]


@pytest.fixture
def fixed_id(monkeypatch):
  """Every save of the test gets one identity (a checkpoint's files name it)."""
  from jaxreshard._src.checkpoint import writer  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(
    writer, "uuid", types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex="0" * 32))
  )

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


# The threads of a save's commit (orbax's, named by the handler) end with the save. One
# a test leaves waits for a signal until orbax's coordination timeout, and stalls the
# next test that waits for such threads.
_SAVE_THREADS = ("jaxreshard_save", "jaxreshard_save_maker")
_SAVE_THREADS_GRACE_S = 10.0


@pytest.fixture(autouse=True)
def no_save_thread_left_running():
  """Each test ends with no commit thread of a save still running."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  yield
  deadline = time.monotonic() + _SAVE_THREADS_GRACE_S
  running = [t for t in threading.enumerate() if t.name in _SAVE_THREADS]
  for t in running:
    t.join(max(0.0, deadline - time.monotonic()))
  left = [t.name for t in running if t.is_alive()]
  assert not left, f"save threads still running {_SAVE_THREADS_GRACE_S:g} s after the test: {left}"

"""A pause of Python's cyclic garbage collector around allocation-heavy work."""

from __future__ import annotations

import contextlib
import gc

__all__ = ["no_gc"]


@contextlib.contextmanager
def no_gc():
  """Pauses Python's cyclic garbage collector inside the block.

  Planning allocates one small tuple per run and buffer and creates no
  reference cycles; with a large model's state alive, every collection the
  allocations trigger walks all of it, which cost more than the planning itself.
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()

"""A pause of Python's cyclic garbage collector around allocation-heavy work."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

__all__ = ["no_gc"]

# The collector's switch is one per process: pauses in several threads (or nested
# in one) share one pause, counted per thread, that ends with the last of them and
# then puts back what the first found.
_LOCK = threading.Lock()
_HELD: dict[int, int] = {}  # thread ident -> pauses it is inside
_WAS_ENABLED = False


@contextlib.contextmanager
def no_gc():
  """Pauses Python's cyclic garbage collector inside the block.

  Planning allocates one small tuple per run and buffer and creates no
  reference cycles; with a large model's state alive, every collection the
  allocations trigger walks all of it, which cost more than the planning itself.
  Blocks in several threads share one pause: the collector is enabled again
  (if it was when the first began) once the last has ended.
  """
  global _WAS_ENABLED
  me = threading.get_ident()
  before = None  # this thread's pauses before this one; counted once _HELD[me] exceeds it
  # An interrupt (Ctrl-C) lands where a builtin returns: after ``gc.disable``, after
  # the count, in the lock's exit, before the block. The ``finally`` covers the start
  # too, and the count comes before ``gc.disable``: what was not counted was not
  # paused, and what was is ended, so the collector is never left off. The
  # ``finally`` itself calls no builtin before its count is taken back.
  try:
    with _LOCK:
      before = _HELD.get(me, 0)
      first = not _HELD
      if first:
        _WAS_ENABLED = gc.isenabled()
      _HELD[me] = before + 1
      if first:
        gc.disable()
    yield
  finally:
    with _LOCK:
      if before is not None and me in _HELD and _HELD[me] > before:  # counted
        _HELD[me] -= 1
        if not _HELD[me]:
          del _HELD[me]
        if not _HELD and _WAS_ENABLED:
          gc.enable()


def _after_fork_in_child() -> None:
  """Only the forking thread lives on in a child: the pauses of the others never end."""
  global _LOCK
  _LOCK = threading.Lock()
  me = threading.get_ident()
  for ident in [t for t in _HELD if t != me]:
    del _HELD[ident]
  if not _HELD and _WAS_ENABLED:
    gc.enable()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_after_fork_in_child)

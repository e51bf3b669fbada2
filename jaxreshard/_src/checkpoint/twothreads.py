"""Reading a file's spans on two threads: the even ones on the caller's, the odd ones
on the read pool's, each span's read and checks run with the interpreter's lock
released (``runread``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from jaxreshard._src.core import workers as _workers

__all__ = ["in_two"]

_READ_POOL = "read"
_READ_POOL_PREFIX = f"jaxreshard-{_READ_POOL}"
# Held by the one read whose odd spans the read pool's thread is reading: a read
# that finds it taken reads its spans one after another on its own thread.
_HELPER = threading.Lock()


def in_two(one: Callable[[int], int], n: int) -> int:
  """``one(s)`` for every span ``s < n``: the even ones on this thread, the odd ones
  on the read pool's, at once; the sum of what they return.

  Each thread stops at its first failing span, and at any span past one that
  failed on the other. What is raised is an interrupt (``KeyboardInterrupt``)
  first, else the failure of the first span (in file order) that failed: the
  one a read span after span would have stopped at. The spans are read one
  after another, on this thread, where the pool's thread is taken by another
  read, where this is that thread, or where the pool is shut down (the
  interpreter is exiting).
  """
  failed: dict[int, BaseException] = {}
  lock = threading.Lock()
  stop = [n]  # no span past this one is read: it failed

  def half(parity: int) -> int:
    done = 0
    for s in range(parity, n, 2):
      if s > stop[0]:
        break
      try:
        done += one(s)
      except BaseException as e:  # raised below, in span order (interrupts first)
        with lock:
          failed[s] = e
          stop[0] = min(stop[0], s)
        break
    return done

  other = None
  if _HELPER.acquire(blocking=False):
    try:
      if not threading.current_thread().name.startswith(_READ_POOL_PREFIX):
        other = _workers.pool(_READ_POOL, 1).submit(half, 1)
    except RuntimeError:  # no new work after the pool's shutdown
      pass
    finally:
      if other is None:
        _HELPER.release()
  if other is None:
    return sum(one(s) for s in range(n))
  try:
    mine = half(0)
  finally:
    try:
      theirs = other.result()
    finally:
      _HELPER.release()
  if failed:
    interrupts = [e for e in failed.values() if not isinstance(e, Exception)]
    raise interrupts[0] if interrupts else failed[min(failed)]
  return mine + theirs

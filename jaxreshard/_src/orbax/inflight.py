"""Work a save started in orbax's threads, counted so that the save can end it.

Orbax runs parts of a save in threads of its own (the creation of its
temporary directory; the commit futures that write the archives) and gives up
on the save (an error elsewhere, its timeout) while they go on. A caller that
then removes the save's temporary directory, or saves the same path again,
would race with them. :class:`InFlight` counts such work while it runs:
``stop`` lets none start after it and waits for what is running, which looks
at ``stopped`` to end early. One save's work may be part of a larger whole
(a handler's saves): stopping the whole stops it too.

Orbax tells a commit future nothing when it gives up on it: its waiter stops
waiting (``result`` past its timeout raises ``TimeoutError``), or it cancels
the future. :class:`StoppingFuture` turns either into a ``stop`` of the
save's work, so that a save orbax gave up on writes no more once that waiter
is done waiting (an orbax checkpointer joins that waiter before its next save).
"""

from __future__ import annotations

import collections.abc
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Deferred", "InFlight", "StoppingFuture", "one_save"]

# How long a save that is over waits, at most, for the work it started.
WAIT_S = 60.0


class InFlight:
  """Pieces of one save's work running in orbax's threads, and whether the save is over.

  Args:
    whole: the work this is part of: a piece counts there too, and this is
      over once that is.
  """

  def __init__(self, whole: InFlight | None = None):
    self._cond = threading.Condition()
    self._running = 0
    self._stopped = False
    self._whole = whole

  @property
  def stopped(self) -> bool:
    """Whether the save (or the whole it is part of) is over."""
    return self._stopped or (self._whole is not None and self._whole.stopped)

  def start(self) -> bool:
    """Whether a piece may start (the save is not over); one that may is counted."""
    if self._whole is not None and not self._whole.start():
      return False
    with self._cond:
      if not self._stopped:
        self._running += 1
        return True
    if self._whole is not None:
      self._whole.done()
    return False

  def done(self) -> None:
    """A piece ``start`` counted has ended."""
    with self._cond:
      self._running -= 1
      self._cond.notify_all()
    if self._whole is not None:
      self._whole.done()

  def stop(self, timeout_s: float = WAIT_S) -> None:
    """The save is over: no piece starts, and those running are waited for.

    Examples:
      >>> work = InFlight()
      >>> work.start(), work.done(), work.stop(), work.start()
      (True, None, None, False)
      >>> whole = InFlight(); part = InFlight(whole)
      >>> part.start(), whole.stop(0), part.stopped, part.start()
      (True, None, True, False)
    """
    with self._cond:
      self._stopped = True
      self._cond.wait_for(lambda: self._running == 0, timeout=timeout_s)


class _Save(list):
  """The works of one orbax save, each handler's (a list that can be weakly referenced)."""


# Orbax's operation id -> the works of that save: the items of a Composite.
_SAVES: weakref.WeakValueDictionary[str, _Save] = weakref.WeakValueDictionary()
_SAVES_LOCK = threading.Lock()


def one_save(operation: str, work: InFlight) -> list[InFlight]:
  """The works of the orbax save ``operation`` (its operation id), ``work`` now among
  them; kept while a future holding them is."""
  with _SAVES_LOCK:
    save = _SAVES.get(operation)
    if save is None:
      save = _SAVES[operation] = _Save()
    save.append(work)
  return save


class StoppingFuture:
  """An orbax commit future whose save's works stop when its waiter gives up on it.

  ``result`` past its ``timeout`` (orbax's, for a save past its timeout) stops
  every work of ``save`` and waits for what of them runs before it raises the
  ``TimeoutError``; ``cancel`` stops them without waiting. Orbax waits for a
  save's futures one after another and asks none after one that timed out:
  the works of the items after it stop with it.
  """

  def __init__(self, future: Any, save: list[InFlight]):
    self._future = future
    self._save = save

  def result(self, timeout: float | None = None) -> Any:
    try:
      return self._future.result(timeout=timeout)
    except TimeoutError:
      for work in list(self._save):
        work.stop(0)
      for work in list(self._save):
        work.stop()
      raise

  def cancel(self) -> Any:
    for work in list(self._save):
      work.stop(0)
    return self._future.cancel()


class Deferred(collections.abc.Coroutine):
  """The coroutine ``make()`` returns, made when it is first run or awaited.

  Orbax never runs the coroutine of a commit future whose save was refused
  while orbax made its directory: one made ahead and never run is reported, when
  it is collected, as a coroutine never awaited.

  Examples:
    >>> import asyncio
    >>> async def work():
    ...   return 7
    >>> asyncio.run(Deferred(work)), Deferred(work).close()
    (7, None)
  """

  def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]]):
    self._make = make
    self._coro: Coroutine[Any, Any, Any] | None = None

  def _made(self) -> Coroutine[Any, Any, Any]:
    if self._coro is None:
      self._coro = self._make()
    return self._coro

  def send(self, value: Any) -> Any:
    return self._made().send(value)

  def throw(self, *args: Any) -> Any:
    return self._made().throw(*args)

  def close(self) -> None:
    if self._coro is not None:
      self._coro.close()

  def __await__(self):
    return self._made().__await__()

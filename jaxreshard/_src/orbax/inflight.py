"""Work a save started in orbax's threads, counted so that the save can end it.

Orbax runs parts of a save in threads of its own (the creation of its
temporary directory; the commit futures that write the archives) and gives up
on the save (an error elsewhere, its timeout) while they go on. A caller that
then removes the save's temporary directory, or saves the same path again,
would race with them. :class:`InFlight` counts such work while it runs:
``stop`` lets none start after it and waits for what is running, which looks
at ``stopped`` to end early.
"""

from __future__ import annotations

import threading

__all__ = ["InFlight"]

# How long a save that is over waits, at most, for the work it started.
WAIT_S = 60.0


class InFlight:
  """Pieces of one save's work running in orbax's threads, and whether the save is over."""

  def __init__(self):
    self._cond = threading.Condition()
    self._running = 0
    self.stopped = False

  def start(self) -> bool:
    """Whether a piece may start (the save is not over); one that may is counted."""
    with self._cond:
      if self.stopped:
        return False
      self._running += 1
      return True

  def done(self) -> None:
    """A piece ``start`` counted has ended."""
    with self._cond:
      self._running -= 1
      self._cond.notify_all()

  def stop(self, timeout_s: float = WAIT_S) -> None:
    """The save is over: no piece starts, and those running are waited for.

    Examples:
      >>> work = InFlight()
      >>> work.start(), work.done(), work.stop(), work.start()
      (True, None, None, False)
    """
    with self._cond:
      self.stopped = True
      self._cond.wait_for(lambda: self._running == 0, timeout=timeout_s)

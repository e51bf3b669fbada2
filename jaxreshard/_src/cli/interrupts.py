"""Interrupts of the command line: SIGTERM raised as Ctrl-C's KeyboardInterrupt is, and
an interrupt that lands once a command's output is in place told apart."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jaxreshard._src.checkpoint import archives as _archives
from jaxreshard._src.checkpoint import rename as _rename

__all__ = [
  "Committed",
  "Terminated",
  "finished",
  "on_sigterm_interrupt",
  "put_back",
  "started",
  "writing",
]


class Terminated(KeyboardInterrupt):
  """SIGTERM (what ``timeout``, batch schedulers and containers send), raised where
  Ctrl-C's KeyboardInterrupt would be, so that every path that cleans up after an
  interrupted save cleans up after it too."""


class Committed(KeyboardInterrupt):
  """An interrupt (or a SIGTERM) that landed once the command's output was in place."""

  def __init__(self, out: Any, terminated: bool):
    super().__init__(out)
    self.out, self.terminated = out, terminated


@contextlib.contextmanager
def writing(out: Any) -> Iterator[None]:
  """A command that writes the checkpoint ``out``, which did not exist when it began.

  A save renames its checkpoint into place once it is whole, then syncs it and
  its parent: an interrupt that lands after the rename (in those syncs, or while
  the command reports) leaves ``out`` complete. The syncs are run again here,
  and the interrupt is raised as :class:`Committed`, which says so.
  """
  final = _archives.path_arg(out)  # the path the save commits, spelt as it spells it
  there = os.path.lexists(final)  # then it is not this command's: a save refuses it
  if not there:
    _rename.forget(final)  # an earlier command's record: its directory is gone
  try:
    yield
  except KeyboardInterrupt as e:
    if isinstance(e, Committed) or there or not _rename.committed_here(final):
      raise  # not in place, or not this command's save's (another made it meanwhile)
    for path in (final, os.path.dirname(final)):
      try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
      except OSError:
        pass
    raise Committed(out, isinstance(e, Terminated)) from None


# Whether a command runs (``started``): before it, while the command line is parsed,
# there is nothing to clean up, and a SIGTERM ends the process as it says.
_RUNNING = threading.Event()


def started() -> None:
  """A command begins: from here a SIGTERM is raised as :class:`Terminated`."""
  _RUNNING.set()


def _raise_terminated(signum: int, frame: Any) -> None:
  del frame
  if _RUNNING.is_set():
    raise Terminated
  # Raised as an interrupt here, the command line's parser would exit 130, silently.
  print("jaxreshard: terminated", file=sys.stderr)
  raise SystemExit(128 + signum)


def on_sigterm_interrupt() -> Any:
  """Makes SIGTERM interrupt the command line as Ctrl-C does, where the command line
  runs in a process's main thread (called in another, it leaves SIGTERM alone).
  Returns the handler it replaced (None where it replaced none)."""
  if threading.current_thread() is threading.main_thread():
    return signal.signal(signal.SIGTERM, _raise_terminated)
  return None


def put_back(previous: Any) -> None:
  """Puts back the SIGTERM handler :func:`on_sigterm_interrupt` replaced, and the
  SIGINT one :func:`finished` did (a program that ran the command line in its own
  process keeps its own handling)."""
  _RUNNING.clear()
  if previous is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, previous)
    while _SIGINT_BEFORE:
      signal.signal(signal.SIGINT, _SIGINT_BEFORE.pop())


# The SIGINT handler ``finished`` replaced, for ``put_back``.
_SIGINT_BEFORE: list[Any] = []


def finished() -> None:
  """The command's outcome is decided and reported: a SIGTERM or a Ctrl-C from here
  on, while the process exits (its threads joined, jax shut down, the interpreter
  finalized, which puts back the default handlers that kill with 143 and 130, or a
  KeyboardInterrupt traceback from the threads' shutdown), is ignored, so that the
  exit code is the command's own and never says that work which completed was cut
  short. Only where :func:`on_sigterm_interrupt` installed its handler."""
  if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGTERM) is _raise_terminated
  ):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _SIGINT_BEFORE.append(signal.signal(signal.SIGINT, signal.SIG_IGN))

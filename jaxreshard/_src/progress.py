"""Progress of long calls: the ``Progress`` a callback receives, and the library's logger.

Saves, loads and restores report after each archive (or target rank) they
finish: to the ``progress`` callback when the caller gives one, and to
``logging.getLogger("jaxreshard")``, at DEBUG per archive or rank and at INFO
once per finished call. The library adds no handler and sets no level, so with
logging's defaults (the root logger at WARNING) nothing is printed; an
application turns the messages on with
``logging.getLogger("jaxreshard").setLevel(logging.INFO)`` (importing orbax
already gives the root logger a handler, so a later ``logging.basicConfig`` does
nothing).

The bars of the command line are drawn from the plans in ``_read_plan``; this
module is for library callers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from jaxreshard._src.errors import ReshardError

__all__ = ["Progress", "ProgressCallback", "Reporter", "logger"]

logger = logging.getLogger("jaxreshard")


@dataclasses.dataclass(frozen=True)
class Progress:
  """How far a long call is, reported after each archive or target rank it finishes.

  Bytes count optimizer-state data only, never metadata or checksums:

  * ``save_records``, ``save_sharded`` and ``load_records``: the archives'
    history buffers as stored (each rank's flat shards, their zero padding
    included). ``save_sharded`` counts the archives this process writes.
  * ``restore``, ``restore_ranks`` and ``restore_sharded``: the history bytes
    copied into the target from the source archives, each source element
    once, padding never (the reads themselves are whole checksummed chunks).
    ``restore_sharded`` counts the ranks or pieces this process builds.

  Attributes:
    what: the call reporting (``"save_records"``, ``"load_records"``,
      ``"restore"``, ``"restore_ranks"``, ``"save_sharded"`` or
      ``"restore_sharded"``).
    done: archives (saves, loads, ``restore_sharded`` with a ``target``) or
      target ranks (restores) finished so far, this one included.
    total: how many the call finishes in all; None when it cannot be known in
      advance (``save_records`` given an iterator).
    done_bytes: bytes written or read so far; never decreases.
    total_bytes: the bytes of the whole call (``done_bytes`` of its last
      report); None when ``total`` is None.
    archive: the archive just written or read, or None.
    rank: the target rank just built, or None.
  """

  what: str
  done: int
  total: int | None
  done_bytes: int
  total_bytes: int | None
  archive: int | None = None
  rank: int | None = None

  @property
  def fraction(self) -> float | None:
    """``done_bytes / total_bytes`` (1.0 for a call of no bytes), or None when unknown."""
    if self.total_bytes is None:
      return None
    return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


ProgressCallback = Callable[[Progress], None]


def check_callback(progress: ProgressCallback | None) -> None:
  """Refuses a ``progress`` argument that cannot be called, before any work."""
  if progress is not None and not callable(progress):
    raise ReshardError(
      f"progress must be a callable taking a jaxreshard.Progress, or None;"
      f" got {type(progress).__name__}"
    )


class Reporter:
  """Counts one call's archives or ranks and bytes; tells the callback and the logger."""

  def __init__(
    self,
    what: str,
    progress: ProgressCallback | None,
    *,
    where: object,
    total: int | None,
    total_bytes: int | None,
    unit: str = "archive",
  ):
    check_callback(progress)
    self.what = what
    self.progress = progress
    self.where = os.fspath(where) if isinstance(where, os.PathLike) else where
    self.total = total
    self.total_bytes = total_bytes if total is not None else None
    self.unit = unit
    self.done = 0
    self.done_bytes = 0
    self._t0 = time.perf_counter()

  def step(self, nbytes: int, *, archive: int | None = None, rank: int | None = None) -> None:
    """One archive or rank finished, of ``nbytes`` bytes."""
    self.done += 1
    self.done_bytes += int(nbytes)
    if logger.isEnabledFor(logging.DEBUG):
      of = "" if self.total is None else f" of {self.total}"
      logger.debug(
        "%s %s: %s %s done (%d%s), %d bytes, %d bytes so far",
        self.what,
        self.where,
        self.unit,
        archive if rank is None else rank,
        self.done,
        of,
        int(nbytes),
        self.done_bytes,
      )
    if self.progress is not None:
      self.progress(
        Progress(self.what, self.done, self.total, self.done_bytes, self.total_bytes, archive, rank)
      )

  def finish(self) -> None:
    """The call succeeded: one INFO line."""
    logger.info(
      "%s %s: %d %s%s, %d bytes, in %.3f s",
      self.what,
      self.where,
      self.done,
      self.unit,
      "" if self.done == 1 else "s",
      self.done_bytes,
      time.perf_counter() - self._t0,
    )

"""What each target rank reads, in bytes, from a checkpoint's index alone.

``reshard --dry-run`` prints these plans and ``reshard`` sizes its progress bar
with them. They come from the same validation and copy plan as the restore
itself (``_pipeline``, ``_copyplan``; for a regular checkpoint the same arrays
of ``regular``), computed from the index: no archive is read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint.reader import Checkpoint
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import reshard as _reshard

__all__ = ["Read", "ReadPlan", "read_plan", "total_bytes"]


@dataclasses.dataclass(frozen=True)
class Read:
  """One contiguous read: global flat elements ``[lo, hi)`` of ``param``'s buffers.

  ``source_offset`` is where they start inside the source rank's ``(slots,)`` buffers.
  """

  archive: int
  source_rank: int
  param: str
  lo: int
  hi: int
  source_offset: int
  bytes: int


class ReadPlan:
  """Everything one target rank reads and holds.

  The reads are kept as columns (one row per read, sorted by param then by
  ``lo``); ``reads`` makes them ``Read``s when asked.
  """

  def __init__(
    self,
    rank: int,
    world_size: int,
    columns: dict[str, np.ndarray],
    pids: Sequence[str],
    target_bytes: int,
  ):
    self.rank, self.world_size, self.target_bytes = rank, world_size, target_bytes
    self.columns = columns  # archive, source_rank, row, lo, hi, source_offset, bytes
    self._pids = pids  # the param of each row

  @functools.cached_property
  def reads(self) -> tuple[Read, ...]:
    c, pids = self.columns, self._pids
    return tuple(
      Read(a, k, pids[g], lo, hi, off, n)
      for a, k, g, lo, hi, off, n in zip(
        *(c[f].tolist() for f in ("archive", "source_rank", "row", "lo", "hi", "offset", "bytes"))
      )
    )

  @property
  def bytes_read(self) -> int:
    return int(self.columns["bytes"].sum())

  @functools.cached_property
  def per_archive(self) -> dict[int, int]:
    a, n = self.columns["archive"], self.columns["bytes"]
    archives, at = np.unique(a, return_inverse=True)
    return dict(zip(archives.tolist(), np.bincount(at, n, len(archives)).astype(np.int64).tolist()))

  @property
  def peak_bytes(self) -> int:
    """Estimate: the target's buffers plus the restore's bounded read buffer."""
    from jaxreshard._src.checkpoint.reader import STAGING_BYTES  # pylint: disable=g-import-not-at-top

    return self.target_bytes + min(STAGING_BYTES, self.bytes_read)


def read_plan(ckpt: Checkpoint, *, world_size: int, rank: int) -> ReadPlan:
  """The reads of target ``rank`` of ``world_size``, from the index only.

  Raises:
    PlacementError: archives that do not form complete groups, or an invalid
      target (the same refusals as ``jaxreshard.restore``).
  """
  with _pipeline.no_gc():
    reg = _regular.regular(ckpt)
    if reg is not None:
      return _regular_plan(reg, *_regular.check_target(world_size, rank))
    return _target_plan(ckpt, world_size, rank)


def _reads(rank, world, start, stop, src_slots, itemsize, archives, pids, target_bytes):
  """The plan of the target rows' ``[start, stop)`` from flat sources of ``src_slots``;
  ``archives(row, source_rank)`` names the archive of each read."""
  gi, k, src_local, _, length = _copyplan.cut_runs(
    start, np.maximum(stop - start, 0), np.maximum(src_slots, 1)
  )
  keep = itemsize[gi] > 0
  gi, k, src_local, length = gi[keep], k[keep], src_local[keep], length[keep]
  lo = k * src_slots[gi] + src_local
  columns = {
    "archive": archives(gi, k),
    "source_rank": k,
    "row": gi,
    "lo": lo,
    "hi": lo + length,
    "offset": src_local,
    "bytes": length * itemsize[gi],
  }
  return ReadPlan(rank, world, columns, pids, target_bytes)


def _regular_plan(reg: _regular.Regular, rank: int, world: int) -> ReadPlan:
  slots, start, stop = _regular.target_geometry(reg.count, rank, world)

  def archives(row: np.ndarray, k: np.ndarray) -> np.ndarray:
    group = reg.group[row]
    out = np.empty(len(row), np.int64)
    for g in _copyplan.unique_ints(group).tolist():
      sel = group == g
      out[sel] = reg.by_rank_array[g][k[sel]]
    return out

  target_bytes = int((slots * reg.itemsize).sum())
  return _reads(
    rank, world, start, stop, reg.src_slots, reg.itemsize, archives, reg.pids, target_bytes
  )


def _target_plan(ckpt: Checkpoint, world_size: int, rank: int) -> ReadPlan:
  migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=world_size, rank=rank)
  groups = _pipeline.validate(ckpt, migrations)
  layout = _copyplan.target_layout(groups)
  itemsize = np.asarray(
    [sum(d.itemsize for _, d in _copyplan.history_buffers(f)) for f in groups.facts], np.int64
  )
  return _reads(
    rank,
    world_size,
    groups.start,
    groups.stop,
    groups.src_slots,
    itemsize,
    groups.archives,
    groups.params,
    layout.nbytes,
  )


def total_bytes(ckpt: Checkpoint) -> int:
  """The history bytes every target rank together reads: each element once, padding never."""
  total = 0
  for pid, shape, sources in ckpt.complete_groups():
    itemsize = sum(h.dtype.itemsize for h in ckpt.history(sources[0], pid) if hasattr(h, "dtype"))
    total += math.prod(shape) * itemsize
  return total

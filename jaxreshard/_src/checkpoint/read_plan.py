"""What each target rank reads, in bytes, from a checkpoint's index alone.

``reshard --dry-run`` prints these plans and ``reshard`` sizes its progress bar
with them. They come from the same validation and copy plan as the restore
itself (``_pipeline``, ``_copyplan``), computed from the index: no archive is
read.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

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


@dataclasses.dataclass(frozen=True)
class ReadPlan:
  """Everything one target rank reads and holds."""

  rank: int
  world_size: int
  reads: tuple[Read, ...]
  target_bytes: int  # the target record's buffers, padding included

  @property
  def bytes_read(self) -> int:
    return sum(r.bytes for r in self.reads)

  @property
  def per_archive(self) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in self.reads:
      out[r.archive] = out.get(r.archive, 0) + r.bytes
    return dict(sorted(out.items()))

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
    return _target_plan(ckpt, world_size, rank)


def _target_plan(ckpt: Checkpoint, world_size: int, rank: int) -> ReadPlan:
  migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=world_size, rank=rank)
  groups = _pipeline.validate(ckpt, migrations)
  layout = _copyplan.target_layout(groups)
  gi, k, src_local, _, length = _copyplan.overlaps(groups)
  itemsize = np.asarray(
    [sum(d.itemsize for _, d in _copyplan.history_buffers(f)) for f in groups.facts], np.int64
  )
  keep = itemsize[gi] > 0
  gi, k, src_local, length = gi[keep], k[keep], src_local[keep], length[keep]
  archive = groups.archives(gi, k)
  lo = k * groups.src_slots[gi] + src_local
  pids = groups.params
  reads = [
    Read(a, r, pids[g], start, start + n, local, nbytes)
    for a, r, g, start, local, n, nbytes in zip(
      archive.tolist(),
      k.tolist(),
      gi.tolist(),
      lo.tolist(),
      src_local.tolist(),
      length.tolist(),
      (length * itemsize[gi]).tolist(),
    )
  ]
  reads.sort(key=lambda x: (x.param, x.lo))
  return ReadPlan(rank, world_size, tuple(reads), layout.nbytes)


def total_bytes(ckpt: Checkpoint) -> int:
  """The history bytes every target rank together reads: each element once, padding never."""
  total = 0
  for pid, shape, sources in ckpt.complete_groups():
    itemsize = sum(h.dtype.itemsize for h in ckpt.history(sources[0], pid) if hasattr(h, "dtype"))
    total += math.prod(shape) * itemsize
  return total

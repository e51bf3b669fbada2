"""What each target rank reads, in bytes, from metadata alone; the progress bar.

``reshard --dry-run`` prints these plans and ``reshard`` sizes its progress bar
with them, so both need only the archives' placements and the dtypes of each
parameter's history buffers, never the arrays themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxreshard import _structure
from jaxreshard._errors import PlacementError
from jaxreshard._geometry import FlatShard
from jaxreshard._placement import ParamPlacement
from jaxreshard._reshard import plan

__all__ = ["ArchiveLayout", "Read", "TargetPlan", "layout_of", "progress_bar", "target_plan"]


@dataclasses.dataclass(frozen=True)
class ArchiveLayout:
  """The metadata of one archive: its placements and buffer dtypes.

  Attributes:
    placements: as in ``ShardRecord.placements``.
    buffers: param id -> dtype of each of its history buffers, in order.
  """

  placements: tuple[ParamPlacement, ...]
  buffers: Mapping[str, tuple[np.dtype, ...]]

  def placement(self, param: str):
    return next((p for p in self.placements if p.param == param), None)


def layout_of(record: Any) -> ArchiveLayout:
  """The layout of a ``ShardRecord`` (roles say which leaves are buffers)."""
  buffers: dict[str, list[np.dtype]] = {}
  leaves = jax.tree.leaves(record.state)
  try:
    roles = _structure.roles_of(record)
  except _structure.AnatomyError as e:
    raise PlacementError(f"an archive without roles: {e}") from None
  for leaf, role in zip(leaves, roles):
    if role is not None:
      # ``.dtype`` first: a buffer still on disk has one but no data.
      buffers.setdefault(role, []).append(np.dtype(getattr(leaf, "dtype", None)
                                                   or np.asarray(leaf).dtype))
  return ArchiveLayout(tuple(record.placements), {k: tuple(v) for k, v in buffers.items()})


@dataclasses.dataclass(frozen=True)
class Read:
  """One contiguous read: elements ``[lo, hi)`` of ``param``'s flat buffers.

  ``lo``/``hi`` are global flat indices; ``local`` is where they start inside
  the source archive's slot buffer.
  """

  archive: int
  source_rank: int
  param: str
  lo: int
  hi: int
  local: int
  bytes: int


@dataclasses.dataclass(frozen=True)
class TargetPlan:
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
    """Estimate: the target's buffers plus the largest read from one archive."""
    return self.target_bytes + max(self.per_archive.values(), default=0)


def target_plan(layouts: Sequence[ArchiveLayout], world_size: int, rank: int) -> TargetPlan:
  """The reads of target ``rank`` of ``world_size``, from metadata only.

  Raises:
    PlacementError: archives that do not form complete groups, or an invalid
      target (the same checks as ``jaxreshard.plan``).
  """
  reads, target_bytes = [], 0
  for m in plan(layouts, world_size=world_size, rank=rank):
    t = FlatShard(m.shape, m.rank, m.world_size)
    first = layouts[m.sources[0]]
    itemsize = sum(d.itemsize for d in first.buffers.get(m.param, ()))
    target_bytes += t.slots * itemsize
    for a in m.sources:
      p = layouts[a].placement(m.param)
      s = FlatShard(p.shape, p.rank, p.world_size)
      lo, hi = max(t.start, s.start), min(t.stop, s.stop)
      if lo < hi and itemsize:
        reads.append(Read(a, p.rank, m.param, lo, hi, lo - s.rank * s.slots, (hi - lo) * itemsize))
  reads.sort(key=lambda r: (r.param, r.lo))
  return TargetPlan(rank, world_size, tuple(reads), target_bytes)


def progress_bar(console: Any) -> Any:
  """A rich progress bar counting bytes, with speed and ETA, on terminals only."""
  from rich import progress  # only the CLI draws bars

  return progress.Progress(
      progress.TextColumn("[bold]{task.description}"),
      progress.BarColumn(),
      progress.DownloadColumn(),
      progress.TransferSpeedColumn(),
      progress.TimeRemainingColumn(),
      console=console,
      # Pipes and logs get the one summary line, not a frozen bar.
      disable=not console.is_terminal,
  )

"""The copy plan of a target rank: its packed buffers and the runs that fill them.

A target rank holds one flat buffer per dtype. Its history buffers lie in that
buffer back to back in *packing order*: parameters sorted by id, then each
parameter's history buffers in the order of the optimizer subtrees that hold
them. The same order packs an archive's buffers on disk, so a target rank
built here is saved without a copy.

A *run* copies ``length`` contiguous elements from a source buffer to the
target buffer. For a parameter of ``count`` elements split over ``W`` source
ranks (``ss = ceil(count / W)`` slots each), target rank ``r`` of ``M`` owns
global elements ``[r * ts, min((r + 1) * ts, count))``; it overlaps source ranks
``start // ss`` to ``(stop - 1) // ss`` and nothing else. The geometry of every
parameter is computed at once with numpy, so planning costs time in proportion
to the parameters and the overlapping source ranks, never to ``W``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core import structure as _structure

__all__ = ["BufferSlot", "Runs", "TargetLayout", "cut_runs", "plan_runs", "target_layout"]


@dataclasses.dataclass(frozen=True)
class BufferSlot:
  """One history buffer inside a packed buffer: ``[offset, offset + size)``."""

  group: int  # index into the groups the layout was made from
  subtree: int  # which optimizer subtree holds it
  offset: int
  size: int


@dataclasses.dataclass(frozen=True)
class TargetLayout:
  """The packed buffers of one target rank: per dtype, its history buffers and total size."""

  slots: dict[np.dtype, tuple[BufferSlot, ...]]
  sizes: dict[np.dtype, int]

  @property
  def nbytes(self) -> int:
    return sum(n * d.itemsize for d, n in self.sizes.items())


def history_buffers(group: Any) -> list[tuple[int, np.dtype]]:
  """``(mirror, dtype)`` of each history buffer a validated group has, in mirror order."""
  return _present(group.history, group.buffer_dtypes)


def _present(history: Sequence[Any], dtypes: Sequence[np.dtype]) -> list[tuple[int, np.dtype]]:
  return [(m, d) for m, (present, d) in enumerate(zip(history, dtypes)) if present is True]


def target_layout(groups: Sequence[Any], *, logical: bool = False) -> TargetLayout:
  """Packs the history buffers of ``groups`` (sorted by param id) per dtype.

  Each buffer has the target's ``slots`` elements, or the parameter's
  ``count`` when ``logical`` (a whole, unsharded parameter). Every target rank
  of one plan has the same layout, so it is made once per distinct value of
  what it is made of (sizes, histories, dtypes) and shared; it is never mutated.
  """
  return _packed(
    tuple(
      (g.target.count if logical else g.target.slots, tuple(g.history), tuple(g.buffer_dtypes))
      for g in groups
    )
  )


@functools.lru_cache(maxsize=16)
def _packed(buffers: tuple[tuple[int, tuple, tuple], ...]) -> TargetLayout:
  slots: dict[np.dtype, list[BufferSlot]] = {}
  sizes: dict[np.dtype, int] = {}
  for gi, (size, history, dtypes) in enumerate(buffers):
    for m, dtype in _present(history, dtypes):
      offset = sizes.get(dtype, 0)
      slots.setdefault(dtype, []).append(BufferSlot(gi, m, offset, size))
      sizes[dtype] = offset + size
  return TargetLayout({d: tuple(s) for d, s in slots.items()}, sizes)


@dataclasses.dataclass(frozen=True)
class Runs:
  """Run tables of one target buffer (one dtype): parallel int64 arrays.

  Attributes:
    source: index into the plan's source list.
    src: first element read in that source.
    dst: first element written in the target buffer.
    length: elements copied (always > 0).
  """

  source: np.ndarray
  src: np.ndarray
  dst: np.ndarray
  length: np.ndarray

  def __len__(self) -> int:
    return len(self.length)

  @property
  def elements(self) -> int:
    return int(self.length.sum())


def overlaps(groups: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Every (group, source rank) pair whose owned elements overlap the target's.

  Returns parallel arrays: group index, source rank, first element in the
  source rank's buffer, first element in the target's, length.
  """
  n = len(groups)
  t_start = np.fromiter((g.target.start for g in groups), np.int64, n)
  t_stop = np.fromiter((g.target.stop for g in groups), np.int64, n)
  ss = np.fromiter((max(g.source.slots, 1) for g in groups), np.int64, n)
  gi, k, offset, skip, length = cut_runs(t_start, np.maximum(t_stop - t_start, 0), ss)
  return gi, k, offset, skip, length


def cut_runs(
  start: np.ndarray, length: np.ndarray, block: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Runs ``[start, start + length)`` cut at every multiple of ``block`` (slot boundaries).

  A run that crosses block boundaries becomes one piece per block it touches,
  in order; a run of length 0 becomes none.

  Args:
    start: int64 first element of each run.
    length: int64 elements of each run (>= 0).
    block: the block size (> 0), one for all runs or one per run.

  Returns:
    Parallel int64 arrays, one entry per piece: the run it comes from, its
    block, its first element inside that block, its first element inside the
    run, its length.
  """
  start = np.asarray(start, np.int64).reshape(-1)
  length = np.asarray(length, np.int64).reshape(-1)
  block = np.broadcast_to(np.asarray(block, np.int64), start.shape)
  nonempty = length > 0
  first = np.where(nonempty, start // block, 0)
  last = np.where(nonempty, (start + length - 1) // block, -1)
  pieces = last - first + 1
  run = np.repeat(np.arange(start.size, dtype=np.int64), pieces)
  k = first[run] + (np.arange(run.size, dtype=np.int64) - (np.cumsum(pieces) - pieces)[run])
  b = block[run]
  lo = np.maximum(start[run], k * b)
  hi = np.minimum(start[run] + length[run], (k + 1) * b)
  return run, k, lo - k * b, lo - start[run], hi - lo


def plan_runs(
  groups: Sequence[Any], layout: TargetLayout, locate: Callable[[int, Any, int], tuple[Any, int]]
) -> tuple[dict[np.dtype, Runs], list[Any]]:
  """The runs that fill ``layout``'s buffers from the groups' sources.

  Args:
    groups: validated groups, in the order ``layout`` was made from.
    layout: the target's packed buffers.
    locate: ``(archive, group, mirror) -> (source key, base offset)``:
      where that archive keeps that history buffer. Equal keys are one source.

  Returns:
    Per dtype the run tables, and the list of source keys they index.
  """
  gi, k, src_local, dst_local, length = overlaps(groups)
  keys: dict[Any, int] = {}
  sources: list[Any] = []
  out: dict[np.dtype, Runs] = {}
  for dtype, slots in layout.slots.items():
    by_group: dict[int, list[BufferSlot]] = {}
    for s in slots:
      by_group.setdefault(s.group, []).append(s)
    # One run per (overlap, buffer of that parameter in this dtype).
    sel = np.flatnonzero(np.isin(gi, np.fromiter(by_group, np.int64, len(by_group))))
    src_ids, src_pos, dst_pos, lens = [], [], [], []
    for g, rank, a, b, n in zip(
      gi[sel].tolist(),
      k[sel].tolist(),
      src_local[sel].tolist(),
      dst_local[sel].tolist(),
      length[sel].tolist(),
    ):
      group = groups[g]
      archive = group.by_rank[rank]
      for s in by_group[g]:
        key, base = locate(archive, group, s.subtree)
        sid = keys.get(key)
        if sid is None:
          sid = keys[key] = len(sources)
          sources.append(key)
        src_ids.append(sid)
        src_pos.append(base + a)
        dst_pos.append(s.offset + b)
        lens.append(n)
    out[dtype] = Runs(
      np.asarray(src_ids, np.int64),
      np.asarray(src_pos, np.int64),
      np.asarray(dst_pos, np.int64),
      np.asarray(lens, np.int64),
    )
  return out, sources


def packing_order(histories: dict[str, Sequence[Any]]) -> list[tuple[str, int, Any]]:
  """``(param, mirror, buffer)`` of every history buffer, in packing order.

  ``histories`` maps a param id to its per-mirror entries (a buffer,
  ``MASKED`` or None), as ``StateParts.history`` gives them.
  """
  out = []
  for pid in sorted(histories):
    for m, h in enumerate(histories[pid]):
      if h is not None and h is not _structure.MASKED:
        out.append((pid, m, h))
  return out

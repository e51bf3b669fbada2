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

__all__ = [
  "Blocks",
  "BufferSlot",
  "Runs",
  "TargetLayout",
  "cut_runs",
  "locate_each",
  "packed_layout",
  "padding_ranks",
  "padding_spans",
  "plan_blocks",
  "plan_runs",
  "unique_ints",
  "target_layout",
]


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
  # Per dtype the slots as columns: (group, subtree, offset, size) int64 arrays.
  columns: dict[np.dtype, tuple[np.ndarray, ...]] = dataclasses.field(
    default_factory=dict, compare=False
  )

  @property
  def nbytes(self) -> int:
    return sum(n * d.itemsize for d, n in self.sizes.items())


_COLUMNS = ("group", "subtree", "offset", "size")


def history_buffers(group: Any) -> list[tuple[int, np.dtype]]:
  """``(mirror, dtype)`` of each history buffer a validated group has, in mirror order."""
  return _present(group.history, group.buffer_dtypes)


def _present(history: Sequence[Any], dtypes: Sequence[np.dtype]) -> list[tuple[int, np.dtype]]:
  return [(m, d) for m, (present, d) in enumerate(zip(history, dtypes)) if present is True]


def target_layout(groups: Any, *, logical: bool = False) -> TargetLayout:
  """Packs the history buffers of ``groups`` (a ``Groups`` table, sorted by param id) per dtype.

  Each buffer has the target's ``slots`` elements, or the parameter's
  ``count`` when ``logical`` (a whole, unsharded parameter). Every target rank
  of one plan has the same layout, so it is made once per distinct value of
  what it is made of (sizes, histories, dtypes) and shared; it is never mutated.
  """
  sizes = groups.count if logical else groups.slots
  return packed_layout(sizes, groups.facts)


def packed_layout(sizes: np.ndarray, facts: Sequence[Any]) -> TargetLayout:
  """The packed buffers of params with these facts (sorted by param id) and ``sizes``
  (elements of each history buffer, one int64 per param)."""
  sizes = np.ascontiguousarray(sizes, np.int64)
  return _packed(sizes.tobytes(), tuple((f.history, f.buffer_dtypes) for f in facts))


@functools.lru_cache(maxsize=16)
def _packed(sizes: bytes, buffers: tuple[tuple[tuple, tuple], ...]) -> TargetLayout:
  slots: dict[np.dtype, list[BufferSlot]] = {}
  totals: dict[np.dtype, int] = {}
  for gi, (size, (history, dtypes)) in enumerate(
    zip(np.frombuffer(sizes, np.int64).tolist(), buffers)
  ):
    for m, dtype in _present(history, dtypes):
      offset = totals.get(dtype, 0)
      slots.setdefault(dtype, []).append(BufferSlot(gi, m, offset, size))
      totals[dtype] = offset + size
  frozen = {d: tuple(s) for d, s in slots.items()}
  columns = {
    d: tuple(np.fromiter((getattr(x, f) for x in s), np.int64, len(s)) for f in _COLUMNS)
    for d, s in frozen.items()
  }
  return TargetLayout(frozen, totals, columns)


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


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Every history buffer of one dtype, copied for a range of target ranks at once.

  Sources and targets are 2-D: one row per source rank (each row the rank's
  buffers of the dtype back to back, the same layout in every row) and one
  row per target rank. A parameter's rows concatenated are its flat buffer
  (padded), so one buffer of every target rank is a reshape of the other
  side's block of rows, whatever the two world sizes: the copy costs time per
  buffer and per byte, never per (rank, buffer) pair. Parallel int64 arrays,
  one entry per history buffer in the target's packing order.

  Attributes:
    src: its first element in a source row.
    src_slots: its elements per source row (the source world's slots).
    dst: its first element in a target row.
    dst_slots: its elements per target row.
    count: its parameter's element count (what is copied; the rest is padding).
  """

  src: np.ndarray
  src_slots: np.ndarray
  dst: np.ndarray
  dst_slots: np.ndarray
  count: np.ndarray

  def __len__(self) -> int:
    return len(self.src)


def plan_blocks(
  groups: Any,
  layout: TargetLayout,
  dtype: np.dtype,
  order: Sequence[tuple[str, int]],
  offsets: Sequence[int],
) -> Blocks | None:
  """The blocks of ``layout``'s ``dtype`` buffer from source rows laid out as ``order``
  (``(param, mirror)`` of each buffer of a row) at ``offsets``; None when a
  buffer the target needs is not in the rows."""
  group, subtree, dst, dst_slots = layout.columns[dtype]
  index = {key: offsets[i] for i, key in enumerate(order)}
  params = groups.params
  try:
    src = np.fromiter(
      (index[(params[g], m)] for g, m in zip(group.tolist(), subtree.tolist())),
      np.int64,
      len(group),
    )
  except KeyError:
    return None
  return Blocks(src, groups.src_slots[group], dst, dst_slots, groups.count[group])


def overlaps(groups: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Every (group, source rank) pair whose owned elements overlap the target's.

  Returns parallel arrays: group index, source rank, first element in the
  source rank's buffer, first element in the target's, length.
  """
  return cut_runs(
    groups.start, np.maximum(groups.stop - groups.start, 0), np.maximum(groups.src_slots, 1)
  )


def padding_ranks(
  count: np.ndarray,
  src_slots: np.ndarray,
  src_world: np.ndarray,
  first: np.ndarray,
  stop: np.ndarray,
  slots: np.ndarray,
  world: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
  """The all-padding source ranks that target ranks ``[first[i], stop[i])`` check, per row.

  A source rank is all padding when its slots start at or past ``count``. One
  whose slots start inside the target world's padded buffer (``world * slots``
  elements) is checked by every target rank whose slots meet its own. One whose
  slots start past it (a source world padded further than the target's) is
  checked by target rank ``k * world // src_world``: spread over the target
  ranks, where a rule by position would give them all to the last one, which
  would then open archives in proportion to the difference of the two worlds.
  Together the target ranks of a world check each such rank at least once.

  Returns:
    ``(row, source rank)`` int64 arrays, in order of row, then rank.
  """
  ss = np.maximum(src_slots, 1)
  end = world * slots  # the target world's padded buffer
  past = -(-end // ss)  # the first source rank whose slots start past it
  allpad = -(-count // ss)  # the first all-padding source rank
  # Ranks whose slots meet the target ranks' own slots.
  a_first = np.maximum(allpad, first * slots // ss)
  a_stop = np.minimum(np.minimum(src_world, past), -(-(stop * slots) // ss))
  # Ranks past the target's buffer that fall to these target ranks.
  b_first = np.maximum(np.maximum(allpad, past), -(-(first * src_world) // world))
  b_stop = np.minimum(src_world, -(-(stop * src_world) // world))
  ranges = []
  for lo, hi in ((a_first, a_stop), (b_first, b_stop)):
    rows = np.flatnonzero((src_slots > 0) & (first < stop) & (lo < hi))
    n = hi[rows] - lo[rows]
    row = np.repeat(rows, n)
    ranges.append(
      (row, lo[row] + (np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)))
    )
  row = np.concatenate([ranges[0][0], ranges[1][0]])
  k = np.concatenate([ranges[0][1], ranges[1][1]])
  order = np.lexsort((k, row))
  return row[order], k[order]


def padding_spans(
  groups: Any, lo: np.ndarray, hi: np.ndarray, first: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The source padding that target ranks ``[first[i], stop[i])`` read, per row ``i``,
  whose elements ``[lo[i], hi[i])`` they hold.

  A source rank's slots past what its flat shard owns are padding. The target
  reads the padding of the source rank holding the param's last element when
  it copies from that rank, and the whole of every all-padding source rank that
  falls to it (:func:`padding_ranks`): together the target ranks of a world read
  every padding slot, as a read from disk does. In the format of
  :func:`overlaps` (row, source rank, first padding element in that rank's
  buffer, 0, length), in order of row, then rank.
  """
  count, ss = groups.count, groups.src_slots
  slots = np.maximum(ss, 1)
  last = np.maximum(count - 1, 0) // slots
  # The last owner's own padding, read when the target copies from it.
  part = np.flatnonzero((ss > 0) & (count % slots > 0) & (hi > lo) & (hi > last * ss))
  row, k = padding_ranks(count, ss, groups.src_world, first, stop, groups.slots, groups.world)
  start = count[part] - last[part] * ss[part]
  row = np.concatenate([part, row])
  k = np.concatenate([last[part], k])
  start = np.concatenate([start, np.zeros(len(row) - len(part), np.int64)])
  length = ss[row] - start
  order = np.lexsort((k, row))
  row, k, start, length = row[order], k[order], start[order], length[order]
  return row, k, start, np.zeros(len(row), np.int64), length


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
  groups: Any, layout: TargetLayout, locate_runs: Callable, pairs: tuple | None = None
) -> tuple[dict[np.dtype, Runs], list[Any]]:
  """The runs that fill ``layout``'s buffers from the groups' sources.

  Every (overlap, history buffer of that parameter in the dtype) pair is one
  run; the pairs are made with numpy over the whole table. ``pairs``: other
  (row, source rank) pieces than the overlaps, in their format (``padding_spans``).

  Args:
    groups: a validated ``Groups`` table, in the order ``layout`` was made from.
    layout: the target's packed buffers.
    locate_runs: ``(archive, group, subtree, dtype) -> (source, base, keys)``
      over int64 arrays of runs: where each archive keeps each history
      buffer, as an index into ``keys`` (distinct keys; a source holds buffers
      of one dtype, so no key is given for two dtypes) and the buffer's first
      element there.

  Returns:
    Per dtype the run tables, and the list of source keys they index.
  """
  gi, k, src_local, dst_local, length = overlaps(groups) if pairs is None else pairs
  archive = groups.archives(gi, k)
  sources: list[Any] = []
  out: dict[np.dtype, Runs] = {}
  n = len(groups)
  for dtype in layout.slots:
    s_group, s_subtree, s_offset, _ = layout.columns[dtype]
    # The slots of a dtype are in packing order, so sorted by group.
    per_group = np.bincount(s_group, minlength=n)
    first = np.cumsum(per_group) - per_group
    reps = per_group[gi]
    ov = np.repeat(np.arange(len(gi), dtype=np.int64), reps)
    slot = first[gi][ov] + (np.arange(len(ov), dtype=np.int64) - (np.cumsum(reps) - reps)[ov])
    src_id, base, local_keys = locate_runs(archive[ov], gi[ov], s_subtree[slot], dtype)
    # A source holds one dtype, so the keys of each dtype are new: numbered on.
    out[dtype] = Runs(
      src_id + len(sources), base + src_local[ov], s_offset[slot] + dst_local[ov], length[ov]
    )
    sources.extend(local_keys)
  return out, sources


def locate_each(
  locate: Callable[[int, int, int], tuple[Any, int]],
  archive: np.ndarray,
  group: np.ndarray,
  subtree: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, list[Any]]:
  """``locate_runs`` from a ``locate(archive, group, subtree) -> (key, base)`` asked
  once per distinct (archive, group, subtree) of the runs."""
  if not len(archive):
    return np.zeros(0, np.int64), np.zeros(0, np.int64), []
  triples = np.stack([archive, group, subtree], axis=1)
  unique, inverse = np.unique(triples, axis=0, return_inverse=True)
  keys: dict[Any, int] = {}
  key_of = np.empty(len(unique), np.int64)
  base_of = np.empty(len(unique), np.int64)
  for i, (a, g, m) in enumerate(unique.tolist()):
    key, base = locate(a, g, m)
    key_of[i] = keys.setdefault(key, len(keys))
    base_of[i] = base
  inverse = inverse.reshape(-1)
  return key_of[inverse], base_of[inverse], list(keys)


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


def unique_ints(x: np.ndarray) -> np.ndarray:
  """The sorted distinct values of an integer array: ``np.unique(x)`` by one sort, which
  here costs a tenth of the hash table numpy 2.4 builds for it (20,000 values: 0.16
  against 1.3 ms)."""
  s = np.sort(np.asarray(x).reshape(-1))
  return s[np.concatenate([[True], s[1:] != s[:-1]])] if len(s) else s

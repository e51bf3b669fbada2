"""The padding of source records in memory, checked before a reshard reads them.

A source rank's slots past what its flat shard owns are padding and hold zero
bits. A read from disk refuses padding that is not zero and a save refuses to
write it; a reshard of records in memory refuses it the same way, and reads
the same padding: that of every source buffer a target rank copies from and
of the all-padding ranks after it (``copyplan.padding_spans``). Like the
history buffers, the padding is read as it is at each call.

The padding is read where the bytes are, in time per byte of padding rather
than Python per buffer:

* host buffers: the pieces of padding, views of the buffers made once per
  plan, concatenated by one C-level pass over their list and scanned;
* uniform archives whose buffers are the evenly spaced rows of one
  allocation (what ``shard_state`` and ``reshard_ranks`` build), when
  several target ranks are built and the copy by blocks stacks them anyway:
  one gather over the rows, its index table made once per plan;
* buffers on a GPU/TPU: read there by a reduction over the spans of the
  packed archives (``device.nonzero_runs``), of which only the answer (any
  nonzero bit?) comes back to the host.

A refusal names the first nonzero element in the order of the spans (param,
then source rank, then mirror), whichever way it was found.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import groups as _groups
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.engine.sources import MemorySources
from jaxreshard._src.errors import PlacementError

__all__ = ["check", "padding_plan"]

# A piece of padding made as a view costs about as much Python as scanning this
# many elements: where the copy by blocks makes the source rows as one copy
# anyway, they are scanned instead when the pieces outnumber their elements by this.
_PIECE_ELEMENTS = 1024


class PadPlan:
  """The padding spans some target ranks read.

  ``pairs``: (row, source rank, first element, 0, length) of each span, as
  ``copyplan.padding_spans`` gives them. ``runs[dtype]`` (made when first
  asked): a ``copyplan.Runs`` over ``keys`` per history buffer of the spans,
  whose ``dst`` lays them back to back in span order.
  """

  def __init__(self, src: MemorySources, groups: _groups.Groups, pairs: tuple):
    self._src, self._groups = src, groups
    self.pairs = pairs
    self.spans = len(pairs[0])
    # Per dtype the pieces as views of the host buffers, when they may be kept.
    self.pieces: dict[np.dtype, list[np.ndarray]] = {}
    self._accelerator: bool | None = None

  @functools.cached_property
  def _runs(self) -> tuple[dict[np.dtype, _copyplan.Runs], list]:
    src, groups = self._src, self._groups
    layout = _copyplan.target_layout(groups)
    runs, keys = _copyplan.plan_runs(
      groups, layout, lambda a, g, m, d: src.locate_runs(groups, a, g, m, d), self.pairs
    )
    packed = {}
    for dtype, r in runs.items():
      if len(r):
        ends = np.cumsum(r.length)
        packed[dtype] = _copyplan.Runs(r.source, r.src, ends - r.length, r.length)
    return packed, keys

  def on_accelerator(self) -> bool:
    """Whether a buffer the spans read lives on a GPU/TPU (looked at once: a
    record's arrays do not move)."""
    if self._accelerator is None:
      self._accelerator = self._src.on_accelerator(self.keys)
    return self._accelerator

  runs = property(lambda self: self._runs[0])
  keys = property(lambda self: self._runs[1])

  @functools.cached_property
  def dtypes(self) -> list[np.dtype]:
    """The dtypes of the history buffers of the spans' rows."""
    facts = self._groups.facts
    rows = np.unique(self.pairs[0]).tolist()
    return sorted({d for g in rows for _, d in _copyplan.history_buffers(facts[g])}, key=str)


def padding_plan(
  src: MemorySources, groups: _groups.Groups, ranks: tuple[int, int] | None
) -> PadPlan:
  """The padding spans that target ranks ``[first, stop)`` (``ranks``) of ``groups``'s
  world read; with ``ranks`` None, the target rank of each row."""
  slots, count = groups.slots, groups.count
  if ranks is None:
    lo, hi, first, stop = groups.start, groups.stop, groups.rank, groups.rank + 1
  else:
    first, stop = ranks
    lo = _groups.clipped(first, slots, count)
    hi = _groups.clipped(stop, slots, count)
  pad_lo = first * slots
  pad_hi = np.where(stop < groups.world, stop * slots, groups.src_slots * groups.src_world)
  return PadPlan(src, groups, _copyplan.padding_spans(groups, lo, hi, pad_lo, pad_hi))


def check(
  src: MemorySources, tables: Sequence[_groups.Groups], executor: str, rows: dict | None = None
) -> None:
  """Refuses the first nonzero padding element, in (param, source rank, mirror,
  element) order, that a target rank of ``tables`` would read from ``src`` (a
  ``PlacementError`` naming param, archive, mirror and element).

  ``rows``, when given, receives the source rows this call read as one array
  (by ``id`` of their stack), for the copy by blocks of the same call to reuse.
  """
  found = []
  for groups, ranks in _targets(tables):
    family = groups.family
    if family is None:
      plan = padding_plan(src, groups, ranks)
    else:
      plan = family.recent(("pads", ranks), lambda g=groups, r=ranks: padding_plan(src, g, r))
    if plan.spans:
      hit = _check_plan(src, groups, plan, executor, ranks, rows)
      if hit is not None:
        found.append(hit)
  if found:
    raise min(found, key=lambda hit: hit[0])[1]


def _targets(tables: Sequence[_groups.Groups]) -> list[tuple[_groups.Groups, tuple[int, int]]]:
  """(table, [first, stop) target ranks) to check: consecutive ranks of one family as one."""
  if not tables:
    return []
  family = tables[0].family
  if family is not None and all(t.family is family for t in tables):
    first = tables[0].uniform_rank
    if all(t.uniform_rank == first + i for i, t in enumerate(tables)):
      return [(tables[0], (first, first + len(tables)))]
  return [
    (t, (t.uniform_rank, t.uniform_rank + 1) if t.family is not None else None) for t in tables
  ]


def _check_plan(src, groups, plan: PadPlan, executor: str, ranks, rows) -> tuple | None:
  """The first nonzero element the plan's spans hold, as (order key, refusal), or None."""
  if executor == "device":
    clean = _on_device(src, plan)
  else:
    clean = _by_stack(src, groups, plan, ranks, rows)  # archives in host memory only
    if clean is None and executor == "auto" and plan.on_accelerator():
      clean = _on_device(src, plan)
  if clean:
    return None
  # Nonzero bits somewhere (or no faster way applied): named from the host views.
  hit = _by_pieces(src, plan)
  if hit is None and clean is False:
    raise PlacementError("source padding changed while it was read; reshard again")
  return hit


def _by_pieces(src: MemorySources, plan: PadPlan) -> tuple | None:
  """Scans the spans as views of the host buffers, concatenated per dtype; the first
  nonzero element, in span order over every dtype, as (order key, refusal)."""
  views = src.host_views(plan.keys) if len(plan.pieces) < len(plan.runs) else None
  # Asked after the views are made, which is when copied ones are known: pieces
  # of a view that is a copy are made again at every call.
  keep = not getattr(src, "host_copies", False)
  hits = []
  for dtype, r in plan.runs.items():
    pieces = plan.pieces.get(dtype)
    if pieces is None:
      # A span of a whole buffer (an all-padding rank's) is its view itself.
      pieces = list(
        map(
          lambda s, a, b: views[s] if a == 0 and b == len(views[s]) else views[s][a:b],
          r.source.tolist(),
          r.src.tolist(),
          (r.src + r.length).tolist(),
        )
      )
      if keep:
        plan.pieces[dtype] = pieces
    flat = np.concatenate(pieces)
    if flat.any():
      hits.append(_refusal(src, plan, r, flat))
  return min(hits, key=lambda hit: hit[0]) if hits else None


def _on_device(src: MemorySources, plan: PadPlan) -> bool:
  """Reads the spans on the sources' device, of which only whether any bit is set
  comes back: True when every bit is zero."""
  from jaxreshard._src.engine import devicefetch as _devicefetch  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  for dtype, r in plan.runs.items():
    arrays, source, base = _devicefetch.packed_sources(src, dtype, r, plan.keys)
    if _device_exec.nonzero_runs(arrays, source, r.src + base, r.length):
      return False
  return True


def _by_stack(src, groups: _groups.Groups, plan: PadPlan, ranks, rows) -> bool | None:
  """Gathers the spans from uniform archives' rows seen as one 2-D array, with one
  index table per dtype kept for the plan: True when every bit is zero, False
  when one is not; None where that does not apply (no such rows, or rows that
  are a copy when the pieces would cost less)."""
  family = groups.family
  if family is None or ranks is None or not hasattr(src, "stacked"):
    return None
  from jaxreshard._src.engine import pipeline as _pipeline  # pylint: disable=g-import-not-at-top

  archives = family.remember(("sources",), lambda: _pipeline.common_sources(family.facts))
  if not archives or not src.uniform(archives):
    return None
  # Making a stack costs Python per buffer of every archive (as does looking at
  # where each buffer lives): done here where the copy by blocks of several
  # target ranks does it too, else a stack is only used if made already.
  make = ranks[1] - ranks[0] >= 2
  if make and src.on_accelerator_archives(archives):
    return None
  work = []
  for dtype in plan.dtypes:
    stack = src.stacked(archives, dtype, make=make)
    # A stack that is a copy costs Python per buffer of every archive at each
    # call: worth it only where the copy by blocks reuses it (``rows``).
    if stack is None or (stack.copied and (not make or rows is None)):
      return None
    if stack.copied and plan.spans * _PIECE_ELEMENTS < stack.copied:
      return None
    work.append((dtype, stack))
  for dtype, stack in work:
    array = stack.array()
    flat, step = _flat(array)
    if flat is None:
      return None
    if rows is not None:
      rows[id(stack)] = array
    index = family.recent(
      ("pad index", ranks, dtype, id(stack), step),
      lambda s=stack, k=step: _stack_index(groups, plan.pairs, s, k),
    )
    if np.take(flat, index).any():
      return False
  return True


def _flat(rows: np.ndarray) -> tuple[np.ndarray | None, int]:
  """A 2-D array whose rows are evenly spaced in one allocation as one 1-D view from its
  first element to its last, and the row step in elements; (None, 0) otherwise."""
  itemsize = rows.dtype.itemsize
  n, width = rows.shape
  step = rows.strides[0] // itemsize if n > 1 else width
  if rows.strides[1] != itemsize and width > 1 or rows.strides[0] % itemsize or step < width:
    return None, 0
  size = (n - 1) * step + width if n else 0
  return np.lib.stride_tricks.as_strided(rows, (size,), (itemsize,), writeable=False), step


def _stack_index(groups: _groups.Groups, pairs: tuple, stack: Any, step: int) -> np.ndarray:
  """The flat index (rows ``step`` elements apart) of every element of the spans in
  each of their rows' buffers of a stack."""
  row_of = {pid: i for i, pid in enumerate(groups.params)}
  g = np.fromiter((row_of.get(p, -1) for p, _ in stack.order), np.int64, len(stack.order))
  offset = np.asarray(stack.offsets, np.int64)
  by_row = np.argsort(g, kind="stable")
  g, offset = g[by_row], offset[by_row]
  first = np.searchsorted(g, np.arange(len(groups)))
  per_row = np.searchsorted(g, np.arange(len(groups)), side="right") - first
  row, rank, start, _, length = pairs
  n = per_row[row]
  span = np.repeat(np.arange(len(row), dtype=np.int64), n)
  buf = first[row][span] + (np.arange(len(span), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n))
  base = rank[span] * step + offset[buf] + start[span]
  size = length[span]
  ends = np.cumsum(size)
  total = int(ends[-1]) if len(ends) else 0
  index = np.repeat(base - (ends - size), size) + np.arange(total, dtype=np.int64)
  index.sort()  # read in address order: the gather streams through the rows
  return index


def _refusal(src: MemorySources, plan: PadPlan, r: _copyplan.Runs, flat: np.ndarray):
  """The refusal of the first nonzero element of ``flat`` (the spans of ``r``, back to back)."""
  j = int(np.flatnonzero(flat)[0])
  i = int(np.searchsorted(r.dst, j, side="right")) - 1
  archive, pid, mirror = plan.keys[int(r.source[i])]
  local = int(r.src[i]) + j - int(r.dst[i])
  p = src.placement(archive, pid)
  g = FlatShard.checked(p.shape, p.rank, p.world_size)
  error = _validate.nonzero_padding(pid, archive, mirror, local, g, read=True)
  return (pid, p.rank, mirror, local), error

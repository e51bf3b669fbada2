"""The padding of source records in memory, checked before a reshard reads them.

A source rank's slots past what its flat shard owns are padding and hold zero
bits. A read from disk refuses padding that is not zero and a save refuses to
write it; a reshard of records in memory refuses it the same way, and reads
the same padding: that of every source buffer a target rank copies from and
of the all-padding ranks that fall to it (``copyplan.padding_ranks``). Like the
history buffers, the padding is read as it is at each call.

The padding is read where the bytes are, in time per byte of padding rather
than Python per buffer at each call, first of these that applies:

* uniform archives seen as the rows of one 2-D array (``stacked``), where
  several target ranks are built and the copy by blocks makes that stack
  anyway: over rows evenly spaced in one allocation, the spans' runs (those
  that touch merged) read in place by the compiled library (numpy's gather of
  their elements without it), else one gather per row the spans read; the
  run and index tables are made once per plan;
* numpy buffers that share a few allocations (views of one packed buffer
  per archive, or of one for every archive): one gather per allocation, its
  index table made once per plan from the buffers' addresses;
* buffers on a GPU/TPU: read there by a reduction over the spans of the
  packed archives (``device.nonzero_runs``), of which only the answer (any
  nonzero bit?) comes back to the host;
* other host buffers: the pieces of padding, views of the buffers made once
  per plan (at each call for numpy arrays not in C order), concatenated by
  one C-level pass over their list and scanned.

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
from jaxreshard._src.engine import stacks as _stacks
from jaxreshard._src.engine.sources import MemorySources
from jaxreshard._src.errors import PlacementError
from jaxreshard._src.exec import host as _host_exec

__all__ = ["check", "padding_plan"]

# A gather from the allocations the buffers share is used where each allocation
# holds at least this many of the buffers the spans read on average (fewer, and a
# gather per allocation costs more than a view of each piece).
_BUFFERS_PER_ALLOCATION = 16
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
    self._gathers: list | None | bool = False  # False: not looked at yet

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

  def gathers(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """(flat unsigned view of an allocation, index of the spans' elements in it,
    increasing where the buffers do not overlap) per allocation and dtype, when every buffer the spans read is a
    C-ordered numpy array and they share few allocations; else None. Made once:
    a record's buffers are the same arrays, over the same memory, at every call."""
    if self._gathers is False:
      self._gathers = _allocation_gathers(self._src, self.runs, self.keys)
    return self._gathers

  @functools.cached_property
  def dtypes(self) -> list[np.dtype]:
    """The dtypes of the history buffers of the spans' rows."""
    facts = self._groups.facts
    rows = _copyplan.unique_ints(self.pairs[0]).tolist()
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
  return PadPlan(src, groups, _copyplan.padding_spans(groups, lo, hi, first, stop))


def check(
  src: MemorySources,
  tables: Sequence[_groups.Groups],
  executor: str,
  rows: dict | None = None,
  packs: Any = None,
) -> None:
  """Refuses the first nonzero padding element, in (param, source rank, mirror,
  element) order, that a target rank of ``tables`` would read from ``src`` (a
  ``PlacementError`` naming param, archive, mirror and element).

  ``rows``, when given, receives the source rows this call read as one array
  (by ``id`` of their stack), for the copy by blocks of the same call to reuse.
  ``packs``: the call's ``devicefetch.Packs``, for checks made on a device to
  share its packed buffers with the gathers (a fresh one when None).
  """
  found = []
  for groups, ranks in _targets(tables):
    family = groups.family
    if family is None:
      plan = padding_plan(src, groups, ranks)
    else:
      plan = family.recent(("pads", ranks), lambda g=groups, r=ranks: padding_plan(src, g, r))
    if plan.spans:
      hit = _check_plan(src, groups, plan, executor, ranks, rows, packs)
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


def _check_plan(src, groups, plan: PadPlan, executor: str, ranks, rows, packs) -> tuple | None:
  """The first nonzero element the plan's spans hold, as (order key, refusal), or None."""
  if executor == "device":
    clean = _on_device(src, plan, packs)
  else:
    clean = _by_stack(src, groups, plan, ranks, rows)  # archives in host memory only
    if clean is None and (gathers := plan.gathers()) is not None:
      clean = not any(_host_exec.any_nonzero(flat, index) for flat, index in gathers)
    if clean is None and executor == "auto" and plan.on_accelerator():
      clean = _on_device(src, plan, packs)
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


def _on_device(src: MemorySources, plan: PadPlan, packs) -> bool:
  """Reads the spans on the sources' device, of which only whether any bit is set
  comes back: True when every bit is zero."""
  from jaxreshard._src.engine import devicefetch as _devicefetch  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  if packs is None:
    packs = _devicefetch.Packs(src)
  for dtype, r in plan.runs.items():
    arrays, source, base = _devicefetch.packed_sources(packs, dtype, r, plan.keys)
    if _device_exec.nonzero_runs(arrays, source, r.src + base, r.length):
      return False
  return True


def _by_stack(src, groups: _groups.Groups, plan: PadPlan, ranks, rows) -> bool | None:
  """Reads the spans from uniform archives' rows seen as one 2-D array, with one
  run table per dtype kept for the plan: True when every bit is zero, False
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
  share = make and rows is not None  # the copy by blocks reads the same rows
  work = []
  for dtype in plan.dtypes:
    stack = src.stacked(archives, dtype, make=make)
    if stack is None:
      return None
    # A stack that is a copy is made at each call: worth it only where the copy
    # by blocks reuses it and the pieces would cost more. Rows of their own (an
    # archive's buffers back to back) are read in place instead, row by row.
    copy = stack.copied and share and plan.spans * _PIECE_ELEMENTS >= stack.copied
    if stack.copied and not copy and stack.rows is None:
      return None
    work.append((dtype, stack, copy or not stack.copied))
  for dtype, stack, whole in work:
    if not whole:
      gathers = family.recent(
        ("pad rows", ranks, dtype, id(stack)), lambda s=stack: _row_gathers(groups, plan.pairs, s)
      )
      if any(_host_exec.any_nonzero(row, index) for row, index in gathers):
        return False
      continue
    array = stack.array()
    flat, step = _flat(array)
    if flat is None:
      return None
    if share:
      rows[id(stack)] = array
    runs = family.recent(
      ("pad runs", ranks, dtype, id(stack), step),
      lambda s=stack, k=step: _stack_runs(groups, plan.pairs, s, k),
    )
    if _host_exec.any_nonzero_runs(flat, *runs):
      return False
  return True


def _row_gathers(groups: _groups.Groups, pairs: tuple, stack: Any) -> list:
  """(row, index of the spans' elements in it) of each row of ``stack`` they read."""
  index = _host_exec.run_elements(*_stack_runs(groups, pairs, stack, stack.width))
  row = index // max(stack.width, 1)
  cut = np.flatnonzero(np.diff(row)) + 1
  return [
    (stack.rows[int(r[0])], i - int(r[0]) * stack.width)
    for r, i in zip(np.split(row, cut), np.split(index, cut))
    if len(i)
  ]


def _allocation_gathers(src: MemorySources, runs: dict, keys: list) -> list | None:
  """``PadPlan.gathers``: the spans' elements indexed in the allocations their buffers
  lie in, found from each buffer's address; None where that does not apply."""
  if not keys or type(src.buffer(keys[0])) is not np.ndarray:
    return None  # jax arrays: not asked of each buffer
  buffers = src.buffers(keys)
  # Read through a host view instead: a device array, or a copy per call.
  if set(map(type, buffers)) != {np.ndarray} or not all(map(_stacks.C_ORDER, buffers)):
    return None
  # numpy points a view at the deepest array it views; one whose memory is not
  # one C-ordered block is no allocation to index into, and the buffer is its own.
  owners = [
    o if type(o) is np.ndarray and o.flags.c_contiguous else b
    for b, o in zip(buffers, map(_stacks.BASE, buffers))
  ]
  ids, first, owner = np.unique(
    np.fromiter(map(id, owners), np.int64, len(owners)), return_index=True, return_inverse=True
  )
  if len(ids) > max(1, len(keys) // _BUFFERS_PER_ALLOCATION):
    return None
  allocations = [owners[i] for i in first.tolist()]
  start = _stacks.addresses(allocations)
  stop = start + np.asarray([o.nbytes for o in allocations], np.int64)
  at = _stacks.addresses(buffers)
  owner = owner.reshape(-1)
  if not np.all((at >= start[owner]) & (at + _stacks.nbytes(buffers) <= stop[owner])):
    return None
  at -= start[owner]  # each buffer's byte offset in its allocation
  out = []
  for dtype, r in runs.items():
    size = np.dtype(dtype).itemsize
    uint = _host_exec.UINT.get(size)
    if uint is None:
      return None
    # One gather per (allocation, address modulo the item size).
    code = owner[r.source] * size + at[r.source] % size
    element = at[r.source] // size + r.src
    for c in np.flatnonzero(np.bincount(code)).tolist():
      sel = np.flatnonzero(code == c)
      o, p = allocations[c // size], c % size
      flat = o.reshape(-1).view(np.uint8)
      flat = flat[p : p + (flat.size - p) // size * size].view(uint)
      out.append((flat, _host_exec.run_elements(element[sel], r.length[sel])))
  return out


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


def _stack_runs(
  groups: _groups.Groups, pairs: tuple, stack: Any, step: int
) -> tuple[np.ndarray, np.ndarray]:
  """(start, length) in the flat stack (rows ``step`` elements apart) of the spans in
  each of their rows' buffers, in address order, runs that touch merged into one
  (spans of buffers side by side in a row, a row's last and the next row's
  first): the check reads them in place, one run at a time."""
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
  length = length[span]
  order = np.argsort(base, kind="stable")
  base, length = base[order], length[order]
  if not len(base):
    return base, length
  # A run starts where the previous one does not end right before it.
  first = np.flatnonzero(np.concatenate([[True], base[1:] != (base + length)[:-1]]))
  ends = np.cumsum(length)[np.concatenate([first[1:] - 1, [len(base) - 1]])]
  merged = np.diff(np.concatenate([[0], ends]))
  return np.ascontiguousarray(base[first]), merged


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

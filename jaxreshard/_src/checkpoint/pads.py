"""Where the padding of an archive's packed buffers lies, as arrays.

A packed buffer holds, per (param, mirror), a ``(slots,)`` history buffer; the
elements past what the rank's flat shard owns are padding and must hold zero
bits. An archive of one group shares its layout and its group's geometry with
every other archive of that group: the table of offsets, slots and counts is
made once per (layout, group, dtype), and each archive's padding follows from
its rank with a few array operations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from jaxreshard._src.checkpoint.index import ArchiveLayout, Index
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.errors import ArchiveError, PlacementError

__all__ = ["Pads", "Trailing", "for_archive", "pad_base", "pad_table", "pads_at", "padding_error"]


class Pads:
  """The history buffers in one archive's packed buffer of one dtype, and their padding.

  Buffer ``k`` lies at ``[starts[k], stops[k])`` of the packed buffer; its
  elements from ``owned[k]`` on are padding (past what the rank's flat shard
  owns), which must hold zero bits (a buffer the index lays out with no
  geometry is refused before any read). ``at(ks)`` gives ``owned`` of some
  buffers only. ``names[k]`` and ``mirrors[k]`` are buffer ``k``'s param (its
  number in the index's ``tables.pids``) and mirror; ``find`` looks buffers up
  by them.
  """

  def __init__(self, starts, owned, stops, keys, names, mirrors):
    self.starts, self.stops, self.owned = starts, stops, owned
    self.keys = keys  # (param, mirror) of each buffer
    self.names, self.mirrors = names, mirrors
    self._finder = _Finder(names, mirrors)

  def at(self, ks: np.ndarray) -> np.ndarray:
    return self.owned[ks]

  def find(self, names: np.ndarray, mirrors: np.ndarray) -> np.ndarray:
    """The buffers ``(names[i], mirrors[i])``, in increasing order, each once; those
    the packed buffer does not hold are left out."""
    return self._finder.find(names, mirrors)


class _Finder:
  """Buffers looked up by (param number, mirror), with arrays: each pair is one
  integer code, searched among the sorted codes of the packed buffer's.

  The archives of one group share a finder, and a target rank asks each of them
  for the same buffers: the last few answers are kept, by the bytes asked.
  """

  _KEPT = 8

  def __init__(self, names: np.ndarray, mirrors: np.ndarray):
    self._names, self._mirrors = np.asarray(names, np.int64), np.asarray(mirrors, np.int64)
    self._answers: dict[tuple[bytes, bytes], np.ndarray] = {}

  @functools.cached_property
  def _sorted(self) -> tuple[int, np.ndarray, np.ndarray]:
    width = int(self._mirrors.max()) + 1 if len(self._mirrors) else 1
    codes = self._names * width + self._mirrors
    order = np.argsort(codes, kind="stable")
    return width, codes[order], order

  def find(self, names: np.ndarray, mirrors: np.ndarray) -> np.ndarray:
    names, mirrors = np.asarray(names, np.int64), np.asarray(mirrors, np.int64)
    key = (names.tobytes(), mirrors.tobytes())
    found = self._answers.get(key)  # a dict's get and set are atomic under threads
    if found is None:
      found = self._find(names, mirrors)
      found.flags.writeable = False  # shared by every caller that asks the same
      if len(self._answers) >= self._KEPT:
        self._answers.clear()
      self._answers[key] = found
    return found

  def _find(self, names: np.ndarray, mirrors: np.ndarray) -> np.ndarray:
    width, codes, order = self._sorted
    # A mirror past every buffer's is in none of them (and would alias another code).
    ok = (mirrors >= 0) & (mirrors < width) & (names >= 0)
    want = _copyplan.unique_ints(names[ok] * width + mirrors[ok])
    at = np.minimum(np.searchsorted(codes, want), max(len(codes) - 1, 0))
    hit = codes[at] == want if len(codes) else np.zeros(len(want), bool)
    return np.sort(order[at[hit]])


class PadBase:
  """A (layout, group, dtype)'s buffers: offsets, and the slots and count of each
  buffer's param in the group (-1 where the group does not lay it out)."""

  def __init__(self, starts, stops, names, mirrors, pids, slots, count):
    self.starts, self.stops, self.slots, self.count = starts, stops, slots, count
    self.names, self.mirrors, self._pids = names, mirrors, pids
    self.finder = _Finder(names, mirrors)

  @functools.cached_property
  def keys(self) -> list[tuple[str, int]]:
    pids = self._pids
    return [(pids[n], m) for n, m in zip(self.names.tolist(), self.mirrors.tolist())]


class _RankPads(Pads):
  """``Pads`` of the archive at ``rank`` of a ``PadBase``'s group, made as asked."""

  def __init__(self, base: PadBase, rank: int):  # pylint: disable=super-init-not-called
    self.base, self.rank = base, rank
    self.starts, self.stops = base.starts, base.stops
    self.names, self.mirrors, self._finder = base.names, base.mirrors, base.finder

  keys = property(lambda self: self.base.keys)

  def at(self, ks) -> np.ndarray:
    b, rank = self.base, self.rank
    slots, count = b.slots[ks], b.count[ks]
    start = np.minimum(rank * slots, count)
    stop = np.minimum((rank + 1) * slots, count)
    own = np.where(slots >= 0, stop - start, b.stops[ks] - b.starts[ks])
    return b.starts[ks] + own

  @functools.cached_property
  def owned(self) -> np.ndarray:
    return self.at(slice(None))


def pad_base(index: Index, layout: ArchiveLayout, gi: int, dtype: np.dtype) -> PadBase:
  """The buffers of ``dtype`` of ``layout`` in group ``gi``, for ``pads_at``: from the
  layout's and the index's arrays."""
  t, cols = index.tables, layout.columns
  code = list(layout.dtypes).index(np.dtype(dtype))
  sel = np.flatnonzero(cols.dtype == code)
  order = sel[np.argsort(cols.offset[sel], kind="stable")]
  names, mirrors = cols.name[order], cols.mirror[order]
  starts = cols.offset[order]
  n = cols.slots[order]
  # Each buffer's param entry in the group (by its id), its count and its slots there.
  entry = np.full(len(t.pids), -1, np.int64)
  params = t.group_params(gi)
  entry[t.p_name[params]] = params
  e = entry[names]
  world = int(t.g_world[gi])
  count = np.where(e >= 0, t.p_count[np.maximum(e, 0)], -1)
  slots = -(-count // world)
  valid = (e >= 0) & (slots == n)
  return PadBase(
    starts,
    starts + n,
    names,
    mirrors,
    t.pids,
    np.where(valid, slots, -1),
    np.where(valid, count, -1),
  )


def pads_at(base: PadBase, rank: int) -> Pads:
  """The padding of the archive at ``rank`` of ``base``'s group."""
  return _RankPads(base, rank)


def _entries(layout: ArchiveLayout, dtype: np.dtype) -> list:
  return sorted((o, n, k) for k, (d, o, n) in layout.offsets.items() if d == dtype)


def pad_table(
  index: Index, layout: ArchiveLayout, placement: Callable, archive: int, dtype: np.dtype
) -> Pads:
  """Where the padding of an archive's packed buffer of ``dtype`` lies, buffer by buffer
  (for an archive in several groups)."""
  entries = _entries(layout, dtype)
  starts, owned, stops, keys = [], [], [], []
  for o, n, (pid, m) in entries:
    g = None
    p = placement(archive, pid)
    if p is not None:
      try:
        g = FlatShard.checked(p.shape, p.rank, p.world_size)
      except PlacementError:
        g = None  # refused by validation, never read
    # A buffer the index does not lay out is refused before reads.
    own = g.owned if g is not None and g.slots == n else n
    starts.append(o)
    owned.append(o + own)
    stops.append(o + n)
    keys.append((pid, m))
  return Pads(
    np.asarray(starts, np.int64),
    np.asarray(owned, np.int64),
    np.asarray(stops, np.int64),
    keys,
    np.fromiter((index.name_of.get(pid, -1) for pid, _ in keys), np.int64, len(keys)),
    np.fromiter((m for _, m in keys), np.int64, len(keys)),
  )


def for_archive(
  index: Index,
  layout: ArchiveLayout,
  placement: Callable,
  archive: int,
  dtype: np.dtype,
  bases: dict,
) -> Pads:
  """The padding of an archive's packed buffer of ``dtype``.

  An archive of one group takes its group's table (``bases``, by (layout, group,
  dtype), filled as needed; a dict's get and set are atomic under threads), at
  its rank; an archive in several groups is laid out buffer by buffer.
  """
  member = index.member[archive]
  if len(member) != 1:
    return pad_table(index, layout, placement, archive, dtype)
  gi, rank = member[0]
  key = (index.archive_layout[archive], gi, dtype)
  base = bases.get(key)
  if base is None:
    base = bases[key] = pad_base(index, layout, gi, dtype)
  return pads_at(base, rank)


def padding_error(path: str, archive: int, key: tuple, g: FlatShard, local: int) -> ArchiveError:
  """Nonzero bits at ``local`` in the padding of buffer ``key`` (param, mirror)."""
  pid, m = key
  return ArchiveError(
    f"param {pid!r}: history buffer {m} of archive {archive}"
    f" ({path}): padding is not zero (nonzero bits at"
    f" local index {local}); the index gives rank {g.rank} of shape {g.shape} over world_size"
    f" {g.world_size}, which owns {g.owned} of its {g.slots} slots, so the data"
    " contradicts the layout"
  )


def error_at(path: str, placement: Callable, archive: int, key: tuple, local: int) -> ArchiveError:
  """``padding_error`` of buffer ``key`` of ``archive``, its geometry from the index."""
  p = placement(archive, key[0])
  return padding_error(path, archive, key, FlatShard.checked(p.shape, p.rank, p.world_size), local)


class Trailing:
  """All-padding source buffers whose padding a target rank checks, as arrays.

  No run copies from these buffers (they hold no data), so their padding is read
  for its own sake: each is ``(archive, dtype, param, mirror)``, the param by its
  number in the index's ``tables.pids``. Rows are added in arrays, one call per
  group of params and mirror, never one per buffer; a buffer added twice is
  checked once.
  """

  def __init__(self):
    self._parts: dict[np.dtype, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

  def add(self, dtype: np.dtype, archives, names, mirrors) -> None:
    """Buffers ``(archives[i], dtype, names[i], mirrors[i])``; scalars broadcast."""
    a, n, m = np.broadcast_arrays(*(np.asarray(x, np.int64) for x in (archives, names, mirrors)))
    if a.size:
      self._parts.setdefault(np.dtype(dtype), []).append((a.ravel(), n.ravel(), m.ravel()))

  def update(self, other: Trailing) -> Trailing:
    """Adds every buffer of ``other``; returns self."""
    for d, parts in other._parts.items():
      self._parts.setdefault(d, []).extend(parts)
    return self

  def __bool__(self) -> bool:
    return bool(self._parts)

  def by_file(self) -> list[tuple[int, np.dtype, np.ndarray, np.ndarray]]:
    """``(archive, dtype, names, mirrors)`` per packed buffer, in order of (archive,
    dtype name), each buffer once."""
    out = []
    for d, parts in self._parts.items():
      a, n, m = (np.concatenate(c) for c in zip(*parts))
      order = np.lexsort((m, n, a))
      a, n, m = a[order], n[order], m[order]
      first = np.concatenate([[True], (a[1:] != a[:-1]) | (n[1:] != n[:-1]) | (m[1:] != m[:-1])])
      a, n, m = a[first], n[first], m[first]
      starts = np.flatnonzero(np.concatenate([[True], a[1:] != a[:-1]]))
      stops = np.append(starts[1:], len(a))
      for s, e in zip(starts.tolist(), stops.tolist()):
        out.append((int(a[s]), d, n[s:e], m[s:e]))
    out.sort(key=lambda row: (row[0], row[1].name))
    return out

"""Uniform archives' history buffers of one dtype seen as the rows of one 2-D array.

``RecordSources.stacked`` asks for a ``Stack`` of the archives of a group (each
archive one row, each buffer at one offset of every row), which the host
executor copies every target rank from by blocks. Where the archives' buffers
already lie evenly spaced in one allocation the stack is a strided view of it;
otherwise its rows are packed once.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.engine import homes as _homes
from jaxreshard._src.exec import host as _host_exec

__all__ = ["Stack", "Stacks", "addresses", "buffers_of", "make_stack"]


class Stack:
  """History buffers of one dtype of several uniform archives as a 2-D unsigned array.

  Attributes:
    order: ``(param, mirror)`` of each buffer of a row, in packing order.
    offsets: the first element of each in a row.
    width: elements in a row.
  """

  def __init__(self, order, offsets, width, rows=None, views=None, whole=None):
    self.order = tuple(order)
    self.offsets = tuple(offsets)
    self.width = width
    self._rows = rows  # one flat view per archive
    self._views = views  # every buffer's view, archive after archive
    self._whole = whole  # the rows as one view

  @property
  def rows(self) -> list[np.ndarray] | None:
    """One flat view per archive, where each archive's buffers lie back to back."""
    return self._rows

  @property
  def copied(self) -> int:
    """Elements :meth:`array` copies per call: 0 when it is a view of the sources."""
    if self._whole is not None:
      return 0
    return (len(self._rows) if self._rows is not None else len(self._views) // len(self.order)) * (
      self.width
    )

  def array(self) -> np.ndarray:
    """``(archives, width)``: a view where the rows lie evenly in one allocation,
    else a fresh copy of what the sources hold now."""
    if self._whole is not None:
      return self._whole
    if self._rows is not None:
      return np.stack(self._rows)
    rows = len(self._views) // max(len(self.order), 1)
    out = np.empty(rows * self.width, self._views[0].dtype)
    np.concatenate(self._views, out=out)
    return out.reshape(rows, self.width)  # rows named: a width of 0 leaves -1 undefined


class Stacks:
  """The stacks of one source set, by (archives, dtype), made once; owned by it."""

  def __init__(self):
    self._made: dict[tuple, Stack | bool] = {}  # False: the buffers cannot be stacked

  def get(self, src: Any, archives: tuple[int, ...], dtype: np.dtype, make: bool) -> Stack | None:
    """The ``dtype`` history buffers of ``archives`` as the rows of one 2-D unsigned
    array, one row per archive in order, each row its buffers back to back in
    packing order; None when a buffer cannot be viewed on the host, or (without
    ``make``) when it was not made yet.

    Made once (``make_stack``), looking at every buffer of every archive in C
    over their list: when each archive's buffers already lie back to back in
    one allocation, a row is a view of them and the rows are stacked per call
    (or viewed, when the rows themselves are evenly spaced in one allocation);
    otherwise the buffers are concatenated per call, one C-level pass over the
    list of their views. No bytes are kept: a stack copies what the sources
    hold when it is read.
    """
    key = (archives, dtype)
    hit = self._made.get(key)
    if hit is None and make:
      hit = self._made.setdefault(key, make_stack(src, archives, dtype))
    return hit or None


def _address(view: np.ndarray) -> int:
  return view.__array_interface__["data"][0]


def make_stack(src: Any, archives: tuple[int, ...], dtype: np.dtype) -> Stack | bool:
  """``RecordSources.stacked``'s work, or False where it does not apply."""
  order = src._packing_of(archives[0], dtype)
  n = len(order)
  if not n:
    return False
  # Buffers that are numpy arrays are looked at as they are (no view is kept
  # per buffer when an archive's buffers lie back to back), in C over the list.
  buffers = buffers_of(src, archives, order)
  try:
    sizes = np.fromiter(map(_SIZE, buffers), np.int64, len(buffers))
  except (AttributeError, TypeError):
    sizes = np.fromiter((np.size(b) for b in buffers), np.int64, len(buffers))
  sizes = sizes.reshape(len(archives), n)
  if not (sizes == sizes[0]).all():
    return False
  offsets = np.cumsum(sizes[0]) - sizes[0]
  width = int(sizes[0].sum())
  uint = _host_exec.UINT.get(dtype.itemsize)
  if uint is not None and set(map(type, buffers)) == {np.ndarray}:
    rows = _packed_rows(buffers, offsets, width, dtype)
    if rows is not None:
      rows = [r.view(uint) for r in rows]
      return Stack(order, offsets.tolist(), width, rows=rows, whole=_evenly_spaced(rows))
  if any(map(_homes.copied_on_read, buffers)):
    return False  # a stack is kept across calls
  try:
    views = src.host_views([(a, pid, m) for a in archives for pid, m in order])
  except (TypeError, ValueError, RuntimeError):
    return False
  if any(v.ndim != 1 or not v.flags.c_contiguous for v in views):
    return False
  return Stack(order, offsets.tolist(), width, views=views)


def buffers_of(src: Any, archives: Sequence[int], order: Sequence[tuple[str, int]]) -> list[Any]:
  """``src.buffer`` of every ``(param, mirror)`` of ``order`` in each archive,
  archive after archive: a few C-level look-ups per archive, none per buffer."""
  mirrors = sorted({m for _, m in order})
  pids = {m: [pid for pid, mm in order if mm == m] for m in mirrors}
  gets = [operator.itemgetter(*pids[m], pids[m][0]) for m in mirrors]  # always a tuple
  # Where each (param, mirror) lands in the mirrors' look-ups laid end to end.
  at, base = {}, 0
  for m in mirrors:
    at.update({(pid, m): base + i for i, pid in enumerate(pids[m])})
    base += len(pids[m]) + 1
  pick = operator.itemgetter(*[at[key] for key in order], 0)
  parts = src.parts_by_archive
  out: list[Any] = []
  try:
    for a in archives:
      entries = [parts[a].subtrees[m].entries for m in mirrors]
      out.extend(pick(sum(map(lambda g, e: g(e), gets, entries), ()))[:-1])
  except (KeyError, IndexError):
    return src.buffers([(a, pid, m) for a in archives for pid, m in order])
  return out


def _packed_rows(
  buffers: list[np.ndarray], offsets: np.ndarray, width: int, dtype: np.dtype
) -> list[np.ndarray] | None:
  """Per archive (``len(offsets)`` buffers each, in order) one view of its buffers,
  when they lie back to back in one allocation at ``offsets``; else None."""
  if set(map(_DTYPE, buffers)) != {dtype} or set(map(_NDIM, buffers)) != {1}:
    return None
  if not all(map(C_ORDER, buffers)):
    return None
  n = len(offsets)
  # numpy points a view at the deepest array it views: one base per archive (a
  # buffer that owns its memory is its own).
  ids = np.fromiter(map(id, buffers), np.int64, len(buffers))
  base = np.fromiter(map(id, map(BASE, buffers)), np.int64, len(buffers))
  owner = np.where(base == id(None), ids, base).reshape(-1, n)
  if not (owner == owner[:, :1]).all():
    return None
  at = addresses(buffers).reshape(-1, n)
  if not (at == at[:, :1] + offsets * dtype.itemsize).all():
    return None
  # Every byte of a row lies in one of its buffers, all inside one allocation.
  return [
    np.lib.stride_tricks.as_strided(buffers[i], (width,), (dtype.itemsize,), writeable=False)
    for i in range(0, len(buffers), n)
  ]


BASE = operator.attrgetter("base")
C_ORDER = operator.attrgetter("flags.c_contiguous")
_DTYPE = operator.attrgetter("dtype")
_NDIM = operator.attrgetter("ndim")
_SIZE = operator.attrgetter("size")
_NBYTES = operator.attrgetter("nbytes")


def nbytes(arrays: list[np.ndarray]) -> np.ndarray:
  """The bytes of each numpy array, read in C over the list."""
  return np.fromiter(map(_NBYTES, arrays), np.int64, len(arrays))


def addresses(arrays: list[np.ndarray]) -> np.ndarray:
  """The address of each numpy array's first byte, in C where they are writable and
  nonempty."""
  try:
    at = map(ctypes.addressof, map(ctypes.c_char.from_buffer, arrays))
    return np.fromiter(at, np.int64, len(arrays))
  except (TypeError, ValueError):
    return np.fromiter(map(_address, arrays), np.int64, len(arrays))


def _evenly_spaced(rows: Sequence[np.ndarray]) -> np.ndarray | None:
  """The rows as one 2-D view when they are evenly spaced rows of one allocation."""
  if len(rows) == 1:
    return rows[0].reshape(1, -1)
  owners = {id(_owner(r)) for r in rows}
  if len(owners) != 1:
    return None
  at = [_address(r) for r in rows]
  step = at[1] - at[0]
  row_bytes = rows[0].size * rows[0].dtype.itemsize
  if step < row_bytes or any(b - a != step for a, b in zip(at, at[1:])):
    return None
  return np.lib.stride_tricks.as_strided(
    rows[0], (len(rows), rows[0].size), (step, rows[0].dtype.itemsize), writeable=False
  )


def _owner(row: np.ndarray) -> Any:
  """The allocation a row made by ``_packed_row`` views."""
  x = row
  while isinstance(x, np.ndarray) or hasattr(x, "__array_interface__"):
    base = getattr(x, "base", None)
    if base is None:
      return x
    x = base
  return x

"""Narrow buffers of many target ranks moved a tile at a time, by one gather.

A run of narrow buffers that lie side by side in both rows is copied through
two tiles (``host._copy_tiled``): its source rows are read whole into one, its
target rows are built in the other and written out whole. Which element of the
source tile each element of the target tile takes depends only on the blocks
and the target rows, never on the bytes, so it is worked out once
(:func:`gather_table`) and every copy of the tile is one gather: a few numpy
calls per tile, whatever the number of buffers and rows in it. Where the
compiled block copy is available (``native``), the gather writes the target
rows straight from the table (no copy of the table into ``np.take``'s index
type, no tile of the gathered elements written out again).

The tables are the caller's to keep (``host.copy_blocks``'s ``tables``): one
per run of buffers, for one range of target rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxreshard._src.exec import native as _native

__all__ = ["GatherTable", "copy_tile", "gather_table"]

# Tables hold int32 positions (half the memory of ``intp``) up to this one.
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class GatherTable:
  """Where each element of a target tile comes from in its source tile.

  Attributes:
    k0, k1: the source rows read (``[k0, k1)``).
    rows: the target rows written, from row 0 of the output.
    width_in, width_out: the tile's elements per source row and per target row.
    index: int32 (int64 for a tile too large for it), one entry per target
      tile element in row-major order: its position in the source tile
      (row-major), or ``(k1 - k0) * width_in``, the zero placed right after the
      source tile, for padding.
  """

  k0: int
  k1: int
  rows: int
  width_in: int
  width_out: int
  index: np.ndarray


def gather_table(so, ss, to, ts, lo, hi, i: int, j: int) -> GatherTable:
  """The table of buffers ``i:j`` (side by side in both rows: ``so[b + 1] == so[b] +
  ss[b]`` and ``to[b + 1] == to[b] + ts[b]``) whose flat ranges ``[lo, hi)`` fill the
  target rows from row 0 on (``host._copy_blocks``'s columns)."""
  k0 = min(lo[b] // ss[b] for b in range(i, j))
  k1 = max((hi[b] - 1) // ss[b] + 1 for b in range(i, j))
  rows = max(-(-(hi[b] - lo[b]) // ts[b]) for b in range(i, j))
  width_in = so[j - 1] + ss[j - 1] - so[i]
  width_out = to[j - 1] + ts[j - 1] - to[i]
  src_slots, dst_slots = np.asarray(ss[i:j], np.int64), np.asarray(ts[i:j], np.int64)
  first, last = np.asarray(lo[i:j], np.int64), np.asarray(hi[i:j], np.int64)
  src_at = np.asarray(so[i:j], np.int64) - so[i]
  # Each target column: its buffer, and its place in that buffer's row.
  buf = np.repeat(np.arange(j - i), dst_slots)
  col = np.arange(width_out, dtype=np.int64) - np.repeat(
    np.cumsum(dst_slots) - dst_slots, dst_slots
  )
  # Each target element's flat position in its buffer: row r holds the
  # buffer's elements lo + r * ts + col.
  flat = first[buf] + np.arange(rows, dtype=np.int64)[:, None] * dst_slots[buf] + col
  slots = src_slots[buf]
  source = (flat // slots - k0) * width_in + src_at[buf] + flat % slots
  pad = (k1 - k0) * width_in
  index = np.where(flat < last[buf], source, pad)
  kind = np.int32 if pad <= _INT32_MAX else np.int64
  return GatherTable(k0, k1, rows, width_in, width_out, index.astype(kind).reshape(-1))


def copy_tile(src, out, table: GatherTable, so: int, to: int, tiles, positions) -> None:
  """Copies one tile: ``src[k0:k1, so:so + width_in]`` into ``tiles``, a zero right
  after it, one gather after that, written to ``out[:rows, to:to + width_out]``.

  Args:
    src, out: unsigned 2-D source and target rows.
    table: the tile's :class:`GatherTable`.
    so, to: the tile's first column in a source row and in a target row.
    tiles: scratch of ``src``'s dtype, and ``positions`` of ``intp`` (``np.take``'s
      index type); fresh ones are made for a tile that does not fit them.
  """
  n_in = (table.k1 - table.k0) * table.width_in
  n_out = table.rows * table.width_out
  if n_in + 1 + n_out > len(tiles):
    tiles = np.empty(n_in + 1 + n_out, src.dtype)
  if n_out > len(positions):
    positions = np.empty(n_out, np.intp)
  tiles[:n_in].reshape(-1, table.width_in)[...] = src[table.k0 : table.k1, so : so + table.width_in]
  tiles[n_in] = 0
  target = out[: table.rows, to : to + table.width_out]
  if _native.enabled and table.index.dtype == np.int32 and _native.fits(target, target):
    _native.gather_tile(tiles[: n_in + 1], table.index, target)
    return
  index = positions[:n_out]
  np.copyto(index, table.index)
  tile_out = tiles[n_in + 1 : n_in + 1 + n_out]
  np.take(tiles[: n_in + 1], index, out=tile_out, mode="clip")
  target[...] = tile_out.reshape(table.rows, table.width_out)

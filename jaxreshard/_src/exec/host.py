"""The host executor: target buffers assembled with numpy copies, no program compiled.

Sources in host memory (numpy arrays, bytes read from disk, arrays of the CPU
backend, which numpy views without a copy) are copied run by run into one
fresh buffer per (target rank, dtype). Copies move unsigned-integer views of
the bytes, so no value is ever interpreted: NaN payloads, -0.0, subnormals and
bfloat16 all arrive bit for bit. Padding is the zeros of the fresh buffer.

A fresh buffer pays a page fault per page on first touch; two threads copying
disjoint halves of the runs (numpy releases the GIL while it copies) hide
much of it, so large targets are split between ``THREADS`` workers.

Block copies (every target rank of a plan at once) go through the compiled
block copy of ``native`` where the package was built with it.
"""

from __future__ import annotations

import concurrent.futures
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core import workers as _workers
from jaxreshard._src.core.copyplan import Blocks, Runs
from jaxreshard._src.exec import bitview as _bitview
from jaxreshard._src.exec import native as _native
from jaxreshard._src.exec import tiles as _tiles

__all__ = [
  "Program",
  "any_nonzero",
  "any_nonzero_runs",
  "bits",
  "copy_blocks",
  "execute",
  "host_bits",
  "host_view",
  "run",
]

THREADS = 2
# Below this many bytes a second thread costs more than it saves.
_PARALLEL_BYTES = 4 << 20

bits = _bitview.bits
UINT = _bitview.UINT


def host_view(x: Any) -> np.ndarray:
  """``x`` as a flat numpy array; arrays of the CPU backend are viewed, not copied."""
  return np.asarray(x).reshape(-1)


def host_bits(x: Any) -> np.ndarray:
  """``bits(host_view(x))``: a flat, contiguous 1-D array of a width with an unsigned
  type is viewed in one step."""
  a = np.asarray(x)
  uint = _bitview.UINT.get(a.dtype.itemsize)
  if a.ndim == 1 and uint is not None and a.flags.c_contiguous:
    return a.view(uint)
  return bits(host_view(a))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return _workers.pool("copy", THREADS - 1)


def _in_two(fn: Any, here: tuple, there: tuple) -> tuple[Any, Any]:
  """``fn(*here)`` on this thread and ``fn(*there)`` on the pool's at once; both
  results. The pool's half is waited for even when this one raises, so nothing
  is left writing into an output the caller drops."""
  other = _pool().submit(fn, *there)
  try:
    mine = fn(*here)
  finally:
    theirs = other.result()
  return mine, theirs


# Below this many runs ``any_nonzero_runs`` reads them in one thread.
_PARALLEL_RUNS = 1 << 14
# Elements ``any_nonzero`` gathers per numpy call: the values stay in cache
# between the gather and the test, and nothing as large as the index is made.
_GATHER_CHUNK = 1 << 16


def any_nonzero(flat: np.ndarray, index: np.ndarray) -> bool:
  """``np.take(flat, index).any()``, a chunk at a time; a large index is split
  between ``THREADS`` workers (numpy releases the GIL while it gathers).

  An index out of ``flat``'s range raises numpy's ``IndexError``, as ``np.take``.
  """
  n = len(index)
  if THREADS < 2 or n * flat.itemsize < 2 * _PARALLEL_BYTES:
    return _any_nonzero(flat, index, 0, n)
  half = n // 2
  return any(_in_two(_any_nonzero, (flat, index, 0, half), (flat, index, half, n)))


def any_nonzero_runs(flat: np.ndarray, start: np.ndarray, length: np.ndarray) -> bool:
  """Whether any element of the runs ``flat[start[j] : start[j] + length[j]]`` (int64
  arrays) has a bit set: read in place, run by run, by the compiled library where
  it is available (no index of every element), else ``any_nonzero`` of the runs'
  elements.

  A run outside ``flat`` raises ``ValueError`` from the compiled library, or numpy's
  ``IndexError``.
  """
  if not (_native.enabled and flat.ndim == 1 and flat.flags.c_contiguous):
    return any_nonzero(flat, run_elements(start, length))
  n = len(start)
  # Runs lie apart in memory, each read a wait for it: two threads wait at once.
  if THREADS < 2 or n < _PARALLEL_RUNS:
    return _native.any_nonzero_runs(flat, start, length)
  half = n // 2
  return any(
    _in_two(
      _native.any_nonzero_runs,
      (flat, start[:half], length[:half]),
      (flat, start[half:], length[half:]),
    )
  )


def run_elements(start: np.ndarray, length: np.ndarray) -> np.ndarray:
  """Every element of runs ``[start, start + length)``, runs in order of their starts:
  increasing where they do not overlap."""
  order = np.argsort(start, kind="stable")
  start, length = start[order], length[order]
  ends = np.cumsum(length)
  total = int(ends[-1]) if len(ends) else 0
  return np.repeat(start - (ends - length), length) + np.arange(total, dtype=np.int64)


def _any_nonzero(flat: np.ndarray, index: np.ndarray, a: int, b: int) -> bool:
  for at in range(a, b, _GATHER_CHUNK):
    if np.take(flat, index[at : min(at + _GATHER_CHUNK, b)]).any():
      return True
  return False


class Program:
  """The runs of one target buffer made ready to copy, run by run, into any fresh buffer.

  Runs are sorted by ``dst``; each run's piece of its source is made once, as
  an unsigned view, and a copy moves a gapless stretch of runs with one
  ``np.concatenate``. A program holds views of its sources, never a copy of
  their bytes: made once for a plan, it copies what the sources hold when it
  runs.
  """

  def __init__(self, sources: Sequence[np.ndarray], runs: Runs):
    if len(runs) > 1 and (np.diff(runs.dst) < 0).any():
      order = np.argsort(runs.dst, kind="stable")
      runs = Runs(runs.source[order], runs.src[order], runs.dst[order], runs.length[order])
    src = [s if s.dtype.kind == "u" else bits(s) for s in sources]
    self.length = runs.length
    self.elements = runs.elements
    self._pieces = list(
      map(
        operator.getitem,
        [src[i] for i in runs.source.tolist()],
        map(slice, runs.src.tolist(), (runs.src + runs.length).tolist()),
      )
    )
    dst, end = runs.dst, runs.dst + runs.length
    self._dst, self._end = dst, end
    # A stretch starts at a run whose dst is not where the previous one ended.
    self._starts = np.flatnonzero(np.concatenate([[True], dst[1:] != end[:-1]]))

  def __len__(self) -> int:
    return len(self.length)

  def copy(self, out: np.ndarray, lo: int, hi: int) -> None:
    """Copies runs ``lo:hi`` into ``out`` (an unsigned view of the target buffer)."""
    if lo >= hi:
      return
    pieces = self._pieces[lo:hi]
    starts = self._starts[(self._starts >= lo) & (self._starts < hi)]
    if not len(starts) or starts[0] != lo:
      starts = np.concatenate([[lo], starts])
    stops = np.append(starts[1:], hi)
    for i, j, b, e in zip(
      (starts - lo).tolist(),
      (stops - lo).tolist(),
      self._dst[starts].tolist(),
      self._end[stops - 1].tolist(),
    ):
      if j - i == 1:
        out[b:e] = pieces[i]
      else:
        np.concatenate(pieces[i:j], out=out[b:e])


def execute(sources: Sequence[np.ndarray], runs: Runs, size: int, dtype: np.dtype) -> np.ndarray:
  """A fresh ``(size,)`` array of ``dtype``: the runs copied in, zeros elsewhere.

  Args:
    sources: flat arrays of ``dtype``, or unsigned-integer views of their bytes
      (only bytes move).
    runs: run tables indexing ``sources``; runs never overlap in the output.
    size: elements of the target buffer.
    dtype: its dtype.
  """
  return run(Program(sources, runs), size, dtype)


def run(program: Program, size: int, dtype: np.dtype) -> np.ndarray:
  """A fresh ``(size,)`` array of ``dtype`` filled by ``program``, zeros elsewhere."""
  dtype = np.dtype(dtype)
  out = np.zeros(size, dtype)
  n = len(program)
  if not n:
    return out
  view = bits(out)
  if (
    THREADS < 2
    or size * dtype.itemsize < _PARALLEL_BYTES
    or (n < 2 and program.elements * dtype.itemsize < 2 * _PARALLEL_BYTES)
  ):
    program.copy(view, 0, n)
    return out
  if n == 1:  # one long run: its two halves in two threads
    half = int(program.length[0]) // 2
    _in_two(_copy_part, (view, program, 0, half), (view, program, half, None))
    return out
  cut = int(np.searchsorted(np.cumsum(program.length), program.elements // 2)) + 1
  cut = min(max(cut, 1), n - 1)
  _in_two(program.copy, (view, 0, cut), (view, cut, n))
  return out


def _copy_part(out: np.ndarray, program: Program, lo: int, hi: int | None) -> None:
  """Elements ``lo:hi`` of a program's one run."""
  src = program._pieces[0]
  dst = int(program._dst[0])
  hi = len(src) if hi is None else hi
  out[dst + lo : dst + hi] = src[lo:hi]


def copy_blocks(
  src: np.ndarray, out: np.ndarray, blocks: Blocks, first: int, tables: dict | None = None
) -> None:
  """Copies every block into target rows ``first .. first + len(out) - 1``.

  Args:
    src: ``(source ranks, width)`` unsigned: each row one source rank's buffers.
    out: ``(target ranks, width)`` unsigned, zeros: row ``i`` is target rank
      ``first + i``; what no block writes stays zero (padding).
    blocks: where each buffer lies in both (``Blocks``).
    first: the target rank of ``out``'s first row.
    tables: where the gather tables of narrow tiles (``tiles.gather_table``) are
      kept between calls with the same ``blocks``, ``first``, ``len(out)`` and
      ``src.itemsize``; made for this call alone when None.
  """
  n = len(blocks)
  if not n:
    return
  # What each block copies, to split the work between two threads by bytes.
  lo = np.minimum(first * blocks.dst_slots, blocks.count)
  hi = np.minimum((first + out.shape[0]) * blocks.dst_slots, blocks.count)
  moved = np.maximum(hi - lo, 0)
  total = int(moved.sum())
  table = (blocks.src, blocks.src_slots, blocks.dst, blocks.dst_slots, lo, hi)
  tables = {} if tables is None else tables
  if THREADS < 2 or total * out.itemsize < 2 * _PARALLEL_BYTES or n < 2:
    _copy_blocks(src, out, table, tables, 0, n)
    return
  cut = int(np.searchsorted(np.cumsum(moved), total // 2)) + 1
  cut = min(max(cut, 1), n - 1)
  _in_two(_copy_blocks, (src, out, table, tables, 0, cut), (src, out, table, tables, cut, n))


# Elements of a buffer moved per step through the scratch: small enough that the
# scratch stays in cache between reading it from the sources and writing it out.
_CHUNK = 1 << 16
# A buffer whose slots on both sides are at most this many elements is narrow:
# a row of it is less than a cache line or two, and copying it row by row
# costs a cache miss per (rank, buffer). Runs of narrow buffers that lie side
# by side are copied through tiles of at most ``_TILE_BYTES``: their rows read
# whole from the sources, and written whole to the targets. A tile spans every
# source row its buffers have, so each tile is one pass over those rows, a
# cache miss per row: wider tiles make fewer passes. At 4,096 -> 3,072 ranks
# with 1,000 params, tiles of 1, 2, 4 and 8 MiB took 109, 100, 106 and 112 ms
# (2 cores with 2 MiB of L2 each; the tile, its gathered copy and its table
# then no longer fit it).
_NARROW = 32
# With the compiled block copy, whose cost is about a mispredicted branch per
# overlap of a source row and a target row, a run of narrow buffers goes
# through tiles only when its slots average at most this many elements (a
# gather costs ~1.5 ns an element, whatever the overlaps).
_TILED_SLOTS = 8
_TILE_BYTES = 2 << 20
# A buffer whose slots on both sides are at least this many elements is copied
# straight from row to row: an overlap (a numpy call) per at least this many
# elements costs less than moving them twice, through the scratch.
_DIRECT = 2048


def _copy_blocks(src, out, table, tables: dict, a: int, b: int) -> None:
  """Blocks ``a:b``: the flat range ``[lo, hi)`` of each buffer, read from the
  source rows it spans and written to the target rows from row 0 on.

  Runs of narrow buffers move a tile at a time, each tile by its gather table,
  kept in ``tables`` by the run's first and last block. The other buffers move
  through the compiled block copy where it is available (``native``), all in
  one call. Without it, buffers of one geometry that lie side by side in both
  rows (a parameter's ``mu`` and ``nu``) move together: each numpy call moves
  all of them.
  """
  cols = tuple(c[a:b].tolist() for c in table)
  # Arrays the compiled copy does not take (rows apart by a part of an element, or
  # elements at unaligned addresses) are copied with numpy.
  compiled = _native.enabled and _native.fits(src, out)
  scratch = np.empty(_CHUNK, src.dtype)
  tiles = np.empty(2 * (_TILE_BYTES // src.itemsize) + 1, src.dtype)
  positions = np.empty(_TILE_BYTES // src.itemsize, np.intp)
  rest = np.zeros(b - a, bool)  # the blocks left to the compiled copy
  i, n = 0, b - a
  while i < n:
    j = _narrow_run(*cols, i, n, src.itemsize)
    if j - i > 1 and (not compiled or _tiled(cols, i, j)):
      key = (a + i, a + j)
      gather = tables.get(key)
      if gather is None:
        gather = tables.setdefault(key, _tiles.gather_table(*cols, i, j))
      _tiles.copy_tile(src, out, gather, cols[0][i], cols[2][i], tiles, positions)
    elif compiled:
      rest[i:j] = True
    else:
      j = i + _alike(*cols, i, n)
      scratch = _copy_one(src, out, *(c[i] for c in cols), j - i, scratch)
    i = j
  if rest.any():
    _native.copy_blocks(src, out, table, a + np.flatnonzero(rest))


def _tiled(cols, i: int, j: int) -> bool:
  """Whether tiles copy the run of narrow buffers ``i:j`` faster than the compiled
  block copy: its slots average at most ``_TILED_SLOTS`` elements."""
  return sum(cols[1][i:j]) + sum(cols[3][i:j]) <= 2 * _TILED_SLOTS * (j - i)


def _alike(so, ss, to, ts, lo, hi, i: int, n: int) -> int:
  """How many buffers from ``i`` on share buffer ``i``'s geometry and lie side by
  side in both rows."""
  j = i + 1
  while (
    j < n
    and ss[j] == ss[i]
    and ts[j] == ts[i]
    and lo[j] == lo[i]
    and hi[j] == hi[i]
    and so[j] == so[j - 1] + ss[i]
    and to[j] == to[j - 1] + ts[i]
  ):
    j += 1
  return j - i


def _narrow_run(so, ss, to, ts, lo, hi, i: int, n: int, itemsize: int) -> int:
  """The end of the run of narrow buffers from ``i`` that lie side by side in both
  rows and fit one tile (``i + 1`` when buffer ``i`` is not narrow)."""
  rows_in = rows_out = 0
  width_in = width_out = 0
  j = i
  while j < n:
    if hi[j] <= lo[j] or ss[j] > _NARROW or ts[j] > _NARROW:
      break
    if j > i and (so[j] != so[j - 1] + ss[j - 1] or to[j] != to[j - 1] + ts[j - 1]):
      break
    r_in = (hi[j] - 1) // ss[j] + 1 - lo[j] // ss[j]
    r_out = -(-(hi[j] - lo[j]) // ts[j])
    w_in, w_out = width_in + ss[j], width_out + ts[j]
    if j > i and max(max(rows_in, r_in) * w_in, max(rows_out, r_out) * w_out) * itemsize > (
      _TILE_BYTES
    ):
      break
    rows_in, rows_out = max(rows_in, r_in), max(rows_out, r_out)
    width_in, width_out = w_in, w_out
    j += 1
  return max(j, i + 1)


def _copy_one(src, out, so, ss, to, ts, lo, hi, k: int, scratch) -> np.ndarray:
  """``k`` buffers side by side, one geometry: the flat range ``[lo, hi)`` of each,
  straight from source rows to target rows when both are long, else a chunk at
  a time through the scratch."""
  if hi <= lo:
    return scratch
  if min(ss, ts) >= _DIRECT:
    for m in range(k):
      _copy_direct(src, out, so + m * ss, ss, to + m * ts, ts, lo, hi)
    return scratch
  step = max(_CHUNK // k, 1)
  if len(scratch) < k * min(step, hi - lo):
    scratch = np.empty(k * min(step, hi - lo), src.dtype)
  for at in range(lo, hi, step):
    end = min(at + step, hi)
    r, off = divmod(at, ss)
    if (end - 1) // ss == r:  # inside one source row: a view, no copy
      piece = _rows(src, so, ss, k)[r, :, off : off + end - at]
    else:
      piece = scratch[: k * (end - at)].reshape(k, end - at)
      _gather(src, piece, so, ss, k, at, end)
    _scatter(out, piece, to, ts, k, at - lo)
  return scratch


def _rows(a: np.ndarray, start: int, width: int, k: int) -> np.ndarray:
  """``(rows, k, width)``: the columns ``[start, start + k * width)`` of ``a`` as ``k``
  buffers side by side (a view)."""
  return a[:, start : start + k * width].reshape(a.shape[0], k, width)


def _copy_direct(src, out, so, ss, to, ts, lo, hi) -> None:
  """One buffer's flat range ``[lo, hi)``, one copy per overlap of a source row and
  a target row: every byte moved once."""
  at = lo
  while at < hi:
    k, r = at // ss, (at - lo) // ts
    end = min((k + 1) * ss, lo + (r + 1) * ts, hi)
    c = at - lo - r * ts
    out[r, to + c : to + c + end - at] = src[k, so + at - k * ss : so + end - k * ss]
    at = end


def _gather(src: np.ndarray, dst: np.ndarray, so: int, ss: int, k: int, lo: int, hi: int) -> None:
  """``dst[m] =`` the flat range ``[lo, hi)`` of buffer ``m < k``, whose rows are
  ``src[:, so + m * ss : so + (m + 1) * ss]``: a partial first row, whole rows, a
  partial last row."""
  s = _rows(src, so, ss, k)
  r, off = divmod(lo, ss)
  n, at = hi - lo, 0
  if off:
    at = min(ss - off, n)
    dst[:, :at] = s[r, :, off : off + at]
    r += 1
  whole = (n - at) // ss
  if whole:
    dst[:, at : at + whole * ss].reshape(k, whole, ss)[...] = s[r : r + whole].transpose(1, 0, 2)
    at, r = at + whole * ss, r + whole
  if at < n:
    dst[:, at:] = s[r, :, : n - at]


def _scatter(out: np.ndarray, piece: np.ndarray, to: int, ts: int, k: int, at: int) -> None:
  """Writes ``piece[m]`` at flat position ``at`` of buffer ``m < k``, whose rows are
  ``out[:, to + m * ts : to + (m + 1) * ts]``: a partial first row, whole rows, a
  partial last row."""
  o = _rows(out, to, ts, k)
  r, col = divmod(at, ts)
  n, done = piece.shape[1], 0
  if col:
    done = min(ts - col, n)
    o[r, :, col : col + done] = piece[:, :done]
    r += 1
  whole = (n - done) // ts
  if whole:
    o[r : r + whole] = piece[:, done : done + whole * ts].reshape(k, whole, ts).transpose(1, 0, 2)
    done, r = done + whole * ts, r + whole
  if done < n:
    o[r, :, : n - done] = piece[:, done:]

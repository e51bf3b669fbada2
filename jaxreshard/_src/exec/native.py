"""The host executor's block copies compiled in C, where the package was built with it.

``_blockcopy.c`` moves each buffer's flat range from source rows to target rows,
one copy per overlap of a source row and a target row, with no index array
and no Python per overlap (``copy_blocks``); writes a tile of narrow
buffers' target rows straight from its gather table (``gather_tile``); and
reads runs of padding in place for a set bit (``any_nonzero_runs``); checks a
span's chunks against their crc32c (``check_chunks``) and, on Linux, reads and
checks spans of a shard file one after another in one call (``read_spans``). The
package builds it when it is installed; where no C compiler was found, the
build skips it and the host executor copies with numpy alone (the same bits,
more slowly where a buffer's slots are a few hundred elements or less).
Setting ``JAXRESHARD_NATIVE=0`` in the environment before the package is
imported makes it copy with numpy alone too.

The library is called through ctypes, which releases the interpreter's lock for
the call: two threads copy two halves of the blocks at once. Every table is
checked here against both arrays' shapes before the call; the C code checks
no bound.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
  "any_nonzero_runs",
  "available",
  "check_chunks",
  "copy_blocks",
  "enabled",
  "fits",
  "gather_tile",
  "read_spans",
  "first_changed_word",
  "read_words",
  "reads_spans",
]

_LIBRARY = "_blockcopy"
# The interface of ``_blockcopy.c`` this module calls (``jaxreshard_blockcopy_version``).
VERSION = 7


class _Library:
  """The library's entry points (``read_spans`` None where it has none: not Linux)."""

  def __init__(
    self, copy: Any, gather: Any, check: Any, any_runs: Any, read_spans: Any, words: Any, read: Any
  ):
    self.copy, self.gather, self.check, self.any_runs = copy, gather, check, any_runs
    self.read_spans, self.words, self.read = read_spans, words, read


def _load(here: str | None = None) -> Any:
  """The C functions (``copy``, ``gather``, ``check``, ``any_runs``, ``read_spans``), or
  None where the library (in ``here``, this module's directory by default) was not
  built or cannot be loaded."""
  if os.environ.get("JAXRESHARD_NATIVE", "1") == "0" or ctypes.sizeof(ctypes.c_void_p) != 8:
    return None
  here = os.path.dirname(os.path.abspath(__file__)) if here is None else here
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = os.path.join(here, _LIBRARY + suffix)
    if not os.path.isfile(path):
      continue
    try:
      library = ctypes.CDLL(path)
      # The version first: a library of another version may lack any other function.
      version = library.jaxreshard_blockcopy_version()
      if version != VERSION:
        print(
          f"jaxreshard: {path} was built from another version of _blockcopy.c ({version},"
          f" not {VERSION}); copying with numpy until the package is installed again",
          file=sys.stderr,
        )
        return None
      fn = library.jaxreshard_copy_blocks
      gather = library.jaxreshard_gather_tile
      check = library.jaxreshard_check_chunks
      any_runs = library.jaxreshard_any_nonzero_runs
      words = library.jaxreshard_first_changed_word
      read = library.jaxreshard_read_words
      read_spans = library.jaxreshard_read_spans if library.jaxreshard_reads_spans() else None
    except (OSError, AttributeError) as e:
      print(f"jaxreshard: {path} cannot be loaded ({e}); copying with numpy", file=sys.stderr)
      return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    gather.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64]
    gather.restype = ctypes.c_int
    check.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    check.restype = i64
    any_runs.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    any_runs.restype = ctypes.c_int
    words.argtypes = [i64, ptr, ptr]
    words.restype = i64
    read.argtypes = [i64, ptr, ptr]
    read.restype = None
    if read_spans is not None:
      read_spans.argtypes = [ctypes.c_int, ptr, i64, *[ptr] * 9, i64, ptr, ptr]
      read_spans.restype = i64
    return _Library(fn, gather, check, any_runs, read_spans, words, read)
  return None


_library = _load()
# Whether the host executor copies through the C library; tests turn it off to
# compare both ways of copying.
enabled = _library is not None


def available() -> bool:
  """Whether the C library was built and loaded."""
  return _library is not None


def copy_blocks(src: np.ndarray, out: np.ndarray, table: tuple, which: Any) -> None:
  """Copies the blocks ``which`` (an index or slice of ``table``'s entries) from
  ``src``'s rows to ``out``'s rows.

  Args:
    src: ``(source ranks, width)`` unsigned, each row contiguous (``fits``).
    out: ``(target rows, width)`` unsigned of the same width in bytes per element,
      each row contiguous (``fits``).
    table: six int64 arrays, one entry per block: its first column and slots in
      a source row (``so``, ``ss``), in a target row (``to``, ``ts``), and the
      flat range ``[lo, hi)`` to copy, whose element ``lo`` lands at column ``to``
      of ``out``'s row 0.

  Raises:
    ValueError: the arrays (``fits``) or a block do not fit (a bug of the caller's:
      nothing is copied).
  """
  if _library is None:
    raise ValueError("the compiled block copy is not available")
  so, ss, to, ts, lo, hi = (np.ascontiguousarray(c[which], np.int64) for c in table)
  live = hi > lo
  if not live.any():
    return
  so, ss, to, ts, lo, hi = (c[live] for c in (so, ss, to, ts, lo, hi))
  size = src.itemsize
  if not fits(src, out):
    raise ValueError(
      f"block copy: arrays {src.dtype}{src.shape}/{src.strides} and"
      f" {out.dtype}{out.shape}/{out.strides} are not rows of unsigned elements"
    )
  # No bound is summed: a row's width less a block's slots (both in [0, width]) is
  # compared with its first column, which cannot wrap int64 however wide the rows.
  width_in, width_out = src.shape[1], out.shape[1]
  if (
    (ss < 1).any()
    or (ts < 1).any()
    or (so < 0).any()
    or (to < 0).any()
    or (lo < 0).any()
    or (ss > width_in).any()
    or (ts > width_out).any()
    or (so > width_in - ss).any()
    or (to > width_out - ts).any()
    or ((hi - 1) // ss >= src.shape[0]).any()
    or ((hi - lo - 1) // ts >= out.shape[0]).any()
  ):
    raise ValueError("block copy: a block lies outside the source or target rows")
  status = _library.copy(
    src.ctypes.data,
    src.strides[0],
    out.ctypes.data,
    out.strides[0],
    size,
    len(so),
    *(c.ctypes.data for c in (so, ss, to, ts, lo, hi)),
  )
  if status:
    raise ValueError(f"block copy: elements of {size} bytes cannot be copied")


def any_nonzero_runs(flat: np.ndarray, start: np.ndarray, length: np.ndarray) -> bool:
  """Whether any bit is set in the runs ``flat[start[j] : start[j] + length[j]]``.

  Args:
    flat: 1-D, contiguous (any dtype: its bits are read as bytes).
    start, length: int64, contiguous, one entry per run.

  Raises:
    ValueError: arrays that do not fit these, or a run that does not lie inside
      ``flat`` (a bug of the caller's: nothing is read).
  """
  if _library is None:
    raise ValueError("the compiled block copy is not available")
  if not (
    flat.ndim == 1
    and flat.flags.c_contiguous
    and all(
      a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous and len(a) == len(start)
      for a in (start, length)
    )
  ):
    raise ValueError(
      f"nonzero runs: arrays {flat.dtype}{flat.shape}, {start.dtype}{start.shape} and"
      f" {length.dtype}{length.shape} do not fit"
    )
  found = _library.any_runs(
    flat.ctypes.data, flat.itemsize, len(flat), len(start), start.ctypes.data, length.ctypes.data
  )
  if found < 0:
    raise ValueError(f"nonzero runs: a run lies outside the {len(flat)} elements read")
  return bool(found)


def gather_tile(tile: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
  """``out[r, c] = tile[index[r * width + c]]`` for every element of ``out``, an index
  past ``tile``'s end (or negative) reading its last element.

  Args:
    tile: 1-D contiguous unsigned, at least one element and fewer than 2**31.
    index: int32, contiguous, one entry per element of ``out`` (row-major).
    out: ``(rows, width)`` unsigned of ``tile``'s dtype, each row contiguous
      (``fits``): a view of the target rows' columns the tile writes.

  Raises:
    ValueError: arrays that do not fit these (a bug of the caller's: nothing is
      written).
  """
  if _library is None:
    raise ValueError("the compiled block copy is not available")
  if not (
    tile.ndim == 1
    and tile.dtype.kind == "u"
    and tile.flags.c_contiguous
    and 1 <= len(tile) <= np.iinfo(np.int32).max
    and tile.ctypes.data % tile.itemsize == 0
    and index.dtype == np.int32
    and index.ndim == 1
    and index.flags.c_contiguous
    and out.ndim == 2
    and len(index) == out.size
    and out.dtype == tile.dtype
    and out.flags.writeable
    and (not out.size or _rows_of(out, tile.itemsize))
  ):
    raise ValueError(
      f"tile gather: arrays {tile.dtype}{tile.shape}, {index.dtype}{index.shape} and"
      f" {out.dtype}{out.shape}/{out.strides} do not fit"
    )
  if not out.size:
    return
  status = _library.gather(
    tile.ctypes.data,
    tile.itemsize,
    len(tile),
    index.ctypes.data,
    out.ctypes.data,
    out.strides[0],
    out.shape[0],
    out.shape[1],
  )
  if status:
    raise ValueError(f"tile gather: elements of {tile.itemsize} bytes cannot be gathered")


def read_words(addresses: np.ndarray) -> np.ndarray | None:
  """The 8 bytes at each address of ``addresses`` (int64, 8-byte aligned, each inside
  a live object the caller holds), as uint64; None without the library."""
  if _library is None:
    return None
  if addresses.dtype != np.int64 or addresses.ndim != 1 or not addresses.flags.c_contiguous:
    raise ValueError(f"read_words: addresses {addresses.dtype}{addresses.shape} do not fit")
  out = np.empty(len(addresses), np.uint64)
  if len(addresses):
    _library.read(len(addresses), addresses.ctypes.data, out.ctypes.data)
  return out


def first_changed_word(addresses: np.ndarray, expected: np.ndarray) -> int | None:
  """The first ``i`` whose 8 bytes at ``addresses[i]`` (int64, 8-byte aligned, each
  inside a live object the caller holds) differ from ``expected[i]`` (uint64), or
  -1 where none does; None without the library."""
  if _library is None:
    return None
  if (
    addresses.dtype != np.int64
    or expected.dtype != np.uint64
    or addresses.shape != expected.shape
    or addresses.ndim != 1
    or not (addresses.flags.c_contiguous and expected.flags.c_contiguous)
  ):
    raise ValueError(
      f"first_changed_word: {addresses.dtype}{addresses.shape} and"
      f" {expected.dtype}{expected.shape} do not fit"
    )
  if not len(addresses):
    return -1
  return int(_library.words(len(addresses), addresses.ctypes.data, expected.ctypes.data))


def check_chunks(extend: int, n: int, at: int, addr: int, length: int, expected: int) -> int:
  """The first of ``n`` chunks whose crc32c is not its expected one, or -1: the C
  function with the interpreter's lock released (``chunkcrc.Checker`` makes and
  checks the tables, whose addresses these are; ``extend``: a C ``crc32c_extend``)."""
  if _library is None:
    raise ValueError("the compiled block copy is not available")
  return int(_library.check(extend, n, at, addr, length, expected))


def reads_spans() -> bool:
  """Whether ``read_spans`` is there: the library was loaded on Linux."""
  return _library is not None and _library.read_spans is not None


def read_spans(
  fd: int, extend: int, n: int, tables: Sequence[int], iov_max: int
) -> tuple[int, ...]:
  """Reads ``n`` spans of file ``fd`` and checks their chunks in one C call, with the
  interpreter's lock released, stopping at the first span that fails.

  ``tables``: the addresses of the iovecs, of each span's first iovec, file
  offset, first chunk and chunk count, and of the chunk tables
  ``check_chunks`` takes (``runread`` makes and checks them all). Returns
  ``(span, what, detail, reads)``: span -1 where all were read and checked,
  else the failing span and what failed (1: the file ended, 2: a read error
  whose errno is ``detail``, 3: chunk ``detail`` of the tables differs);
  ``reads``: the system calls made.
  """
  if _library is None or _library.read_spans is None:
    raise ValueError("the compiled span reader is not available")
  result = np.zeros(2, np.int64)
  reads = np.zeros(1, np.int64)
  span = _library.read_spans(fd, extend, n, *tables, iov_max, result.ctypes.data, reads.ctypes.data)
  return int(span), int(result[0]), int(result[1]), int(reads[0])


def fits(src: np.ndarray, out: np.ndarray) -> bool:
  """Whether ``copy_blocks`` takes these arrays: rows of one unsigned dtype, ``out``
  writable, each array's first element and row stride whole elements (the C code
  reads and writes elements of their width, at addresses aligned to it)."""
  size = src.itemsize
  return (
    _rows_of(src, size) and _rows_of(out, size) and out.flags.writeable and out.dtype == src.dtype
  )


def _rows_of(a: np.ndarray, size: int) -> bool:
  """Whether ``a`` is 2-D unsigned, each row's elements ``size`` bytes apart and the
  rows apart by at least a row, forwards, by whole elements from an address aligned
  to ``size``."""
  return (
    a.ndim == 2
    and a.dtype.kind == "u"
    and a.itemsize == size
    and (a.shape[1] < 2 or a.strides[1] == size)
    and (a.shape[0] < 2 or a.strides[0] >= a.shape[1] * size)
    and a.strides[0] % size == 0
    and a.ctypes.data % size == 0
  )

"""Checking the chunks of a span against their recorded crc32c, in C where it can.

A chunk's crc32c is computed over its pieces (the stretches of it that lie back
to back in one buffer) one after the other, one chunk at a time, and compared
with the checksum the archive's metadata recorded for it. The google_crc32c
package's C library has the crc32c itself (``crc32c_extend``); where it and the
package's compiled ``_blockcopy`` are both loaded, one C call checks every chunk
of a span with the interpreter's lock released (ctypes releases it), so two
threads check two spans at once. Elsewhere the same pieces go through
``google_crc32c.extend`` one call each: the same checksums, the same verdicts.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import google_crc32c
import numpy as np

from jaxreshard._src.checkpoint import iovread as _iovread
from jaxreshard._src.exec import native as _native

__all__ = ["Checker", "native"]


def _extend_address() -> int | None:
  """The address of ``crc32c_extend`` in the C library google_crc32c's extension
  uses, or None: the package has no compiled extension, or the function found
  does not give google_crc32c's own checksum of a probe."""
  try:
    from google_crc32c import _crc32c

    fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
  except (ImportError, OSError, AttributeError):
    return None
  fn.restype = ctypes.c_uint32
  fn.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t]
  probe = bytes(range(256)) * 3 + b"123456789"
  if fn(7, probe, len(probe)) != google_crc32c.extend(7, probe):
    return None
  return ctypes.cast(fn, ctypes.c_void_p).value


_EXTEND = _extend_address() if _native.available() else None


def extend_address() -> int | None:
  """The address of the C ``crc32c_extend`` the checks call, or None."""
  return _EXTEND


# Whether chunks are checked in C; tests turn it off to compare both ways.
native = _EXTEND is not None


class Checker:
  """The chunks of one read, each the pieces ``[at[j], at[j + 1])`` of ``bufs``.

  Args:
    bufs: C-contiguous 1-D uint8 arrays, which must outlive this object and not
      move (their addresses are kept).
    mem, addr, length: each piece's buffer, first byte in it and bytes, in the
      order the crc32c runs over them.
    at: ``len(expected) + 1`` offsets into the pieces: chunk ``j``'s pieces.
    expected: each chunk's recorded crc32c.
  """

  def __init__(self, bufs: Sequence[np.ndarray], mem, addr, length, at, expected):
    self.bufs = bufs = tuple(bufs)
    # Contiguous copies: the C function reads them through their addresses.
    mem, addr, length, at = (np.ascontiguousarray(x, np.int64) for x in (mem, addr, length, at))
    self.expected = np.ascontiguousarray(expected, np.int64)
    if len(self.expected) and not (
      (self.expected >= 0).all() and (self.expected <= 0xFFFFFFFF).all()
    ):
      raise AssertionError("a recorded crc32c is no 32-bit value")  # a planning bug, never data
    _iovread.check_inside(bufs, mem, addr, length)
    if not (
      len(at) == len(self.expected) + 1
      and (not len(at) or (at[0] == 0 and at[-1] == len(mem)))
      and (np.diff(at) >= 0).all()
    ):
      raise AssertionError("chunks split the pieces in order")  # a planning bug
    self.in_c = native and all(b.flags.c_contiguous for b in bufs)
    if self.in_c:
      base = np.array([b.ctypes.data for b in bufs], np.uint64)
      self._addr = base[mem] + addr.astype(np.uint64)
      self._length, self._at = length, at
      self._crc = self.expected.astype(np.uint32)
      self._ptrs = tuple(x.ctypes.data for x in (self._at, self._addr, self._length, self._crc))
    else:
      self._pieces = (mem.tolist(), addr.tolist(), length.tolist())
      self._at_list, self._expected_list = at.tolist(), self.expected.tolist()

  @property
  def pointers(self) -> tuple[int, int, int, int]:
    """The addresses of the C tables (``at``, piece addresses, lengths, crc32c's):
    only where ``in_c``."""
    return self._ptrs

  def first_bad(self, k: int, n: int) -> int | None:
    """The first of chunks ``[k, k + n)`` whose crc32c is not the recorded one, or None."""
    if not 0 <= k <= k + n <= len(self.expected):
      raise AssertionError(f"chunks [{k}, {k + n}) of {len(self.expected)}")  # a planning bug
    if not n:
      return None
    if self.in_c:
      at, addr, length, crc = self._ptrs
      bad = _native.check_chunks(_EXTEND, n, at + 8 * k, addr, length, crc + 4 * k)
      return None if bad < 0 else k + int(bad)
    extend, bufs = google_crc32c.extend, self.bufs
    g_mem, g_addr, g_len = self._pieces
    at, expected = self._at_list, self._expected_list
    for j in range(k, k + n):
      crc = 0
      for g in range(at[j], at[j + 1]):
        crc = extend(crc, bufs[g_mem[g]][g_addr[g] : g_addr[g] + g_len[g]])
      if crc != expected[j]:
        return j
    return None

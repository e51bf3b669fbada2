"""Scattered reads of a file into pieces of a few buffers, the iovecs built by numpy.

A span of chunks is read with one ``preadv`` whose iovecs alternate between a
chunk's bytes (into the target buffer) and its 4-byte checksum (elsewhere):
two iovecs per chunk. Building them as Python memoryviews costs more than the
kernel's copy of a small chunk, so where the C library's ``preadv`` is
reachable the iovec array (``struct iovec {void *base; size_t len;}``) is one
numpy array of addresses and lengths, each piece checked to lie inside its
buffer before any read. Elsewhere ``os.preadv`` reads the same pieces.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence

import numpy as np

from jaxreshard._src.checkpoint.shardfile import _IOV_MAX
from jaxreshard._src.errors import ArchiveError
from jaxreshard._src.exec import libc as _libc

__all__ = ["Pieces", "check_inside"]


_PREADV = _libc.function(
  "preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t
)


def _int64(x) -> np.ndarray:
  """``x`` as a 1-D int64 array: integers only, each one an int64 (no cast wraps)."""
  a = np.asarray(x)
  if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
    raise AssertionError("pieces are 1-D arrays of integers")  # a planning bug, never data
  if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
    raise AssertionError("a piece lies outside its buffer")
  return a.astype(np.int64, copy=False)


def check_inside(bufs: Sequence[np.ndarray], mem, addr, n_bytes) -> None:
  """Every piece ``[addr, addr + n_bytes)`` (int64 arrays) lies inside its buffer
  ``bufs[mem]``, or an AssertionError (a planning bug, never data): what is
  checked before any address of a piece is formed."""
  sizes = np.array([b.nbytes for b in bufs], np.int64)
  # ``addr + n_bytes <= size`` written so that no sum can wrap around int64.
  if len(mem) and not (
    (mem >= 0).all()
    and (mem < len(bufs)).all()
    and (addr >= 0).all()
    and (n_bytes >= 0).all()
    and (addr <= sizes[mem] - n_bytes).all()  # indexed once every mem is a buffer
  ):
    raise AssertionError("a piece lies outside its buffer")


class Pieces:
  """Pieces ``[addr, addr + n_bytes)`` of buffers ``bufs[mem]``, in file order.

  ``bufs``: C-contiguous uint8 arrays, which must outlive this object.
  """

  def __init__(self, bufs: Sequence[np.ndarray], mem, addr, n_bytes):
    # A tuple: the caller cannot drop a buffer whose address is in an iovec.
    self.bufs = bufs = tuple(bufs)
    mem, addr, n_bytes = (_int64(x) for x in (mem, addr, n_bytes))
    self.mem, self.addr, self.n_bytes = mem, addr, n_bytes
    if not all(b.ndim == 1 and b.dtype == np.uint8 for b in bufs):
      raise AssertionError("pieces lie in 1-D uint8 buffers")  # a planning bug, never data
    if not len(mem) == len(addr) == len(n_bytes):  # never broadcast: one entry per iovec
      raise AssertionError("pieces have one buffer, offset and length each")
    check_inside(bufs, mem, addr, n_bytes)
    self.iov = None
    # Raw addresses only into buffers numpy would let ``os.preadv`` write to.
    if _PREADV is not None and all(b.flags.c_contiguous and b.flags.writeable for b in bufs):
      base = np.array([b.ctypes.data for b in bufs], np.uint64)
      self.iov = np.empty((len(mem), 2), np.uint64)
      self.iov[:, 0] = base[mem] + addr.astype(np.uint64)
      self.iov[:, 1] = n_bytes
      self._ptr = self.iov.ctypes.data

  def views(self, a: int, b: int) -> list[memoryview]:
    """Pieces ``[a, b)`` as memoryviews."""
    views = [memoryview(x) for x in self.bufs]
    return [
      views[m][p : p + n]
      for m, p, n in zip(
        self.mem[a:b].tolist(), self.addr[a:b].tolist(), self.n_bytes[a:b].tolist()
      )
    ]

  def read(self, fd: int, path: str, a: int, b: int, pos: int, total: int) -> int:
    """Reads pieces ``[a, b)`` (``total`` bytes) from file offset ``pos`` of the file
    at ``path`` (what errors name); returns the system calls made. A short read is
    the file truncated while read."""
    if not 0 <= a <= b <= len(self.mem):
      # An iovec past the array would hand the kernel addresses no check has seen.
      raise AssertionError(f"pieces [{a}, {b}) of {len(self.mem)}")  # a planning bug
    reads = 0
    for i in range(a, b, _IOV_MAX):
      j = min(b, i + _IOV_MAX)
      want = total if b - a <= _IOV_MAX else int(self.n_bytes[i:j].sum())
      if self.iov is None:
        try:
          got = os.preadv(fd, self.views(i, j), pos)
        except OSError as e:
          raise OSError(e.errno, e.strerror, path) from None
      else:
        got = self._preadv(fd, path, i, j, pos)
      if got != want:
        raise ArchiveError(f"{path} ended early (truncated while read)")
      pos, reads = pos + want, reads + 1
    return reads

  def _preadv(self, fd: int, path: str, i: int, j: int, pos: int) -> int:
    while True:
      got = _PREADV(fd, self._ptr + 16 * i, j - i, pos)
      if got >= 0:
        return got
      err = ctypes.get_errno()
      if err != errno.EINTR:
        raise OSError(err, os.strerror(err), path)

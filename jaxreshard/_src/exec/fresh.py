"""Fresh output buffers whose pages are mapped in by one system call.

A fresh buffer of many pages is mapped lazily: each page's first write (the
kernel's copy of a read, a numpy copy) stops for a page fault, ~1 us per 4 KiB
page where the kernel gives no huge pages, which is as much as the copy itself.
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 on) maps every page of a range in
one call, for about a third of that. It maps pages and writes no byte, so a
buffer of zeros stays zeros. It is only a hint: where the call is missing or
fails, the pages are mapped by their first writes, as without it.

A read of a target rank fills its buffers on one thread, so they are mapped
first. The host executor's outputs are not: its copies fault their pages on
two threads at once, which one thread mapping them all first does not beat.
"""

from __future__ import annotations

import ctypes
import errno
import mmap

import numpy as np

from jaxreshard._src.exec import libc as _libc

__all__ = ["zeros"]

_MADV_POPULATE_WRITE = 23
# Smaller buffers come from the heap, mostly pages already mapped: nothing to gain.
_MIN_BYTES = 1 << 20
_MADVISE = _libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def populate(a: np.ndarray) -> np.ndarray:
  """``a`` with every page it spans mapped in (``a`` must own writable memory)."""
  global _MADVISE
  madvise = _MADVISE
  if madvise is None or a.nbytes < _MIN_BYTES or not (a.flags.writeable and a.flags.c_contiguous):
    return a
  start = a.ctypes.data & ~(mmap.PAGESIZE - 1)
  if madvise(start, a.ctypes.data + a.nbytes - start, _MADV_POPULATE_WRITE) != 0:
    if ctypes.get_errno() == errno.EINVAL:  # a kernel without it: never asked again
      _MADVISE = None
  return a


def zeros(n: int, dtype) -> np.ndarray:
  """``np.zeros(n, dtype)``, its pages mapped in when it is large."""
  return populate(np.zeros(n, dtype))

"""Fresh output buffers whose pages are mapped in by one system call.

A fresh buffer of many pages is mapped lazily: each page's first write (the
kernel's copy of a read, a numpy copy) stops for a page fault, ~1 us per 4 KiB
page where the kernel gives no huge pages, which is as much as the copy itself.
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 on) maps every page of a range in
one call, for about a third of that. It maps pages and writes no byte, so a
buffer of zeros stays zeros. It is only a hint: where the call is missing or
fails, the pages are mapped by their first writes, as without it.

A read of a target rank's buffers (the data read into them on one or two
threads) has them mapped first, where that helps: where the kernel gives a
process transparent huge pages (``always``, or ``madvise`` and numpy asks for
them, as it does for large arrays), a first write maps 2 MiB at a time and
costs less than the call (measured here: a 42 MiB buffer read into 9.8 ms
unmapped against 11.3 ms mapped first), so nothing is done. The host
executor's outputs are never mapped first: its copies fault their pages on two
threads at once, which one thread mapping them all first does not beat.
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


def _huge_pages() -> bool:
  """Whether a large numpy array's pages come as transparent huge pages to this process."""
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      mode = f.read()
  except OSError:
    return False
  prctl = _libc.function("prctl", [ctypes.c_int] + [ctypes.c_ulong] * 4, ctypes.c_int)
  if prctl is None or prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) != 0:
    return False  # huge pages turned off for this process (or it cannot tell)
  if "[always]" in mode:
    return True
  try:
    asks = bool(np._core.multiarray._get_madvise_hugepage())  # noqa: SLF001
  except AttributeError:
    asks = False
  return "[madvise]" in mode and asks


_PR_GET_THP_DISABLE = 42
# Whether buffers are mapped in before a read fills them (not where huge pages come):
# decided at the first call, None until then.
MAP_FIRST: bool | None = None


def populate(a: np.ndarray) -> np.ndarray:
  """``a`` with every page it spans mapped in (``a`` must own writable memory), where
  ``MAP_FIRST``."""
  global _MADVISE, MAP_FIRST
  if MAP_FIRST is None:
    MAP_FIRST = not _huge_pages()
  madvise = _MADVISE
  if (
    not MAP_FIRST
    or madvise is None
    or a.nbytes < _MIN_BYTES
    or not (a.flags.writeable and a.flags.c_contiguous)
  ):
    return a
  start = a.ctypes.data & ~(mmap.PAGESIZE - 1)
  if madvise(start, a.ctypes.data + a.nbytes - start, _MADV_POPULATE_WRITE) != 0:
    if ctypes.get_errno() == errno.EINVAL:  # a kernel without it: never asked again
      _MADVISE = None
  return a


def zeros(n: int, dtype) -> np.ndarray:
  """``np.zeros(n, dtype)``, its pages mapped in when it is large."""
  return populate(np.zeros(n, dtype))

"""Spans of a shard file read and checked in C, a batch of them in one call.

``runread`` reads a file's spans one after another; each is one ``preadv`` of
its pieces (``iovread.Pieces``) and one check of its chunks against their
recorded crc32c (``chunkcrc.Checker``). Where spans are many and short (a rank
of a large world reads a few hundred bytes of each of thousands of params),
the Python around each span cost more than its system call. Where the
compiled library, the C library's ``preadv`` and the C checks are all there, a
batch of spans is read and checked by one C call (``native.read_spans``) over
the very iovecs and chunk tables the span-by-span path uses: the same system
calls, the same checks, the same refusal of the first span that fails.
"""

from __future__ import annotations

import os

import numpy as np

from jaxreshard._src.checkpoint import chunkcrc as _chunkcrc
from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.checkpoint.shardfile import _IOV_MAX
from jaxreshard._src.errors import ArchiveError
from jaxreshard._src.exec import native as _native

__all__ = ["SpanBatches"]


class SpanBatches:
  """Spans read and checked in one C call each batch (``native.read_spans``): the
  same system calls and checks as ``Pieces.read`` and ``Checker.first_bad`` one
  span at a time, and the same refusal of the first span that fails."""

  def __init__(self, pieces, checker, tables):
    self._keep = (pieces, checker, tables)  # every address below lies in these
    self._iov = pieces.iov.ctypes.data
    self._tables = [t.ctypes.data for t in tables]
    self._checks = checker.pointers

  @classmethod
  def make(
    cls, pieces, checker, span_seg, span_file, span_at, span_n, n_chunks
  ) -> SpanBatches | None:
    """Where the C reader, iovecs and C checks are all there, else None."""
    if not (_native.reads_spans() and pieces.iov is not None and checker.in_c):
      return None
    tables = tuple(
      np.ascontiguousarray(t, np.int64) for t in (span_seg, span_file, span_at, span_n)
    )
    seg, _, first, count = tables
    # What ``Pieces.read`` and ``Checker.first_bad`` check of each span's range.
    if not (
      len(seg) == len(first) + 1
      and (not len(seg) or (seg[0] >= 0 and seg[-1] <= len(pieces.mem)))
      and (np.diff(seg) >= 0).all()
      and (first >= 0).all()
      and (count >= 0).all()
      and (count <= n_chunks - first).all()
    ):
      raise AssertionError("spans lie outside their pieces or chunks")  # a planning bug
    return cls(pieces, checker, tables)

  def read(self, f: _shardread.ShardFile, s: int, e: int, needed: np.ndarray) -> int:
    """Reads and checks spans ``[s, e)``; the system calls made."""
    seg, pos, first, count = (t + 8 * s for t in self._tables)
    span, what, detail, reads = _native.read_spans(
      f.fd,
      _chunkcrc.extend_address(),
      e - s,
      (self._iov, seg, pos, first, count, *self._checks),
      _IOV_MAX,
    )
    if span >= 0:
      where = f"{f.path}/c/0"
      if what == 1:
        raise ArchiveError(f"{where} ended early (truncated while read)")
      if what == 2:
        raise OSError(detail, os.strerror(detail), where)
      raise f.bad_chunk(int(needed[detail]))
    return reads

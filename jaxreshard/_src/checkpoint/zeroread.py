"""Reading ranges that must be zero bits in many shard files, planned once for all.

A target rank of a world much smaller than its sources' (4,096 -> 6) checks
the padding of the hundreds of all-padding source ranks that fall to it: a few
small ranges in each file, with nothing to copy. Read one file at a time
(``runread.read_runs``), each file costs some sixty numpy steps of planning on
arrays of a few entries. Here the files' ranges are planned together with
array operations: the chunks each range touches, the spans of consecutive
chunks (the same spans ``read_runs`` reads), and where each range lies in the
scratch once read. Each span is then read whole with one call and its chunks
checked, and the ranges of every span in the scratch are checked together by
one gather.

The checks and their order are those of one ``read_runs`` per file, in turn:
in each span, every chunk's crc32c against the recorded one, then the
checksums stored in the file, then the span's zero ranges, before the next
span is read. A check of a later span that fails first checks the zero ranges
of the spans read before it, so the refusal named is always the one a read
file by file would name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import google_crc32c
import numpy as np

from jaxreshard._src.checkpoint import runread as _runread
from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.errors import ArchiveError

__all__ = ["ZeroReads"]

# The files one ``ZeroReads`` holds before reading them: each stays open until read
# (beside the files a restore holds open for its runs).
MAX_FILES = 16


class _File:
  """One file's ranges: ``src``, ``length`` (elements, disjoint, each > 0), ``ids``
  (the index of each among the ranges the caller gave) and ``refuse(id, position)``."""

  __slots__ = ("f", "src", "length", "ids", "refuse")

  def __init__(self, f, src, length, ids, refuse):
    self.f, self.src, self.length, self.ids, self.refuse = f, src, length, ids, refuse


class ZeroReads:
  """Ranges of several files that must be zero bits, read and checked as one
  ``read_runs(f, [], [], [], None, scratch, stats, zero, refuse)`` per file, in the
  order the files were added, would read and check them.

  The caller adds files (``add``) and calls ``run`` when ``full`` and at the end;
  a file stays open until ``run`` returns. Where the caller refuses a file before
  adding it, it calls ``run`` first: the files before it are checked first, as
  one by one.

  Args:
    scratch: the caller's uint8 buffer. A file read on its own (ranges that
      overlap) gets it as ``read_runs`` would, grown to one chunk; the files read
      together use up to about one span's bytes of it (a fill), a larger buffer
      where it is smaller.
    stats: counts the spans read and their chunks and bytes.
  """

  def __init__(self, scratch: np.ndarray, stats: _shardread.ReadStats | None = None):
    self.given, self.stats = scratch, stats
    self.scratch = scratch  # what the files read together use, grown as needed
    self._files: list[_File] = []

  @property
  def full(self) -> bool:
    return len(self._files) >= MAX_FILES

  def add(
    self, f: _shardread.ShardFile, z_src, z_len, refuse: Callable[[int, int], Exception]
  ) -> None:
    """Ranges ``[z_src[i], z_src[i] + z_len[i])`` of ``f`` must be zero bits;
    ``refuse(i, position)`` makes the error for range ``i``."""
    z_src, z_len = np.asarray(z_src, np.int64), np.asarray(z_len, np.int64)
    inside = not f.size or ((z_src >= 0) & (z_len <= f.size - z_src)).all()
    keep = np.flatnonzero(z_len > 0)
    if inside and not len(keep):
      return  # nothing to read
    # Disjoint as ``read_runs`` tells it: empty ranges included.
    order = np.argsort(z_src, kind="stable")
    disjoint = bool(np.all((z_src + z_len)[order[:-1]] <= z_src[order[1:]]))
    if not (inside and disjoint):
      # Refused (a range outside the file), or read through the scratch one chunk
      # span at a time (ranges that overlap): on its own, after the files before it.
      self.run()
      scratch = _runread.staging(self.given, f.stride, f)
      _runread.read_runs(f, [], [], [], None, scratch, self.stats, (z_src, z_len), refuse)
      return
    self._files.append(_File(f, z_src[keep], z_len[keep], keep, refuse))

  def check(self, items: Iterable[Any], prepare: Callable[[Any], tuple | None]) -> None:
    """Reads and checks the files of ``items`` in turn. ``prepare(item)`` makes the
    caller's own checks of an item and returns ``(f, opened, z_src, z_len, refuse)``
    (``opened``: ``f`` was opened for this read, closed once read) or None (nothing
    to read); a refusal it raises comes after every file before it is checked."""
    opened: list[_shardread.ShardFile] = []
    try:
      for item in items:
        try:
          got = prepare(item)
        except BaseException:
          self.run()  # the files before this one are checked first, as one by one
          raise
        if got is None:
          continue
        f, mine, z_src, z_len, refuse = got
        if mine:
          opened.append(f)
        self.add(f, z_src, z_len, refuse)
        if self.full:
          self.run()
          _close(opened)
      self.run()
    finally:
      _close(opened)

  def run(self) -> None:
    """Reads and checks every file added since the last ``run``."""
    files, self._files = self._files, []
    if files:
      _Batch(files, self).read()


class _Batch:
  """The spans of some files, planned together, read and checked in order."""

  def __init__(self, files: list[_File], owner: ZeroReads):
    self.files, self.owner = files, owner
    fs = [x.f for x in files]
    counts = np.array([len(x.src) for x in files], np.int64)
    fid = np.repeat(np.arange(len(files), dtype=np.int64), counts)
    self.file_start = np.cumsum(counts) - counts  # each file's first range
    self.chunk = chunk = np.array([f.chunk for f in fs], np.int64)
    self.isz = np.array([f.dtype.itemsize for f in fs], np.int64)
    self.stride = np.array([f.stride for f in fs], np.int64)
    # Every range cut at its file's chunk boundaries, in range order.
    run, ch, within, _, n = _copyplan.cut_runs(
      np.concatenate([x.src for x in files]), np.concatenate([x.length for x in files]), chunk[fid]
    )
    pf = fid[run]
    # Chunks as one key each, files apart by a gap (so never consecutive): each
    # file's pieces in chunk order, stable (the order ``read_runs`` checks them).
    gap = int(max(f.n for f in fs)) + 2
    key = pf * gap + ch
    order = np.argsort(key, kind="stable")
    self.key, self.pf, self.run = key[order], pf[order], run[order]
    self.lo = (ch * chunk[pf] + within)[order]  # each piece's first element in its file
    self.n = n[order]
    self.needed = _copyplan.unique_ints(self.key)
    need_file = self.needed // gap
    per_span = np.maximum(1, _runread.SPAN_BYTES // self.stride)  # chunks, per file
    self.per_span_bytes = per_span * self.stride
    span_at = np.flatnonzero(_runread.span_starts(self.needed, per_span[need_file]))
    self.span_file = need_file[span_at]
    self.span_first = self.needed[span_at] - self.span_file * gap  # a chunk of its file
    self.span_n = np.diff(np.append(span_at, len(self.needed)))
    self.span_bytes = self.span_n * self.stride[self.span_file]
    # The pieces of each span: consecutive, from ``piece_at[s]``.
    span_of_key = np.searchsorted(self.needed[span_at], self.key, side="right") - 1
    self.piece_at = np.searchsorted(span_of_key, np.arange(len(span_at) + 1))
    self.span_of_piece = span_of_key
    self.gap = gap

  def read(self) -> None:
    owner = self.owner
    scratch = owner.scratch
    # Spans are placed in fills of about one span's bytes, as a file read on its own
    # has them (which bounds the gather's index); a smaller scratch grows when the
    # first span that does not fit is read (its pending bytes kept), in order.
    capacity = int(self.per_span_bytes.max())
    offsets, last = _runread.fills(self.span_bytes, capacity)
    self.offsets = offsets
    mem = memoryview(scratch)
    extend = google_crc32c.extend
    fill_first = 0
    spans = zip(
      self.span_file.tolist(),
      self.span_first.tolist(),
      self.span_n.tolist(),
      offsets.tolist(),
      last.tolist(),
    )
    for s, (i, first, n, at, last_of_fill) in enumerate(spans):
      f = self.files[i].f
      stride, cb = f.stride, f.chunk_bytes
      try:
        if at + n * stride > len(scratch):
          grown = _runread.staging(scratch, capacity, f)
          grown[: len(scratch)] = scratch
          scratch = owner.scratch = grown
          mem = memoryview(scratch)
        _read_into(f, mem[at : at + n * stride], first * stride)
        crcs = f.crcs
        for j in range(n):
          p = at + j * stride
          if extend(0, scratch[p : p + cb]) != crcs[first + j]:
            raise f.bad_chunk(first + j)
        for j in range(n):
          p = at + j * stride + cb
          if int.from_bytes(mem[p : p + 4], "little") != crcs[first + j]:
            raise f.bad_chunk(first + j)
      except BaseException:
        self._check_zero(scratch, fill_first, s)  # the spans read before it come first
        raise
      if owner.stats is not None:
        owner.stats.reads += 1
        owner.stats.chunks += n
        owner.stats.bytes += n * stride
      if last_of_fill:
        self._check_zero(scratch, fill_first, s + 1)
        fill_first = s + 1

  def _check_zero(self, scratch: np.ndarray, a: int, b: int) -> None:
    """The zero ranges of spans ``[a, b)``, all in the scratch: one gather; the first
    nonzero byte, in the order the pieces are checked, names the refusal."""
    p, q = int(self.piece_at[a]), int(self.piece_at[b])
    if p == q:
      return
    span = self.span_of_piece[p:q]
    pf, key, lo, n = self.pf[p:q], self.key[p:q], self.lo[p:q], self.n[p:q]
    isz, stride = self.isz[pf], self.stride[pf]
    ch = key - pf * self.gap
    at = (
      self.offsets[span] + (ch - self.span_first[span]) * stride + (lo - ch * self.chunk[pf]) * isz
    )
    size = n * isz
    ends = np.cumsum(size)
    index = np.repeat(at - (ends - size), size) + np.arange(int(ends[-1]), dtype=np.int64)
    nz = np.flatnonzero(scratch[index])
    if nz.size:
      j = int(nz[0])
      k = int(np.searchsorted(ends, j, side="right"))
      x = self.files[int(pf[k])]
      r = int(self.run[p + k]) - int(self.file_start[int(pf[k])])  # the range in its file
      raise x.refuse(int(x.ids[r]), int(lo[k]) + (j - int(ends[k] - size[k])) // int(isz[k]))


def _read_into(f: _shardread.ShardFile, into: memoryview, pos: int) -> None:
  """Reads ``len(into)`` bytes of ``f`` from ``pos``; a short read is the file truncated."""
  try:
    got = os.preadv(f.fd, [into], pos)
  except OSError as e:
    raise OSError(e.errno, e.strerror, f.path) from None
  if got != len(into):
    raise ArchiveError(f"{f.path}/c/0 ended early (truncated while read)")


def _close(files: list) -> None:
  """Closes and forgets every file of ``files``."""
  while files:
    files.pop().close()

"""Copying runs of one shard file into a target buffer, every chunk read whole and checked.

A chunk's crc32c covers all of it, so every chunk a run touches is read whole,
in spans of consecutive chunks. The bytes a run copies are read straight into
the target buffer; the rest of each span (the parts of edge chunks no run
copies, the checksums, the padding to check) into a small reused scratch
buffer. Each chunk's crc32c is then computed over its pieces while they are
still in cache, and compared with the checksum stored after it and with the
one the archive's metadata recorded; a span that fails is refused before the
next is read, and the caller drops the target buffer.

Runs that overlap each other in the file, or a target buffer that is not one
contiguous array, go through the scratch buffer and are copied from there
(``read_runs_staged``): same reads, same checks, one more copy.
"""

from __future__ import annotations

import os

import google_crc32c
import numpy as np

from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.checkpoint.shardfile import _IOV_MAX, _crc
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.errors import ArchiveError, ReshardError
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["SPAN_BYTES", "read_runs", "read_runs_staged", "staging"]

# Bytes read per span: small enough that a span's chunks are still in cache when
# their crc32c is computed.
SPAN_BYTES = 1 << 20
_COPY, _DATA, _CRC = 0, 1, 2  # a span's pieces: into the target, scratch data, checksum


def staging(scratch: np.ndarray, nbytes: int, f: _shardread.ShardFile) -> np.ndarray:
  """``scratch``, or a larger one of ``nbytes``: a chunk (its size is the checkpoint's
  word) larger than the process can get is a ReshardError, never a MemoryError."""
  if len(scratch) >= nbytes:
    return scratch
  try:
    return np.empty(nbytes, np.uint8)
  except MemoryError:
    raise ReshardError(
      f"{f.path}: reading a chunk of {f.chunk_bytes} bytes needs a buffer of {nbytes} bytes,"
      " more memory than this process can get"
    ) from None


def _pieces(f: _shardread.ShardFile, src, length) -> tuple[np.ndarray, ...]:
  """Every range ``[src, src + length)`` cut at chunk boundaries (``copyplan.cut_runs``).

  Returns ``(range, chunk, lo, hi)`` per piece: elements ``[lo, hi)`` of range
  ``range``, all inside chunk ``chunk``; an empty range has no piece.
  """
  run, chunk, offset, _, n = _copyplan.cut_runs(src, length, f.chunk)
  lo = chunk * f.chunk + offset
  return run, chunk, lo, lo + n


def read_runs(
  f: _shardread.ShardFile,
  src,
  dst,
  length,
  out,
  scratch,
  stats: _shardread.ReadStats | None = None,
  zero=None,
  refuse=None,
) -> None:
  """Copies runs ``src -> dst`` (elements) of ``f`` into ``out``, each chunk read once.

  ``zero``: ``(starts, lengths)`` of ranges of ``f`` that must be zero bits,
  read with the same spans; ``refuse(i, position)`` makes the error for range ``i``.
  """
  src, dst, length = (np.asarray(x, np.int64) for x in (src, dst, length))
  keep = length > 0
  src, dst, length = src[keep], dst[keep], length[keep]
  n_copy = len(src)
  z_src = z_len = np.zeros(0, np.int64)
  if zero is not None and len(zero[0]):
    z_src, z_len = np.asarray(zero[0], np.int64), np.asarray(zero[1], np.int64)
  all_src, all_len = np.concatenate([src, z_src]), np.concatenate([length, z_len])
  if f.size and (
    int((all_src + all_len).max(initial=0)) > f.size or int(all_src.min(initial=0)) < 0
  ):
    raise ArchiveError(f"{f.path}: a planned read lies outside its {f.size} elements")
  if not (n_copy or (z_len > 0).any()):
    return  # nothing to copy or check (empty ranges read no chunk)
  order = np.argsort(all_src, kind="stable")
  disjoint = bool(np.all((all_src + all_len)[order[:-1]] <= all_src[order[1:]]))
  contiguous = n_copy == 0 or (isinstance(out, np.ndarray) and out.flags.c_contiguous)
  if not (disjoint and contiguous):
    z = (z_src, z_len) if len(z_src) else None
    return read_runs_staged(f, src, dst, length, out, scratch, stats, zero=z, refuse=refuse)
  keep_zero = z_len > 0
  _Spans(f, out, scratch, stats, refuse).read(
    src, dst, length, z_src[keep_zero], z_len[keep_zero], np.flatnonzero(keep_zero)
  )


class _Spans:
  """One direct read of runs: the pieces of every span, then each span read and checked."""

  def __init__(self, f, out, scratch, stats, refuse):
    self.f, self.stats, self.refuse = f, stats, refuse
    self.outb = None if out is None else out.reshape(-1).view(np.uint8)
    per_span = max(1, SPAN_BYTES // f.stride)
    self.per_span = per_span
    self.scratch = staging(scratch, per_span * f.stride, f)

  def read(self, src, dst, length, z_src, z_len, z_ids) -> None:
    f = self.f
    isz, c, stride, cb = f.dtype.itemsize, f.chunk, f.stride, f.chunk_bytes
    run, chunk, lo, hi = _pieces(f, np.concatenate([src, z_src]), np.concatenate([length, z_len]))
    copy = run < len(src)
    starts = chunk * stride + (lo - chunk * c) * isz  # file bytes of each piece
    # Copy pieces, in file order: where they start and end, where they go in ``out``.
    cs = np.argsort(starts[copy], kind="stable")
    c_start, c_stop = starts[copy][cs], (starts + (hi - lo) * isz)[copy][cs]
    c_to = ((dst[run[copy]] + lo[copy] - src[run[copy]]) * isz)[cs]
    needed = np.unique(chunk)
    # Spans: consecutive needed chunks, at most ``per_span`` each.
    brk = np.concatenate([[True], np.diff(needed) != 1])
    group_first = needed[brk][np.cumsum(brk) - 1]
    block = (needed - group_first) // self.per_span
    new = brk | np.concatenate([[False], np.diff(block) != 0])
    span_first = needed[new]
    span_n = np.diff(np.append(np.flatnonzero(new), len(needed)))
    # Piece boundaries: chunk data starts and ends, checksum ends, copy pieces.
    bounds = np.unique(
      np.concatenate(
        [needed * stride, needed * stride + cb, (needed + 1) * stride, c_start, c_stop]
      )
    )
    seg_lo, seg_hi = bounds[:-1], bounds[1:]
    seg_chunk = seg_lo // stride
    inside = np.isin(seg_chunk, needed)
    seg_lo, seg_hi, seg_chunk = seg_lo[inside], seg_hi[inside], seg_chunk[inside]
    at = np.searchsorted(c_start, seg_lo)
    at_c = np.minimum(at, max(len(c_start) - 1, 0))
    is_copy = (at < len(c_start)) & (c_start[at_c] == seg_lo) if len(c_start) else at < 0
    kind = np.where(is_copy, _COPY, np.where(seg_lo - seg_chunk * stride < cb, _DATA, _CRC))
    where = np.where(is_copy, c_to[at_c] if len(c_start) else 0, seg_lo)
    span_seg = np.searchsorted(seg_lo, span_first * stride)
    span_seg = np.append(span_seg, len(seg_lo))
    zs = np.argsort(chunk[~copy], kind="stable")
    z = (chunk[~copy][zs], lo[~copy][zs], hi[~copy][zs], run[~copy][zs] - len(src))
    for s in range(len(span_first)):
      a, b = int(span_seg[s]), int(span_seg[s + 1])
      self._span(
        int(span_first[s]),
        int(span_n[s]),
        seg_lo[a:b].tolist(),
        seg_hi[a:b].tolist(),
        kind[a:b].tolist(),
        where[a:b].tolist(),
      )
      self._check_zero(int(span_first[s]), int(span_n[s]), z, z_ids)

  def _span(self, first: int, n: int, seg_lo, seg_hi, kind, where) -> None:
    f, scr, outb = self.f, self.scratch, self.outb
    base = first * f.stride
    bufs = []
    for lo, hi, k, w in zip(seg_lo, seg_hi, kind, where):
      if k == _COPY:
        bufs.append(outb[w : w + hi - lo])
      else:
        bufs.append(scr[lo - base : hi - base])
    pos, reads = base, 0
    for i in range(0, len(bufs), _IOV_MAX):
      part = bufs[i : i + _IOV_MAX]
      want = sum(len(x) for x in part)
      try:
        got = os.preadv(f.fd, part, pos)
      except OSError as e:
        raise OSError(e.errno, e.strerror, f.path) from None
      if got != want:
        raise ArchiveError(f"{f.path}/c/0 ended early (truncated while read)")
      pos, reads = pos + want, reads + 1
    computed, crc = [], 0
    for lo, hi, k, buf in zip(seg_lo, seg_hi, kind, bufs):
      if k == _CRC:
        continue
      off = (lo - base) % f.stride
      crc = _crc(buf) if off == 0 else google_crc32c.extend(crc, buf)
      if off + hi - lo == f.chunk_bytes:
        computed.append(crc)
    rows = scr[: n * f.stride].reshape(n, f.stride)
    stored = rows[:, f.chunk_bytes :].copy().view("<u4").reshape(-1)
    got = np.asarray(computed, np.int64)
    bad = np.flatnonzero((got != stored) | (got != f.crc_table[first : first + n]))
    if bad.size:
      raise ArchiveError(
        f"{f.path}/c/0: chunk {first + int(bad[0])} fails its crc32c check (the file is"
        " corrupted or not the one this archive's metadata describes)"
      )
    if self.stats is not None:
      self.stats.reads += reads
      self.stats.chunks += n
      self.stats.bytes += n * f.stride

  def _check_zero(self, first: int, n: int, z, z_ids) -> None:
    """The ranges that must be zero bits, in the span just read (all in scratch)."""
    chunk, lo, hi, rid = z
    f = self.f
    a, b = np.searchsorted(chunk, [first, first + n])
    if a == b:
      return
    isz, uint = f.dtype.itemsize, _bitview.UINT[f.dtype.itemsize]
    for ch, lo_, hi_, r in zip(
      chunk[a:b].tolist(), lo[a:b].tolist(), hi[a:b].tolist(), rid[a:b].tolist()
    ):
      off = (ch - first) * f.stride + (lo_ - ch * f.chunk) * isz
      nz = np.flatnonzero(self.scratch[off : off + (hi_ - lo_) * isz].view(uint))
      if nz.size:
        raise self.refuse(int(z_ids[r]), lo_ + int(nz[0]))


def read_runs_staged(
  f: _shardread.ShardFile,
  src,
  dst,
  length,
  out,
  scratch,
  stats: _shardread.ReadStats | None = None,
  zero=None,
  refuse=None,
) -> None:
  """Copies runs ``src -> dst`` of ``f`` into ``out`` through ``scratch``, each chunk span read once.

  ``zero``: ``(starts, lengths)`` of ranges of ``f`` that must be zero bits,
  read with the same spans; ``refuse(i, position)`` makes the error for range ``i``.
  """
  n_copy = len(src)
  scratch = staging(scratch, f.stride, f)
  if zero is not None and len(zero[0]):
    src = np.concatenate([src, zero[0]])
    length = np.concatenate([length, zero[1]])
    dst = np.concatenate([dst, np.zeros(len(zero[0]), np.int64)])
  if f.size and (int((src + length).max(initial=0)) > f.size or int(src.min(initial=0)) < 0):
    raise ArchiveError(f"{f.path}: a planned read lies outside its {f.size} elements")
  if not len(src):
    return
  c = f.chunk
  first, last = src // c, (src + length - 1) // c
  pieces = last - first + 1
  run = np.repeat(np.arange(len(src)), pieces)
  chunk = first[run] + (np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces))
  lo = np.maximum(src[run], chunk * c)
  hi = np.minimum(src[run] + length[run], (chunk + 1) * c)
  to = dst[run] + (lo - src[run])
  order = np.argsort(chunk, kind="stable")
  per_span = max(1, len(scratch) // f.stride)
  view = _bitview.bits(out) if n_copy else None
  data, span_first, span_n = None, -1, 0
  needed = np.unique(chunk)
  pos = 0
  for j in order.tolist():
    ch = int(chunk[j])
    if not span_first <= ch < span_first + span_n:
      # The next span: consecutive needed chunks from this one, as many as fit.
      pos = int(np.searchsorted(needed, ch))
      n = 1
      while pos + n < len(needed) and n < per_span and needed[pos + n] == ch + n:
        n += 1
      data = f.read_chunks(ch, n, scratch)
      span_first, span_n = ch, n
      if stats is not None:
        stats.reads += 1
        stats.chunks += n
        stats.bytes += n * f.stride
    row = data[ch - span_first]
    a, b, t = int(lo[j]) - ch * c, int(hi[j]) - ch * c, int(to[j])
    r = int(run[j])
    if r < n_copy:
      view[t : t + b - a] = row[a:b]
    else:
      nz = np.flatnonzero(row[a:b])
      if nz.size:
        raise refuse(r - n_copy, ch * c + a + int(nz[0]))

"""Copying runs of one shard file into a target buffer, every chunk read whole and checked.

A chunk's crc32c covers all of it, so every chunk a run touches is read whole,
in spans of consecutive chunks. The bytes a run copies are read straight into
the target buffer, the checksums stored after the chunks into one array, the
rest of each span (the parts of edge chunks no run copies, padding to check)
into a small reused scratch buffer (``iovread``). A span's bytes are then
checked while still in cache, each chunk against the checksum the archive's
metadata recorded for it, with one crc32c call per stretch of the chunk that
lies back to back in one buffer: every read path checks exactly the same
thing, so errors in two chunks can never cancel out in a combined checksum
and be accepted by one path and refused by another (``chunkcrc``: in C where
it was built). A span that fails is refused, naming its first bad chunk; where
two threads read the spans (a large read straight into the target: the even
spans on one, the odd on the other, each thread stopping at its first
failure), the failure named is that of the first failing span in file order,
the one a read span after span stops at). On one thread, spans with no range
to check for zeros are read and checked in one C call per batch (up to the end
of a fill), where the package was built with it (``spanbatch``). The checksums
stored in the file must equal the recorded ones, compared all at once after the
last span (before a span's padding is checked, for those spans). On a refusal
the caller drops the target buffer.

Where the runs are short (a few elements of each of many params, as a rank of
a large world holds), the pieces of a chunk are many and each would cost an
iovec and a crc32c call. Spans are then read whole into the scratch buffer, one
after another up to a few spans' bytes (a fill, ``FILL_SPANS``), each chunk
checked with one call, and the runs copied out of it once per fill (the compiled
block copy, one memcpy per run, where the package was built with it; else one
numpy gather of a fill of one span's bytes): the same chunks read, the same
checks, one more copy of the bytes the runs move.

Runs that overlap each other in the file, or a target buffer that is not one
contiguous array, go through the scratch buffer and are copied from there
(``read_runs_staged``): same reads, same checks, one more copy.
"""

from __future__ import annotations

import numpy as np

from jaxreshard._src.checkpoint import chunkcrc as _chunkcrc
from jaxreshard._src.checkpoint import iovread as _iovread
from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.checkpoint import spanbatch as _spanbatch
from jaxreshard._src.checkpoint import twothreads as _twothreads
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.errors import ArchiveError, ReshardError
from jaxreshard._src.exec import bitview as _bitview
from jaxreshard._src.exec import native as _native

__all__ = ["SPAN_BYTES", "fills", "read_runs", "read_runs_staged", "span_starts", "staging"]

# Bytes read per span: small enough that a span's chunks are still in cache when
# their crc32c is computed.
SPAN_BYTES = 1 << 20
_COPY, _DATA, _CRC = 0, 1, 2  # a span's pieces: into the target, scratch data, checksum
# Runs are read straight into the target unless their chunks hold more pieces than
# one each and the bytes copied are fewer than this many per extra piece: those
# are read with their chunks into the scratch and copied out by a gather, which
# costs less than an iovec and a crc32c call per piece.
GATHER_BELOW_BYTES = 1024
# A read of at least this many bytes of chunks, in two spans or more each read
# straight into the target, is read and checked on two threads: each span's
# read and its chunks' checks run with the interpreter's lock released.
PARALLEL_BYTES = 4 << 20
# Spans' bytes (``SPAN_BYTES`` each) read into the scratch, at most, before its
# pieces are copied out by the compiled block copy: each fill costs a C call to
# read and one to copy.
FILL_SPANS = 4


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


def _gathers(copy_bytes: int, pieces: int, chunks: int) -> bool:
  """Whether copy pieces are read into the scratch and gathered out of it: where the
  pieces beyond one per chunk (each an iovec and a crc32c call when read into the
  target) outnumber the bytes copied by ``GATHER_BELOW_BYTES`` per piece."""
  return copy_bytes < GATHER_BELOW_BYTES * (pieces - chunks)


def _check_inside(f: _shardread.ShardFile, src: np.ndarray, length: np.ndarray) -> None:
  """Every range ``[src, src + length)`` lies in the file's elements.

  Written without the sum ``src + length``, which could wrap around int64.
  """
  if f.size and not ((src >= 0) & (length <= f.size - src)).all():
    raise ArchiveError(f"{f.path}: a planned read lies outside its {f.size} elements")


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
  _check_inside(f, all_src, all_len)
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
    self.outb = np.zeros(0, np.uint8) if out is None else out.reshape(-1).view(np.uint8)
    per_span = max(1, SPAN_BYTES // f.stride)
    self.per_span = per_span
    self.scratch = staging(scratch, per_span * f.stride, f)
    # The copy pieces ``(file start, file stop, target byte)`` in file order, when
    # they are copied out of the scratch (``_gather``); None: read into the target.
    self.gathered: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

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
    needed = _copyplan.unique_ints(chunk)
    if len(c_start) and _gathers(int((c_stop - c_start).sum()), len(c_start), len(needed)):
      # The check ``Pieces`` makes of the iovecs it would have had: no index wraps.
      if not ((c_to >= 0) & (c_to <= self.outb.size - (c_stop - c_start))).all():
        raise AssertionError("a piece lies outside its buffer")  # a planning bug, never data
      self.gathered = (c_start, c_stop, c_to)
      c_start = c_stop = c_to = np.zeros(0, np.int64)  # every piece read into the scratch
    new = span_starts(needed, self.per_span)
    span_of = np.cumsum(new) - 1  # span of each needed chunk
    span_at = np.flatnonzero(new)
    span_file = needed[span_at] * stride  # each span's first byte in the file
    # Each span's place in the scratch: at its start, or after the spans read before it
    # since the scratch's last gather (``fills``). A fill holds up to
    # ``FILL_SPANS * SPAN_BYTES`` where the compiled block copy gathers (a table entry
    # per piece), one span's bytes for numpy's gather (index arrays a few times its
    # elements); a span of one chunk larger than that fills it alone.
    fill = 0
    if self.gathered is not None:
      fill = self.per_span * stride
      if _native.enabled:
        fill = max(fill, FILL_SPANS * SPAN_BYTES)
      self.scratch = staging(self.scratch, fill, f)
    span_off, fill_last = fills(np.diff(np.append(span_at, len(needed))) * stride, fill)
    # Spans read straight into the target are independent but for the scratch:
    # with two threads, the odd ones use a second scratch after the first.
    self.two = (
      self.gathered is None
      and len(span_at) >= 2
      and len(needed) * stride >= PARALLEL_BYTES
      and _chunkcrc.native
    )
    if self.two:
      self.scratch = staging(self.scratch, 2 * self.per_span * stride, f)
      span_off = (np.arange(len(span_at)) % 2) * (self.per_span * stride)
    # Piece boundaries: chunk data starts and ends, checksum ends, copy pieces.
    bounds = _copyplan.unique_ints(
      np.concatenate(
        [needed * stride, needed * stride + cb, (needed + 1) * stride, c_start, c_stop]
      )
    )
    seg_lo, seg_hi = bounds[:-1], bounds[1:]
    seg_need = np.searchsorted(needed, seg_lo // stride)
    inside = needed[np.minimum(seg_need, len(needed) - 1)] == seg_lo // stride
    seg_lo, seg_hi, seg_need = seg_lo[inside], seg_hi[inside], seg_need[inside]
    at = np.searchsorted(c_start, seg_lo)
    at_c = np.minimum(at, max(len(c_start) - 1, 0))
    is_copy = (at < len(c_start)) & (c_start[at_c] == seg_lo) if len(c_start) else at < 0
    seg_span = span_of[seg_need]
    off = seg_lo - needed[seg_need] * stride
    # Where each piece is read: the target, the scratch (as laid out in the file from
    # its span's first chunk, at the span's place), or its chunk's slot of the stored
    # checksums.
    mem = np.where(is_copy, _COPY, np.where(off < cb, _DATA, _CRC))
    base = (span_file - span_off)[seg_span]
    addr = np.where(is_copy, c_to[at_c] if len(c_start) else 0, seg_lo - base)
    addr = np.where(mem == _CRC, seg_need * 4, addr)
    span_seg = np.append(np.searchsorted(seg_span, np.arange(len(span_of[new]))), len(seg_lo))
    zs = np.argsort(chunk[~copy], kind="stable")
    z = (chunk[~copy][zs], lo[~copy][zs], hi[~copy][zs], run[~copy][zs] - len(src))
    self._read_spans(
      needed,
      span_at,
      (seg_lo, seg_hi, mem, addr, seg_span, span_seg),
      z,
      z_ids,
      (span_file, span_off, fill_last),
    )

  def _read_spans(self, needed, span_at, segs, z, z_ids, places) -> None:
    """Reads every span and checks each of its chunks against its recorded crc32c.

    ``places``: each span's first byte in the file, its offset in the scratch, and
    whether it is the last span read into the scratch before the copy pieces are
    gathered out of it.
    """
    f = self.f
    seg_lo, seg_hi, mem, addr, seg_span, span_seg = segs
    n_bytes = seg_hi - seg_lo
    stored = np.zeros(len(needed), "<u4")
    bufs = (self.outb, self.scratch, stored.view(np.uint8))
    pieces = _iovread.Pieces(bufs, mem, addr, n_bytes)
    groups = _crc_groups(mem, addr, n_bytes, seg_lo // f.stride)
    # Groups of one chunk are consecutive; chunk k's are ``[at[k], at[k + 1])``.
    at = np.append(np.searchsorted(groups[0], needed), len(groups[0]))
    checker = _chunkcrc.Checker(bufs, *groups[1:], at, f.crc_table[needed])
    span_first, span_n = needed[span_at].tolist(), np.diff(np.append(span_at, len(needed)))
    span_n, starts = span_n.tolist(), span_at.tolist()
    seg_at = span_seg.tolist()
    span_bytes = np.add.reduceat(n_bytes, span_seg[:-1]).tolist()
    has_zero = np.zeros(len(span_at), bool)
    has_zero[np.searchsorted(span_at, np.searchsorted(needed, z[0]), "right") - 1] = True
    has_zero = has_zero.tolist()
    span_file, span_off, fill_last = places
    offsets, last_of_fill = span_off.tolist(), fill_last.tolist()

    data_file = f"{f.path}/c/0"  # what an OSError of a read names

    def one(s: int) -> int:
      """Reads span ``s``, checks its chunks (and its ranges that must be zero); the
      system calls made."""
      first, k, n = span_first[s], starts[s], span_n[s]
      reads = pieces.read(
        f.fd, data_file, seg_at[s], seg_at[s + 1], first * f.stride, span_bytes[s]
      )
      bad = checker.first_bad(k, n)
      if bad is not None:
        raise f.bad_chunk(int(needed[bad]))
      if has_zero[s]:
        _check_stored(f, needed[k : k + n], stored[k : k + n])
        _check_zero(f, self.scratch, self.refuse, first, n, z, z_ids, offsets[s])
      return reads

    if self.two:
      reads = _twothreads.in_two(one, len(span_at))
    else:
      # Spans with no range that must be zero are read and checked in C where it
      # can, as many as lie back to back up to the end of the scratch's fill.
      in_c = _spanbatch.SpanBatches.make(
        pieces, checker, span_seg, span_file, span_at, span_n, len(needed)
      )
      gathers = self.gathered is not None
      reads, fill_first, s = 0, 0, 0  # the first span of the scratch's current fill
      while s < len(span_at):
        if in_c is not None and not has_zero[s]:
          e = s + 1
          while e < len(span_at) and not has_zero[e] and not (gathers and last_of_fill[e - 1]):
            e += 1
          reads += in_c.read(f, s, e, needed)
        else:
          reads, e = reads + one(s), s + 1
        if gathers and last_of_fill[e - 1]:
          self._gather(span_file, span_off, fill_first, e)
          fill_first = e
        s = e
    _check_stored(f, needed, stored)
    if self.stats is not None:
      self.stats.reads += reads
      self.stats.chunks += len(needed)
      self.stats.bytes += len(needed) * f.stride

  def _gather(self, span_file, span_off, a: int, b: int) -> None:
    """Copies the pieces of spans ``[a, b)`` (read and checked, each at its offset in
    the scratch) to the target, in one gather.

    Pieces are cut at chunk boundaries, so none covers a checksum; they move in
    the widest units (up to an element) that the chunk stride keeps aligned.
    """
    start, stop, to = self.gathered
    end = int(span_file[b]) if b < len(span_file) else None
    p, q = np.searchsorted(start, [int(span_file[a]), end if end is not None else start[-1] + 1])
    if p == q:
      return
    start, stop, to = start[p:q], stop[p:q], to[p:q]
    span = np.searchsorted(span_file, start, side="right") - 1
    at = start - span_file[span] + span_off[span]  # each piece in the scratch
    isz = self.f.dtype.itemsize
    unit = isz if isz in _bitview.UINT else 1
    while self.f.stride % unit:  # float64's stride is a multiple of 4 only
      unit //= 2
    uint = _bitview.UINT[unit]
    src = self.scratch[: len(self.scratch) // unit * unit].view(uint)
    out = self.outb[: len(self.outb) // unit * unit].view(uint)
    size = (stop - start) // unit
    rows = src.reshape(1, -1), out.reshape(1, -1)
    if _native.enabled and _native.fits(*rows):
      # Each piece is one block of one source row and one target row: a memcpy each.
      blocks = (at // unit, size, to // unit, size, np.zeros_like(size), size)
      _native.copy_blocks(*rows, blocks, slice(None))
      return
    ends = np.cumsum(size)
    within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - size, size)
    out[np.repeat(to // unit, size) + within] = src[np.repeat(at // unit, size) + within]


def _check_zero(f, scratch, refuse, first: int, n: int, z, z_ids, offset: int) -> None:
  """The ranges that must be zero bits, in the span just read (all in the scratch,
  from ``offset`` on)."""
  chunk, lo, hi, rid = z
  a, b = np.searchsorted(chunk, [first, first + n])
  if a == b:
    return
  # Every byte of the ranges, range after range, in one gather: zero bits are zero bytes.
  isz = f.dtype.itemsize
  ch, start, stop = chunk[a:b], lo[a:b], hi[a:b]
  size = (stop - start) * isz
  ends = np.cumsum(size)
  at = offset + (ch - first) * f.stride + (start - ch * f.chunk) * isz  # in the scratch
  index = np.repeat(at - (ends - size), size) + np.arange(int(ends[-1]), dtype=np.int64)
  nz = np.flatnonzero(scratch[index])
  if nz.size:
    j = int(nz[0])
    k = int(np.searchsorted(ends, j, side="right"))
    raise refuse(int(z_ids[rid[a + k]]), int(start[k]) + (j - int(ends[k] - size[k])) // isz)


def span_starts(needed: np.ndarray, per_span: int) -> np.ndarray:
  """Whether each of the (sorted, distinct) ``needed`` chunks starts a span: spans are
  runs of consecutive chunks, at most ``per_span`` each."""
  brk = np.concatenate([[True], np.diff(needed) != 1])
  group_first = needed[brk][np.cumsum(brk) - 1]
  block = (needed - group_first) // per_span
  return brk | np.concatenate([[False], np.diff(block) != 0])


def fills(span_bytes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
  """Each span's offset in a scratch of ``capacity`` bytes, spans placed one after
  another until the next would not fit, then from 0 again; and whether each span
  is the last of its fill. With ``capacity`` 0 every span is at 0, alone."""
  offsets = np.zeros(len(span_bytes), np.int64)
  last = np.ones(len(span_bytes), bool)
  if not capacity:
    return offsets, last
  at = 0
  for i, n in enumerate(span_bytes.tolist()):
    if at and at + n > capacity:
      at = 0
    elif i:
      last[i - 1] = False
    offsets[i] = at
    at += n
  return offsets, last


def _crc_groups(mem, addr, n_bytes, seg_chunk):
  """Data pieces merged where they lie back to back in one buffer, within one chunk.

  Returns ``(chunk, buffer, start, bytes)`` per group, in file order: a chunk's
  crc32c is the crc32c of its groups' bytes one after the other.
  """
  data = np.flatnonzero(mem != _CRC)
  m, a, n, ch = mem[data], addr[data], n_bytes[data], seg_chunk[data]
  cont = (m[1:] == m[:-1]) & (a[1:] == a[:-1] + n[:-1]) & (ch[1:] == ch[:-1])
  start = np.flatnonzero(np.concatenate([[True], ~cont]))
  total = np.add.reduceat(n, start) if len(start) else n[:0]
  return ch[start], m[start], a[start], total


def _check_stored(f, chunks, stored) -> None:
  """The checksums stored after ``chunks`` in the file must be the recorded ones."""
  bad = np.flatnonzero(stored.astype(np.int64) != f.crc_table[chunks])
  if bad.size:
    raise f.bad_chunk(int(chunks[bad[0]]))


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
  _check_inside(f, src, length)
  if n_copy and not ((dst[:n_copy] >= 0) & (dst[:n_copy] <= out.size - length[:n_copy])).all():
    raise AssertionError("a piece lies outside its buffer")  # a planning bug, never data
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
  needed = _copyplan.unique_ints(chunk)
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

"""Reading runs of a shard file: direct into the target, each chunk whole and checked."""

from __future__ import annotations

import errno
import os

import jax
import numpy as np
import pytest

from jaxreshard._src.checkpoint import chunkcrc, iovread, runread, shardfile, shardread
from jaxreshard._src.errors import ArchiveError
from jaxreshard._src.exec import native
from tests._archive_util import zero_file_reading_a_directory


@pytest.fixture(autouse=True, params=["libc", "os"])
def _preadv(request, monkeypatch):
  """Every test with the C library's preadv (numpy iovecs) and with ``os.preadv``."""
  if request.param == "os":
    monkeypatch.setattr(iovread, "_PREADV", None)
  elif iovread._PREADV is None:
    pytest.skip("no C library preadv here")


@pytest.fixture(autouse=True, params=["direct", "gather"])
def mode(request, monkeypatch):
  """Every test with runs read straight into the target, and with every span read
  into the scratch and its runs gathered out of it."""
  monkeypatch.setattr(runread, "_gathers", lambda *_: request.param == "gather")
  return request.param


@pytest.fixture(autouse=True, params=["c", "python"])
def _checks(request, monkeypatch):
  """Every test with chunks checked in C, spans read on two threads wherever a read
  has two or more (however few bytes) and gathered runs copied by the compiled block
  copy, and with one google_crc32c call per piece, span after span, and numpy's
  gather."""
  if request.param == "python":
    monkeypatch.setattr(chunkcrc, "native", False)
    monkeypatch.setattr(native, "enabled", False)
  elif not chunkcrc.native:
    pytest.skip("the compiled chunk check was not built here")
  else:
    monkeypatch.setattr(runread, "PARALLEL_BYTES", 0)


def _write(tmp_path, data, chunk):
  crcs = shardfile.write_array(str(tmp_path), "b", data, chunk)
  return shardread.Dir.root(str(tmp_path)), crcs


def _open(tmp_path, data, chunk):
  root, crcs = _write(tmp_path, data, chunk)
  return root, shardread.ShardFile(root, "b", data.size, data.dtype, chunk, crcs)


def _runs(rng, size, n):
  """``n`` disjoint runs of ``[0, size)`` in random order, each with a destination."""
  cuts = np.sort(rng.choice(np.arange(1, size), 2 * n, replace=False))
  src, stop = cuts[0::2], cuts[1::2]
  length = stop - src
  perm = rng.permutation(n)
  dst = np.concatenate([[0], np.cumsum(length[perm])[:-1]])[np.argsort(perm)]
  return src, dst, length


@pytest.mark.parametrize("span_bytes", [1 << 20, 100, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_runs_match_slices_and_chunk_counts(tmp_path, monkeypatch, span_bytes, dtype):
  monkeypatch.setattr(runread, "SPAN_BYTES", span_bytes)
  rng = np.random.default_rng(span_bytes)
  data = rng.integers(1, 2**15, 1000).astype(dtype)
  root, f = _open(tmp_path, data, 7)
  src, dst, length = _runs(rng, data.size, 40)
  out = np.zeros(int(length.sum()), dtype)
  stats = shardread.ReadStats()
  runread.read_runs(f, src, dst, length, out, np.empty(64, np.uint8), stats)
  want = np.zeros_like(out)
  for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
    want[d : d + n] = data[s : s + n]
  assert (
    out.view(np.uint16 if out.itemsize == 2 else np.uint32).tolist()
    == want.view(out.view(np.uint16 if out.itemsize == 2 else np.uint32).dtype).tolist()
  )
  touched = {e // 7 for s, n in zip(src.tolist(), length.tolist()) for e in range(s, s + n)}
  assert stats.chunks == len(touched)
  assert stats.bytes == len(touched) * (7 * data.itemsize + 4)
  f.close()
  root.close()


def test_overlapping_runs_read_through_scratch(tmp_path):
  data = np.arange(1, 101, dtype=np.float32)
  root, f = _open(tmp_path, data, 8)
  out = np.zeros(30, np.float32)
  runread.read_runs(
    f, np.array([5, 10]), np.array([0, 15]), np.array([15, 15]), out, np.empty(0, np.uint8)
  )
  assert out.tolist() == data[5:20].tolist() + data[10:25].tolist()
  f.close()
  root.close()


@pytest.mark.parametrize("span_bytes", [1 << 20, 40])
def test_a_corrupted_chunk_is_named_and_refused(tmp_path, monkeypatch, span_bytes):
  monkeypatch.setattr(runread, "SPAN_BYTES", span_bytes)
  data = np.arange(1, 101, dtype=np.float32)
  root, crcs = _write(tmp_path, data, 8)
  stride = 8 * 4 + 4
  with open(os.path.join(tmp_path, "b", "c", "0"), "r+b") as fh:
    fh.seek(5 * stride + 13)
    fh.write(b"\x7f")
  f = shardread.ShardFile(root, "b", 100, np.float32, 8, crcs)
  out = np.zeros(6, np.float32)
  # Elements 38..43 lie in chunks 4 and 5; only chunk 5 is corrupted.
  with pytest.raises(ArchiveError, match=r"chunk 5 fails its crc32c check"):
    runread.read_runs(f, np.array([38]), np.array([0]), np.array([6]), out, np.empty(0, np.uint8))
  # A run that stays in chunk 4 reads fine.
  runread.read_runs(f, np.array([33]), np.array([0]), np.array([6]), out, np.empty(0, np.uint8))
  assert out.tolist() == data[33:39].tolist()
  f.close()
  root.close()


def test_zero_ranges_are_checked_with_the_runs(tmp_path):
  data = np.arange(1, 101, dtype=np.float32)
  data[50:60] = 0
  data[57] = -0.0  # a sign bit is not zero bits
  root, f = _open(tmp_path, data, 8)
  out = np.zeros(4, np.float32)
  seen = []

  def refuse(i, pos):
    seen.append((i, pos))
    return ArchiveError("padding")

  runread.read_runs(
    f,
    np.array([2]),
    np.array([0]),
    np.array([4]),
    out,
    np.empty(0, np.uint8),
    zero=(np.array([50]), np.array([7])),
    refuse=refuse,
  )
  assert out.tolist() == data[2:6].tolist() and seen == []
  with pytest.raises(ArchiveError, match="padding"):
    runread.read_runs(
      f,
      np.array([2]),
      np.array([0]),
      np.array([4]),
      out,
      np.empty(0, np.uint8),
      zero=(np.array([50, 52]), np.array([2, 8])),
      refuse=refuse,
    )
  assert seen == [(1, 57)]
  f.close()
  root.close()


def _corrupt(tmp_path, pos, byte=b"\x7f"):
  with open(os.path.join(tmp_path, "b", "c", "0"), "r+b") as fh:
    fh.seek(pos)
    old = fh.read(1)
    fh.seek(pos)
    fh.write(byte if byte != old else b"\x00")


@pytest.mark.parametrize("where", [0, 13, 31, 32, 35])  # data bytes, then its stored crc32c
@pytest.mark.parametrize("chunk", [0, 7, 11])
def test_a_corrupted_chunk_inside_a_long_span_is_named(tmp_path, where, chunk):
  # One run over chunks 0..11 (plus part of 12): one span, one crc32c over its bytes.
  data = np.arange(1, 101, dtype=np.float32)
  root, crcs = _write(tmp_path, data, 8)
  _corrupt(tmp_path, chunk * 36 + where)
  f = shardread.ShardFile(root, "b", 100, np.float32, 8, crcs)
  out = np.zeros(99, np.float32)
  with pytest.raises(ArchiveError, match=rf"/c/0: chunk {chunk} fails its crc32c check \(the"):
    runread.read_runs(f, np.array([1]), np.array([0]), np.array([99]), out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_the_first_of_two_corrupted_chunks_is_named(tmp_path):
  data = np.arange(1, 201, dtype=np.float32)
  root, crcs = _write(tmp_path, data, 8)
  _corrupt(tmp_path, 9 * 36 + 4)
  _corrupt(tmp_path, 3 * 36 + 20)
  f = shardread.ShardFile(root, "b", 200, np.float32, 8, crcs)
  out = np.zeros(150, np.float32)
  src, dst, length = np.array([0, 100]), np.array([0, 100]), np.array([90, 50])
  with pytest.raises(ArchiveError, match=r"chunk 3 fails its crc32c check"):
    runread.read_runs(f, src, dst, length, out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_checksums_the_metadata_records_are_the_reference(tmp_path):
  # The file is intact; the archive's metadata records another checksum for chunk 6.
  data = np.arange(1, 101, dtype=np.float32)
  root, crcs = _write(tmp_path, data, 8)
  crcs[6] ^= 1
  f = shardread.ShardFile(root, "b", 100, np.float32, 8, crcs)
  out = np.zeros(100, np.float32)
  with pytest.raises(ArchiveError, match=r"chunk 6 fails its crc32c check"):
    runread.read_runs(f, np.array([0]), np.array([0]), np.array([100]), out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_every_chunk_is_checked_against_its_own_crc32c(tmp_path, monkeypatch, mode):
  data = np.arange(1, 1001, dtype=np.float32)
  root, f = _open(tmp_path, data, 8)
  calls = []
  real = chunkcrc.google_crc32c.extend
  # Counted where each piece is one Python call; the C path runs the same loop.
  monkeypatch.setattr(chunkcrc, "native", False)
  monkeypatch.setattr(
    chunkcrc.google_crc32c, "extend", lambda crc, b: calls.append(len(b)) or real(crc, b)
  )
  out = np.zeros(990, np.float32)
  runread.read_runs(f, np.array([5]), np.array([0]), np.array([990]), out, np.empty(0, np.uint8))
  assert out.tolist() == data[5:995].tolist()
  # One call per chunk (32 bytes) and, read into the target, one more for each edge
  # chunk, whose bytes lie partly in the scratch buffer and partly in the target: no
  # call spans two chunks, so errors in two chunks cannot cancel out in one checksum.
  extra = 2 if mode == "direct" else 0
  assert len(calls) == 125 + extra and sum(calls) == 125 * 32 and max(calls) == 32
  f.close()
  root.close()


def test_pieces_outside_their_buffer_are_never_read(tmp_path):
  bufs = (np.zeros(8, np.uint8), np.zeros(4, np.uint8))
  for mem, addr, n in (([1], [1], [4]), ([0], [-1], [2]), ([0, 1], [0, 0], [9, 1])):
    with pytest.raises(AssertionError, match="outside its buffer"):
      iovread.Pieces(bufs, np.array(mem), np.array(addr), np.array(n))


def test_a_file_shorter_than_its_pieces_is_refused(tmp_path):
  path = os.path.join(tmp_path, "f")
  with open(path, "wb") as fh:
    fh.write(bytes(range(10)))
  out = np.zeros(16, np.uint8)
  pieces = iovread.Pieces((out,), np.array([0, 0]), np.array([0, 8]), np.array([8, 8]))
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(ArchiveError, match="ended early"):
      pieces.read(fd, path, 0, 2, 0, 16)
    assert pieces.read(fd, path, 0, 1, 2, 8) == 1
    assert out[:8].tolist() == list(range(2, 10))
  finally:
    os.close(fd)
  with pytest.raises(OSError) as e:
    pieces.read(fd, path, 0, 1, 0, 8)  # a closed descriptor: the error names the file
  assert e.value.filename == path


def test_whole_buffer_reads_check_every_chunk_on_its_own(tmp_path, monkeypatch):
  import glob

  import jaxreshard as jr
  from tests._core_util import adam_records

  records = adam_records(2)
  jr.save_records(tmp_path / "ck", records, chunk_bytes=4)
  files = glob.glob(str(tmp_path / "ck" / "*" / "*" / "c" / "0"))
  # Each file: chunks of 4 bytes and their crc32c, an index entry per chunk (16), its crc32c.
  n_chunks = sum((os.path.getsize(p) - 4) // 24 for p in files)
  calls = []
  monkeypatch.setattr(chunkcrc, "native", False)  # every check a Python call, counted
  for name in ("extend", "value"):
    real = getattr(shardfile.google_crc32c, name)
    monkeypatch.setattr(
      shardfile.google_crc32c, name, lambda *a, real=real: calls.append(a) or real(*a)
    )
  loaded = jr.load_records(tmp_path / "ck")
  for a, b in zip(records, loaded):
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  # Every chunk's bytes are checked by a call of their own (4 bytes each here).
  data_calls = [a for a in calls if len(a) == 2 and len(a[1]) == 4]
  assert n_chunks > 100 and len(data_calls) >= n_chunks


@pytest.mark.parametrize("kind", ["read_only", "strided"])
def test_a_buffer_without_raw_addresses_is_never_written(tmp_path, kind):
  """A read-only or strided buffer gets no raw addresses (``os.preadv`` on
  memoryviews, which refuses it): the read fails and the buffer keeps its bytes."""
  path = os.path.join(tmp_path, "f")
  with open(path, "wb") as fh:
    fh.write(bytes(range(1, 9)))
  base = np.zeros(16, np.uint8)
  out = base[::2] if kind == "strided" else base[:8]
  if kind == "read_only":
    out.flags.writeable = False
  pieces = iovread.Pieces((out,), np.array([0]), np.array([0]), np.array([8]))
  assert pieces.iov is None
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises((TypeError, BufferError)):
      pieces.read(fd, path, 0, 1, 0, 8)
  finally:
    os.close(fd)
  assert base.tolist() == [0] * 16


@pytest.mark.parametrize("scratch_bytes", [0, 100, 1000, 1 << 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_sparse_short_runs_and_zero_ranges_in_spans_of_many_sizes(
  tmp_path, monkeypatch, scratch_bytes, dtype
):
  """Short runs scattered over the file (several spans per scratch fill, gaps of
  unread chunks between them), zero ranges among them: every run's bits copied,
  the first nonzero of the zero ranges in file order refused."""
  monkeypatch.setattr(runread, "SPAN_BYTES", 200)
  rng = np.random.default_rng(scratch_bytes + np.dtype(dtype).itemsize)
  size = 3000
  data = rng.integers(1, 200, size).astype(dtype)
  holes = rng.choice(size, 300, replace=False)
  data[holes] = 0
  root, f = _open(tmp_path, data, 5)
  # Runs of 1-3 elements at random places, each elsewhere in the target.
  starts = np.sort(rng.choice(np.arange(0, size - 3, 4), 120, replace=False))
  length = rng.integers(1, 4, len(starts))
  dst = np.concatenate([[0], np.cumsum(length)[:-1]])
  perm = rng.permutation(len(starts))
  src, length, dst = starts[perm], length[perm], dst[perm]
  out = np.zeros(int(length.sum()), dtype)
  zeros = np.sort(holes)[:40]

  def read(starts, refuse):  # the runs, and one-element ranges that must be zero
    zero = (starts, np.ones(len(starts), np.int64))
    runread.read_runs(
      f, src, dst, length, out, np.empty(scratch_bytes, np.uint8), zero=zero, refuse=refuse
    )

  read(zeros, lambda i, pos: AssertionError("no refusal expected"))
  want = np.zeros_like(out)
  for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
    want[d : d + n] = data[s : s + n]
  uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[out.itemsize]
  assert out.view(uint).tolist() == want.view(uint).tolist()
  # A zero range over data: the first such element in file order is named.
  bad = np.sort(rng.choice(np.setdiff1d(np.arange(size), holes), 3, replace=False))
  seen = []
  with pytest.raises(ArchiveError, match="padding"):
    read(
      np.concatenate([zeros, bad]), lambda i, pos: seen.append((i, pos)) or ArchiveError("padding")
    )
  assert seen == [(len(zeros), int(bad[0]))]
  f.close()
  root.close()


def test_a_failing_read_of_whole_chunks_names_the_file(tmp_path):
  """An error of the read itself (the file's descriptor made to read a directory:
  EISDIR) is raised as an OSError naming the file."""
  with zero_file_reading_a_directory(tmp_path) as f, pytest.raises(OSError) as e:
    f.read_chunks(0, 2, np.empty(2 * f.stride, np.uint8))
  assert e.value.errno == errno.EISDIR
  assert e.value.filename == os.path.join(tmp_path, "b", "c", "0")


def test_a_fill_of_chunks_larger_than_a_span_holds_one_chunk(tmp_path, monkeypatch, mode):
  """Chunks larger than a span's bytes are each a span alone, and a fill of the
  scratch holds one of them (a read on two threads, one each): the memory a read
  takes is not a larger multiple of the chunk size a checkpoint chose."""
  monkeypatch.setattr(runread, "SPAN_BYTES", 64)
  data = np.arange(6 * 64, dtype=np.float32)
  root, f = _open(tmp_path, data, 64)  # chunks of 256 bytes, 260 with their checksum
  asked = []
  staging = runread.staging
  monkeypatch.setattr(
    runread, "staging", lambda scratch, n, f: asked.append(n) or staging(scratch, n, f)
  )
  out = np.zeros(6, np.float32)
  try:
    runread.read_runs(
      f, np.arange(6) * 64 + 5, np.arange(6), np.ones(6, np.int64), out, np.empty(0, np.uint8)
    )
  finally:
    f.close()
    root.close()
  assert out.tolist() == (np.arange(6) * 64 + 5).tolist()
  most = (
    max(f.stride, runread.FILL_SPANS * runread.SPAN_BYTES) if mode == "gather" else 2 * f.stride
  )
  assert max(asked) <= most


@pytest.mark.parametrize("runs", [([0], [0], [64]), ([1, 20, 40], [0, 5, 10], [2, 3, 4])])
def test_a_failing_read_of_runs_names_the_file(tmp_path, runs):
  """The same error raised by a read of runs, one span or many, however the spans
  are read (one by one, on two threads or in one C call)."""
  out = np.zeros(64, np.float32)
  with zero_file_reading_a_directory(tmp_path) as f, pytest.raises(OSError) as e:
    runread.read_runs(f, *runs, out, np.empty(0, np.uint8))
  assert e.value.errno == errno.EISDIR
  assert e.value.filename == os.path.join(tmp_path, "b", "c", "0")


def test_a_failing_read_of_the_shard_index_names_the_file(tmp_path, monkeypatch):
  """An error of the read of the shard index (EIO) while the file is opened is raised
  as an OSError naming the file, never as an error of the reader's own."""
  crcs = shardfile.write_array(str(tmp_path), "b", np.zeros(64, np.float32), 8)
  path = os.path.join(tmp_path, "b")
  pread_ = os.pread

  def fails(fd, n, offset):
    if os.readlink(f"/proc/self/fd/{fd}") == os.path.join(path, "c", "0"):
      raise OSError(errno.EIO, os.strerror(errno.EIO))
    return pread_(fd, n, offset)

  monkeypatch.setattr(os, "pread", fails)
  root = shardread.Dir.root(str(tmp_path))
  try:
    with pytest.raises(OSError) as e:
      shardread.ShardFile(root, "b", 64, np.float32, 8, crcs)
  finally:
    root.close()
  assert e.value.errno == errno.EIO and e.value.filename == os.path.join(path, "c", "0")


# 8 chunks of 8 float32 and their crc32c: 8 * 36 bytes of chunks, then the shard index.
@pytest.mark.parametrize("keep", [0, 8 * 36 + 8])
def test_a_shard_index_truncated_while_the_file_is_opened_is_refused(tmp_path, monkeypatch, keep):
  """A file cut short between its size check and the read of its shard index (all of
  it, or inside the index): a refusal naming the file, never a read of what is left."""
  crcs = shardfile.write_array(str(tmp_path), "b", np.zeros(64, np.float32), 8)
  shard = os.path.join(tmp_path, "b", "c", "0")
  pread_ = os.pread

  def truncated(fd, n, offset):
    if os.readlink(f"/proc/self/fd/{fd}") == shard:
      os.truncate(shard, keep)
    return pread_(fd, n, offset)

  monkeypatch.setattr(os, "pread", truncated)
  root = shardread.Dir.root(str(tmp_path))
  try:
    with pytest.raises(ArchiveError, match="ended early"):
      shardread.ShardFile(root, "b", 64, np.float32, 8, crcs)
  finally:
    root.close()


def test_whole_chunks_of_a_file_truncated_after_it_was_opened_are_refused(tmp_path):
  """Opening checks the file's size once; a file cut short after that is refused by
  the read that comes short, never read as zeros or as a shorter span."""
  crcs = shardfile.write_array(str(tmp_path), "b", np.arange(64, dtype=np.float32), 8)
  root = shardread.Dir.root(str(tmp_path))
  f = shardread.ShardFile(root, "b", 64, np.float32, 8, crcs)
  os.truncate(os.path.join(tmp_path, "b", "c", "0"), f.stride + 1)
  try:
    into = np.empty(2 * f.stride, np.uint8)
    assert f.read_chunks(0, 1, into).view(np.float32).tolist() == [list(range(8))]
    with pytest.raises(ArchiveError, match=r"b/c/0 ended early \(truncated while read\)"):
      f.read_chunks(0, 2, into)
  finally:
    f.close()
    root.close()

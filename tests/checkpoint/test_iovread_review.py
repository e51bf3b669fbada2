"""Hostile review of the scattered reads (``iovread``), the chunk checksums and the
reads of runs that drive them (``runread``): every piece the kernel writes lies
inside its buffer whatever the numbers handed over, every short read or damaged byte
is a refusal, and what is read is bit exact."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import shutil
import weakref

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import iovread, runread, shardfile, shardread, spanbatch
from jaxreshard._src.errors import ArchiveError
from tests._archive_util import read_json, shard_file, write_signed_json
from tests._core_util import adam_records

I64 = np.iinfo(np.int64).max


@pytest.fixture(params=["libc", "os"])
def preadv(request, monkeypatch):
  """The C library's preadv (numpy iovecs) and ``os.preadv`` in turn."""
  if request.param == "os":
    monkeypatch.setattr(iovread, "_PREADV", None)
  elif iovread._PREADV is None:
    pytest.skip("no C library preadv here")
  return request.param


@pytest.fixture
def libc(monkeypatch):
  if iovread._PREADV is None:
    pytest.skip("no C library preadv here")
  return iovread._PREADV


def _file(tmp_path, data: bytes) -> str:
  path = os.path.join(tmp_path, "f")
  with open(path, "wb") as fh:
    fh.write(data)
  return path


# --- Pieces: every iovec inside its buffer -------------------------------------------


@pytest.mark.parametrize(
  "addr, n_bytes",
  [
    (np.array([I64 - 3]), np.array([8])),  # addr + n wraps to a negative int64
    (np.array([2**64 - 8], np.uint64), np.array([16], np.uint64)),  # 8 bytes below the buffer
    (np.array([8], np.uint64), np.array([2**64 - 1], np.uint64)),  # a length of -1
    (np.array([0]), np.array([I64])),
  ],
)
def test_a_piece_whose_end_wraps_around_is_refused(addr, n_bytes):
  buf = np.zeros(16, np.uint8)
  with pytest.raises(AssertionError, match="outside its buffer"):
    iovread.Pieces((buf,), np.array([0]), addr, n_bytes)


@pytest.mark.parametrize(
  "mem, addr, n_bytes, message",
  [
    ([1], [0], [1], "outside its buffer"),  # no buffer 1
    ([-1], [0], [1], "outside its buffer"),  # no buffer -1 either
    ([0], [4.5], [2], "integers"),  # a float offset: the iovec and the view would differ
    ([0], [True], [2], "integers"),
    ([0, 0], [0], [2, 2], "one buffer, offset and length each"),  # never broadcast
  ],
)
def test_pieces_name_a_buffer_and_integer_offsets(mem, addr, n_bytes, message):
  buf = np.zeros(16, np.uint8)
  with pytest.raises(AssertionError, match=message):
    iovread.Pieces((buf,), np.array(mem), np.array(addr), np.array(n_bytes))


def test_pieces_lie_in_flat_bytes():
  # A 2-D buffer: the iovecs would count bytes, the memoryviews rows.
  with pytest.raises(AssertionError, match="1-D uint8"):
    iovread.Pieces((np.zeros((4, 4), np.uint8),), np.array([0]), np.array([1]), np.array([2]))


@pytest.mark.parametrize("a, b", [(0, 3), (-1, 1), (2, 1)])
def test_reads_past_the_iovec_array_never_reach_the_kernel(tmp_path, monkeypatch, a, b):
  calls = []
  monkeypatch.setattr(iovread, "_PREADV", lambda *args: calls.append(args) or 0)
  out = np.zeros(8, np.uint8)
  pieces = iovread.Pieces((out,), np.array([0, 0]), np.array([0, 4]), np.array([4, 4]))
  assert pieces.iov is not None
  path = _file(tmp_path, bytes(range(16)))
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(AssertionError, match="pieces"):
      pieces.read(fd, path, a, b, 0, 8)
  finally:
    os.close(fd)
  assert calls == []


def test_the_buffers_outlive_their_iovecs_whatever_the_caller_does(tmp_path, libc):
  path = _file(tmp_path, bytes(range(1, 9)))
  bufs = [np.zeros(8, np.uint8)]
  alive = weakref.ref(bufs[0])
  pieces = iovread.Pieces(bufs, np.array([0]), np.array([0]), np.array([8]))
  bufs[0] = np.zeros(8, np.uint8)  # the caller's list changes; the iovec keeps its address
  gc.collect()
  assert alive() is not None
  fd = os.open(path, os.O_RDONLY)
  try:
    assert pieces.read(fd, path, 0, 1, 0, 8) == 1
  finally:
    os.close(fd)
  assert alive().tolist() == list(range(1, 9)) and bufs[0].tolist() == [0] * 8


def test_an_interrupted_preadv_is_retried(tmp_path, monkeypatch, libc):
  path = _file(tmp_path, bytes(range(100, 132)))
  seen = []

  def interrupted_once(*args):
    seen.append(args[2])
    if len(seen) == 1:
      ctypes.set_errno(errno.EINTR)
      return -1
    return libc(*args)

  monkeypatch.setattr(iovread, "_PREADV", interrupted_once)
  a, b = np.zeros(20, np.uint8), np.zeros(12, np.uint8)
  pieces = iovread.Pieces((a, b), np.array([0, 1, 0]), np.array([0, 0, 10]), np.array([10, 12, 10]))
  fd = os.open(path, os.O_RDONLY)
  try:
    assert pieces.read(fd, path, 0, 3, 0, 32) == 1
  finally:
    os.close(fd)
  assert seen == [3, 3]
  assert a.tolist() == list(range(100, 110)) + list(range(122, 132))
  assert b.tolist() == list(range(110, 122))


def test_a_failing_preadv_names_the_file(tmp_path, monkeypatch, libc):
  def fails(*args):
    ctypes.set_errno(errno.EIO)
    return -1

  monkeypatch.setattr(iovread, "_PREADV", fails)
  path = _file(tmp_path, bytes(8))
  pieces = iovread.Pieces((np.zeros(8, np.uint8),), np.array([0]), np.array([0]), np.array([8]))
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(OSError) as e:
      pieces.read(fd, path, 0, 1, 0, 8)
  finally:
    os.close(fd)
  assert e.value.errno == errno.EIO and e.value.filename == path


def test_a_short_preadv_is_a_refusal(tmp_path, monkeypatch, libc):
  # The kernel may return fewer bytes than asked for: never taken for a whole read.
  monkeypatch.setattr(iovread, "_PREADV", lambda fd, p, n, pos: libc(fd, p, n - 1, pos))
  path = _file(tmp_path, bytes(range(16)))
  out = np.zeros(16, np.uint8)
  pieces = iovread.Pieces((out,), np.array([0, 0]), np.array([0, 8]), np.array([8, 8]))
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(ArchiveError, match="ended early"):
      pieces.read(fd, path, 0, 2, 0, 16)
  finally:
    os.close(fd)


# --- runread: spans of many pieces, files changed after their checks -------------------


def _shard(tmp_path, data, chunk):
  crcs = shardfile.write_array(str(tmp_path), "b", data, chunk)
  root = shardread.Dir.root(str(tmp_path))
  return root, crcs, shardread.ShardFile(root, "b", data.size, data.dtype, chunk, crcs)


def _c0(tmp_path):
  return os.path.join(tmp_path, "b", "c", "0")


def _poke(path, pos, xor=0x10):
  with open(path, "r+b") as fh:
    fh.seek(pos)
    byte = fh.read(1)[0]
    fh.seek(pos)
    fh.write(bytes([byte ^ xor]))


def _bits(a):
  return a.view(f"u{a.itemsize}").tolist()


# 3000 float32 chunks of one element: one span of 6000 pieces (data, checksum), read
# in calls of at most _IOV_MAX iovecs each.
N_ONE = 3000


def test_a_span_of_more_pieces_than_iov_max_is_read_bit_exact(tmp_path, preadv):
  rng = np.random.default_rng(0)
  data = rng.integers(0, 2**32, N_ONE, dtype=np.uint32).view(np.float32)
  root, _, f = _shard(tmp_path, data, 1)
  out = np.zeros(N_ONE - 3, np.float32)
  stats = shardread.ReadStats()
  runread.read_runs(f, [1], [0], [N_ONE - 3], out, np.empty(0, np.uint8), stats)
  assert _bits(out) == _bits(data[1 : N_ONE - 2])
  assert stats.reads == -(-2 * (N_ONE - 3) // shardfile._IOV_MAX) and stats.chunks == N_ONE - 3
  f.close()
  root.close()


@pytest.mark.parametrize("chunk", [0, 255, 256, 257, 1500, N_ONE - 1])
@pytest.mark.parametrize("part", ["data", "crc"])
def test_a_damaged_chunk_in_any_call_of_a_long_span_is_named(tmp_path, preadv, chunk, part):
  data = np.arange(1, N_ONE + 1, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 1)
  _poke(_c0(tmp_path), chunk * 8 + (1 if part == "data" else 6))
  out = np.zeros(N_ONE, np.float32)
  with pytest.raises(ArchiveError, match=rf"/c/0: chunk {chunk} fails its crc32c check"):
    runread.read_runs(f, [0], [0], [N_ONE], out, np.empty(0, np.uint8))
  f.close()
  root.close()


@pytest.mark.parametrize("keep", [0, 7, 2048, 2049, 4096 + 3, N_ONE * 8 - 1])
def test_a_file_truncated_after_its_checks_is_refused(tmp_path, preadv, keep):
  data = np.arange(1, N_ONE + 1, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 1)
  os.truncate(_c0(tmp_path), keep)  # after ShardFile checked its size and index
  out = np.zeros(N_ONE, np.float32)
  with pytest.raises(ArchiveError, match=r"/c/0 ended early \(truncated while read\)"):
    runread.read_runs(f, [0], [0], [N_ONE], out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_a_file_replaced_after_its_checks_is_never_read(tmp_path, preadv):
  # The descriptor checked is the one read: a file renamed over the path is not.
  data = np.arange(1, 101, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 8)
  other = tmp_path / "other"
  other.mkdir()
  shardfile.write_array(str(other), "b", -data, 8)
  os.replace(other / "b" / "c" / "0", _c0(tmp_path))
  out = np.zeros(100, np.float32)
  runread.read_runs(f, [0], [0], [100], out, np.empty(0, np.uint8))
  assert _bits(out) == _bits(data)
  f.close()
  root.close()


def test_a_file_rewritten_in_place_after_its_checks_is_refused(tmp_path, preadv):
  data = np.arange(1, 101, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 8)
  _poke(_c0(tmp_path), 4 * 36 + 2)
  out = np.zeros(100, np.float32)
  with pytest.raises(ArchiveError, match="chunk 4 fails its crc32c check"):
    runread.read_runs(f, [0], [0], [100], out, np.empty(0, np.uint8))
  f.close()
  root.close()


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("size, chunk", [(10, 3), (31, 5), (7, 6), (7, 7), (64, 1)])
def test_odd_chunks_and_a_short_last_chunk_read_bit_exact(tmp_path, preadv, dtype, size, chunk):
  rng = np.random.default_rng(size * chunk)
  isz = np.dtype(dtype).itemsize
  data = rng.integers(0, 256, size * isz, dtype=np.uint8).view(np.dtype(dtype))
  root, _, f = _shard(tmp_path, data, chunk)
  for s in range(size):
    for n in {1, size - s, min(chunk + 1, size - s)}:
      out = np.zeros(n + 2, dtype)
      runread.read_runs(f, [s], [1], [n], out, np.empty(0, np.uint8))
      assert _bits(out[1 : n + 1]) == _bits(data[s : s + n]) and _bits(out[[0, -1]]) == [0, 0]
  f.close()
  root.close()


def test_the_padding_of_the_last_chunk_is_covered_by_its_checksum(tmp_path, preadv):
  # 10 float32 in chunks of 4: the last chunk's elements 10 and 11 are padding on disk;
  # no run copies them, its crc32c covers them.
  data = np.arange(1, 11, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 4)
  _poke(_c0(tmp_path), 2 * 20 + 2 * 4 + 1)
  out = np.zeros(1, np.float32)
  with pytest.raises(ArchiveError, match="chunk 2 fails its crc32c check"):
    runread.read_runs(f, [9], [0], [1], out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_a_planned_read_whose_end_wraps_around_is_refused(tmp_path):
  data = np.arange(1, 101, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 8)
  out = np.zeros(100, np.float32)
  try:
    with pytest.raises(ArchiveError, match="lies outside its 100 elements"):
      runread.read_runs(f, [1], [0], [I64], out, np.empty(0, np.uint8))
  finally:
    f.close()
    root.close()


# --- whole checkpoints, re-chunked or forged consistently -------------------------------

SHAPES = {"w": ((700,), jnp.float32), "e": ((13, 3), jnp.bfloat16), "h": ((9,), jnp.float16)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = tmp_path_factory.mktemp("saved") / "ck"
  records = adam_records(2, SHAPES)
  jr.save_records(path, records, chunk_bytes=8)
  return path, records


@pytest.fixture
def ckpt(saved, tmp_path):
  path = tmp_path / "ck"
  shutil.copytree(saved[0], path)
  return path


def _data(path, b, dtype):
  """The elements a shard file holds (its chunks without their checksums and padding)."""
  isz = np.dtype(dtype).itemsize
  n, c = b["elements"], b["chunk"]
  with open(path, "rb") as fh:
    raw = np.frombuffer(fh.read(), np.uint8)
  k = -(-n // c)
  rows = raw[: k * (c * isz + 4)].reshape(k, c * isz + 4)[:, : c * isz]
  return rows.reshape(-1)[: n * isz].copy().view(np.dtype(dtype))


def _rechunk(ckpt, archive, dtype_name, chunk_of):
  """Rewrites one buffer file in chunks of ``chunk_of(elements)``, its zarr.json and the
  checksums of archive.json with it (re-signed): a consistent checkpoint."""
  adir = ckpt / f"archive_{archive:05d}"
  meta = read_json(adir / "archive.json")
  b = meta["buffers"][dtype_name]
  dtype = jnp.dtype(dtype_name)
  data = _data(shard_file(ckpt, archive, dtype_name), b, dtype)
  shutil.rmtree(adir / dtype_name)
  chunk = chunk_of(b["elements"])
  b["crc32c"], b["chunk"] = shardfile.write_array(str(adir), dtype_name, data, chunk), chunk
  write_signed_json(adir / "archive.json", meta)
  return b


def _same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for u, v in zip(jax.tree.leaves(x.state), jax.tree.leaves(y.state)):
      u, v = np.asarray(u), np.asarray(v)
      assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes()


def _restored_bytes(path, world):
  return [
    b"".join(
      np.asarray(x).tobytes()
      for x in jax.tree.leaves(jr.restore(path, world_size=world, rank=r).state)
    )
    for r in range(world)
  ]


@pytest.mark.parametrize(
  "chunk_of",
  [lambda n: 1, lambda n: 3, lambda n: max(1, n - 1), lambda n: n, lambda n: -(-n // 2) + 1],
  ids=["1", "3", "n-1", "n", "half+1"],
)
def test_any_consistent_chunking_loads_bit_exact(saved, ckpt, preadv, chunk_of):
  path, records = saved
  want = _restored_bytes(path, 3)
  for archive in (0, 1):
    for d in ("float32", "bfloat16", "float16"):
      _rechunk(ckpt, archive, d, chunk_of)
  _same(jr.load_records(ckpt), records)
  assert _restored_bytes(ckpt, 3) == want


def test_a_chunk_the_file_does_not_have_is_refused(ckpt, preadv):
  # archive.json says chunks of 3 with their checksums; the file is in chunks of 2.
  adir = ckpt / "archive_00000"
  meta = read_json(adir / "archive.json")
  b = meta["buffers"]["float32"]
  data = _data(shard_file(ckpt, 0, "float32"), b, np.float32)
  b["chunk"] = 3
  b["crc32c"] = [
    google_crc32c.value(np.pad(data[i : i + 3], (0, max(0, i + 3 - data.size))).tobytes())
    for i in range(0, data.size, 3)
  ]
  write_signed_json(adir / "archive.json", meta)
  for fn in (lambda: jr.load_records(ckpt), lambda: jr.restore(ckpt, world_size=3, rank=0)):
    with pytest.raises(ArchiveError, match="zarr.json does not describe float32"):
      fn()


def test_swapped_chunks_with_their_checksums_are_refused(ckpt, preadv):
  # The shard file stays self-consistent (each chunk with its own crc32c, the index
  # untouched); the archive's checksums say which chunk lies where.
  b = read_json(ckpt / "archive_00000" / "archive.json")["buffers"]["float32"]
  stride = b["chunk"] * 4 + 4
  path = shard_file(ckpt, 0, "float32")
  with open(path, "r+b") as fh:
    raw = bytearray(fh.read())
    raw[5 * stride : 6 * stride], raw[6 * stride : 7 * stride] = (
      raw[6 * stride : 7 * stride],
      raw[5 * stride : 6 * stride],
    )
    fh.seek(0)
    fh.write(raw)
  for fn in (lambda: jr.load_records(ckpt), lambda: jr.restore(ckpt, world_size=3, rank=0)):
    with pytest.raises(ArchiveError, match="chunk 5 fails its crc32c check"):
      fn()


def _crc0(d: bytes) -> int:
  """The crc32c of ``d`` without its initial and final xor: linear in ``d``."""
  return google_crc32c.value(d) ^ google_crc32c.value(bytes(len(d)))


def _cancelling(a: bytes, b: bytes) -> tuple[bytes, bytes]:
  """``a`` with one bit flipped and ``b`` with its last 4 bytes changed, such that the
  crc32c of ``a + b`` is unchanged (each part's own crc32c changes)."""
  n = len(a) + len(b)
  da = bytearray(n)
  da[0] = 1
  target = _crc0(bytes(da))
  rows = []  # (vector, which of the 32 tail bits make it), distinct leading bits
  for i in range(32):
    e = bytearray(n)
    e[n - 4 + i // 8] = 1 << (i % 8)
    v, m = _crc0(bytes(e)), 1 << i
    for rv, rm in rows:
      if v ^ rv < v:
        v, m = v ^ rv, m ^ rm
    if v:
      rows = sorted(rows + [(v, m)], reverse=True)
  t, x = target, 0
  for rv, rm in rows:
    if t ^ rv < t:
      t, x = t ^ rv, x ^ rm
  assert t == 0
  a2 = bytes([a[0] ^ 1]) + a[1:]
  b2 = b[:-4] + bytes(p ^ q for p, q in zip(b[-4:], x.to_bytes(4, "little")))
  assert google_crc32c.value(a2 + b2) == google_crc32c.value(a + b)
  assert google_crc32c.value(a2) != google_crc32c.value(a)
  return a2, b2


def _forge_chunks_0_and_1(ckpt, archive=0):
  b = read_json(ckpt / f"archive_{archive:05d}" / "archive.json")["buffers"]["float32"]
  cb = b["chunk"] * 4
  path = shard_file(ckpt, archive, "float32")
  with open(path, "r+b") as fh:
    raw = bytearray(fh.read())
    a2, b2 = _cancelling(bytes(raw[:cb]), bytes(raw[cb + 4 : 2 * cb + 4]))
    raw[:cb], raw[cb + 4 : 2 * cb + 4] = a2, b2
    fh.seek(0)
    fh.write(raw)
  return path


def test_a_forgery_cancelling_across_two_chunks_is_refused_where_they_are_apart(ckpt, preadv):
  # Chunk 0 alone (its first element, param w's first slot) in a span: its own crc32c.
  _forge_chunks_0_and_1(ckpt)
  with pytest.raises(ArchiveError, match="chunk 0 fails its crc32c check"):
    jr.restore(ckpt, world_size=700, rank=0)


def test_a_forgery_cancelling_across_two_chunks_is_refused_by_every_reader(ckpt, preadv):
  _forge_chunks_0_and_1(ckpt)
  with pytest.raises(ArchiveError, match="chunk 0 fails its crc32c check"):
    jr.load_records(ckpt)


def _forged_shard(tmp_path):
  """16 float32 in chunks of 2, chunks 3 and 4 changed so that only their combined
  crc32c is the recorded one."""
  data = np.arange(1, 17, dtype=np.float32)
  root, crcs, f = _shard(tmp_path, data, 2)
  with open(_c0(tmp_path), "r+b") as fh:
    raw = bytearray(fh.read())
    a2, b2 = _cancelling(bytes(raw[3 * 12 : 3 * 12 + 8]), bytes(raw[4 * 12 : 4 * 12 + 8]))
    raw[3 * 12 : 3 * 12 + 8], raw[4 * 12 : 4 * 12 + 8] = a2, b2
    fh.seek(0)
    fh.write(raw)
  return root, f


def test_the_staged_read_refuses_chunks_forged_to_cancel(tmp_path, preadv):
  root, f = _forged_shard(tmp_path)
  out = np.zeros(16, np.float32)
  with pytest.raises(ArchiveError, match="chunk 3 fails its crc32c check"):
    # Overlapping runs: read through the scratch buffer, chunk by chunk.
    runread.read_runs(f, [0, 0], [0, 8], [8, 8], out, np.empty(0, np.uint8))
  f.close()
  root.close()


def test_the_direct_read_refuses_chunks_forged_to_cancel(tmp_path, preadv):
  root, f = _forged_shard(tmp_path)
  out = np.zeros(16, np.float32)
  try:
    with pytest.raises(ArchiveError, match="chunk 3 fails its crc32c check"):
      runread.read_runs(f, [0], [0], [16], out, np.empty(0, np.uint8))
  finally:
    f.close()
    root.close()


@pytest.mark.parametrize("keep", [0, 13])
@pytest.mark.parametrize("reader", ["load_records", "restore"])
def test_a_checkpoint_truncated_while_read_is_refused(ckpt, preadv, monkeypatch, keep, reader):
  # Each buffer file is truncated after every check, right before its first read.
  if not os.path.isdir("/proc/self/fd"):
    pytest.skip("no /proc here")
  # Spans are read one at a time (``Pieces.read``) or in batches in C (``SpanBatches.read``).
  read_pieces, read_in_c = iovread.Pieces.read, spanbatch.SpanBatches.read

  def truncate(fd):
    w = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
    try:
      os.ftruncate(w, keep)
    finally:
      os.close(w)

  def truncated_first(self, fd, *args):
    truncate(fd)
    return read_pieces(self, fd, *args)

  def truncated_first_in_c(self, f, *args):
    truncate(f.fd)
    return read_in_c(self, f, *args)

  monkeypatch.setattr(iovread.Pieces, "read", truncated_first)
  monkeypatch.setattr(spanbatch.SpanBatches, "read", truncated_first_in_c)
  read = {
    "load_records": lambda: jr.load_records(ckpt),
    "restore": lambda: jr.restore(ckpt, world_size=3, rank=1),
  }[reader]
  with pytest.raises(ArchiveError, match=r"/c/0 ended early \(truncated while read\)"):
    read()


def test_the_staged_read_refuses_a_destination_outside_the_target(tmp_path):
  data = np.arange(1, 101, dtype=np.float32)
  root, _, f = _shard(tmp_path, data, 8)
  out = np.zeros(10, np.float32)
  try:
    with pytest.raises(AssertionError, match="outside its buffer"):
      runread.read_runs(f, [5], [-3], [1], out, np.empty(0, np.uint8))  # direct: refused
    with pytest.raises((AssertionError, ArchiveError)):
      runread.read_runs_staged(f, np.array([5]), np.array([-3]), np.array([1]), out, np.empty(0))
  finally:
    f.close()
    root.close()
  assert out.tolist() == [0] * 10

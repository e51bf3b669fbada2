"""Chunk checks in C and in Python against google_crc32c's checksum of each chunk's
bytes, and reads of many spans on two threads."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest

from jaxreshard._src.checkpoint import chunkcrc, runread, shardfile, shardread
from jaxreshard._src.errors import ArchiveError


@pytest.fixture(params=["c", "python"])
def way(request, monkeypatch):
  if request.param == "python":
    monkeypatch.setattr(chunkcrc, "native", False)
  elif not chunkcrc.native:
    pytest.skip("the compiled chunk check was not built here")
  return request.param


def _layout(rng, n_chunks):
  """Random buffers and each chunk's pieces in them, with each chunk's bytes joined."""
  bufs = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(64, 4096, 3)]
  mem, addr, length, at, joined = [], [], [], [0], []
  for _ in range(n_chunks):
    parts = []
    for _ in range(int(rng.integers(1, 5))):
      m = int(rng.integers(0, len(bufs)))
      n = int(rng.integers(0, 40))
      a = int(rng.integers(0, len(bufs[m]) - n + 1))
      mem.append(m), addr.append(a), length.append(n)
      parts.append(bufs[m][a : a + n].tobytes())
    at.append(len(mem))
    joined.append(b"".join(parts))
  return bufs, mem, addr, length, at, joined


def test_each_chunk_gets_the_verdict_of_its_own_bytes(way):
  rng = np.random.default_rng(5)
  for trial in range(40):
    n = int(rng.integers(1, 30))
    bufs, mem, addr, length, at, joined = _layout(rng, n)
    expected = [google_crc32c.value(b) for b in joined]
    bad = sorted(rng.choice(n, int(rng.integers(0, min(n, 4) + 1)), replace=False).tolist())
    for j in bad:
      expected[j] ^= 1 << int(rng.integers(0, 32))
    checker = chunkcrc.Checker(bufs, mem, addr, length, at, expected)
    assert checker.in_c == (way == "c")
    for _ in range(5):
      k = int(rng.integers(0, n + 1))
      m = int(rng.integers(0, n - k + 1))
      want = next((j for j in bad if k <= j < k + m), None)
      assert checker.first_bad(k, m) == want, (trial, k, m, bad)


def test_bytes_changed_after_the_tables_were_made_are_seen(way):
  # The checker keeps addresses, not copies: what the buffer holds when checked counts.
  rng = np.random.default_rng(6)
  bufs, mem, addr, length, at, joined = _layout(rng, 8)
  checker = chunkcrc.Checker(bufs, mem, addr, length, at, [google_crc32c.value(b) for b in joined])
  assert checker.first_bad(0, 8) is None
  j = next(j for j in range(8) if sum(length[at[j] : at[j + 1]]))
  g = next(g for g in range(at[j], at[j + 1]) if length[g])
  bufs[mem[g]][addr[g]] ^= 0x80
  assert checker.first_bad(0, 8) == j


@pytest.mark.parametrize(
  "mem, addr, length, at",
  [
    ([1], [0], [9], [0, 1]),  # past its buffer's end
    ([0], [-1], [2], [0, 1]),
    ([2], [0], [1], [0, 1]),  # no such buffer
    ([0, 0], [0, 1], [1, 1], [0, 1]),  # a piece no chunk holds
    ([0], [0], [1], [1, 0]),
  ],
)
def test_tables_that_do_not_fit_their_buffers_are_never_used(mem, addr, length, at):
  bufs = (np.zeros(8, np.uint8), np.zeros(8, np.uint8))
  with pytest.raises(AssertionError):
    chunkcrc.Checker(bufs, mem, addr, length, at, [0] * (len(at) - 1))


def test_chunks_past_the_table_are_never_checked(way):
  checker = chunkcrc.Checker((np.zeros(4, np.uint8),), [0], [0], [4], [0, 1], [0])
  for k, n in ((0, 2), (1, 1), (-1, 1)):
    with pytest.raises(AssertionError):
      checker.first_bad(k, n)


def _file(tmp_path, n, chunk):
  data = np.arange(1, n + 1, dtype=np.float32)
  crcs = shardfile.write_array(str(tmp_path), "b", data, chunk)
  root = shardread.Dir.root(str(tmp_path))
  return data, root, crcs


def _corrupt(tmp_path, at):
  with open(os.path.join(tmp_path, "b", "c", "0"), "r+b") as fh:
    fh.seek(at)
    b = fh.read(1)
    fh.seek(at)
    fh.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def two(monkeypatch):
  """Reads of two spans or more go to two threads, however few their bytes; counts them."""
  calls = []
  real = runread._in_two
  monkeypatch.setattr(runread, "PARALLEL_BYTES", 0)
  monkeypatch.setattr(runread, "_in_two", lambda one, n: calls.append(n) or real(one, n))
  monkeypatch.setattr(runread, "SPAN_BYTES", 5 * 36)  # 5 chunks of 8 float32 a span
  return calls


def test_spans_on_two_threads_copy_every_byte(tmp_path, two, way):
  data, root, crcs = _file(tmp_path, 2000, 8)
  f = shardread.ShardFile(root, "b", 2000, np.float32, 8, crcs)
  src, dst, length = np.array([3, 900, 1500]), np.array([0, 700, 1100]), np.array([690, 400, 499])
  out = np.zeros(1599, np.float32)
  stats = shardread.ReadStats()
  runread.read_runs(f, src, dst, length, out, np.empty(0, np.uint8), stats)
  want = np.zeros_like(out)
  for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
    want[d : d + n] = data[s : s + n]
  assert out.view(np.uint32).tolist() == want.view(np.uint32).tolist()
  assert two == ([stats.reads] if way == "c" else [])  # one read per span here
  f.close()
  root.close()


# Spans of 5 chunks: chunk 7 is in span 1 (the pool's thread), 12 in span 2 (this
# one), 23 in span 4, 26 in span 5.
@pytest.mark.parametrize("chunks", [(7, 23), (12, 26), (26, 12), (23, 7), (7, 12)])
def test_the_first_bad_chunk_in_file_order_is_named_on_two_threads(tmp_path, two, way, chunks):
  data, root, crcs = _file(tmp_path, 400, 8)
  for c in chunks:
    _corrupt(tmp_path, c * 36 + 5)
  f = shardread.ShardFile(root, "b", 400, np.float32, 8, crcs)
  out = np.zeros(399, np.float32)
  with pytest.raises(ArchiveError, match=rf"chunk {min(chunks)} fails its crc32c check"):
    runread.read_runs(f, np.array([1]), np.array([0]), np.array([399]), out, np.empty(0, np.uint8))
  assert len(two) == (way == "c")
  f.close()
  root.close()


def test_a_file_truncated_after_a_bad_chunk_names_the_bad_chunk(tmp_path, two, way):
  # Span 1 fails its check; span 6 (this thread's) finds the file short: span 1 counts.
  data, root, crcs = _file(tmp_path, 400, 8)
  _corrupt(tmp_path, 8 * 36 + 1)
  f = shardread.ShardFile(root, "b", 400, np.float32, 8, crcs)
  os.truncate(os.path.join(tmp_path, "b", "c", "0"), 31 * 36)
  out = np.zeros(399, np.float32)
  with pytest.raises(ArchiveError, match=r"chunk 8 fails its crc32c check"):
    runread.read_runs(f, np.array([1]), np.array([0]), np.array([399]), out, np.empty(0, np.uint8))
  f.close()
  root.close()

"""Chunk checks in C and in Python against google_crc32c's checksum of each chunk's
bytes, and reads of many spans on two threads."""

from __future__ import annotations

import os
import threading

import google_crc32c
import numpy as np
import pytest

from jaxreshard._src.checkpoint import chunkcrc, runread, shardfile, shardread, twothreads
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
  real = twothreads.in_two
  monkeypatch.setattr(runread, "PARALLEL_BYTES", 0)
  monkeypatch.setattr(twothreads, "in_two", lambda one, n: calls.append(n) or real(one, n))
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


def test_a_read_on_the_read_pool_s_own_thread_reads_its_spans_itself(tmp_path, two, way):
  """A read made on the read pool's thread (say by a finalizer it runs) waited forever
  for its odd spans, queued behind itself: it reads them itself."""
  from jaxreshard._src.core import workers

  data, root, crcs = _file(tmp_path, 2000, 8)
  f = shardread.ShardFile(root, "b", 2000, np.float32, 8, crcs)
  out = np.zeros(1990, np.float32)
  read = lambda: runread.read_runs(
    f, np.array([5]), np.array([0]), np.array([1990]), out, np.empty(0, np.uint8)
  )
  workers.pool("read", 1).submit(read).result(timeout=60)
  assert out.view(np.uint32).tolist() == data[5:1995].view(np.uint32).tolist()
  f.close()
  root.close()


def test_a_read_after_the_pool_is_shut_down_reads_its_spans_itself(tmp_path, two, way, monkeypatch):
  """At the interpreter's exit the pools are shut down: a read on another thread then
  raised 'cannot schedule new futures after shutdown'; it reads its spans itself."""
  import concurrent.futures

  from jaxreshard._src.core import workers

  closed = concurrent.futures.ThreadPoolExecutor(1)
  closed.shutdown()
  monkeypatch.setattr(workers, "pool", lambda name, threads: closed)
  data, root, crcs = _file(tmp_path, 2000, 8)
  f = shardread.ShardFile(root, "b", 2000, np.float32, 8, crcs)
  out = np.zeros(1990, np.float32)
  runread.read_runs(f, np.array([5]), np.array([0]), np.array([1990]), out, np.empty(0, np.uint8))
  assert out.view(np.uint32).tolist() == data[5:1995].view(np.uint32).tolist()
  f.close()
  root.close()


def _spans(fail, n=40):
  """``one`` for ``in_two``: records each span and the thread it ran on; raises at ``fail``."""
  import threading

  ran = []

  def one(s):
    ran.append((s, threading.current_thread().name))
    if s in fail:
      raise fail[s]
    return 1

  return one, ran


def test_a_failure_stops_the_other_thread_at_its_next_span():
  """Once span 2 fails on this thread, the pool's thread reads no span past it (it
  read its whole half before): its span 1 waits until span 2 has failed."""
  import time

  failed = threading.Event()
  ran = []

  def one(s):
    ran.append(s)
    if s == 1:
      assert failed.wait(30)
      time.sleep(0.05)  # the failure is recorded meanwhile (microseconds)
    if s == 2:
      failed.set()
      raise ArchiveError("span 2")
    return 1

  with pytest.raises(ArchiveError, match="^span 2$"):
    twothreads.in_two(one, 40)
  assert sorted(ran) == [0, 1, 2], ran


def test_an_interrupt_on_one_thread_is_raised_before_a_failure_of_an_earlier_span():
  one, _ = _spans({1: ArchiveError("span 1"), 4: KeyboardInterrupt()})
  with pytest.raises(KeyboardInterrupt):
    twothreads.in_two(one, 6)


def test_a_read_finding_the_pool_s_thread_taken_reads_its_spans_itself():
  """Concurrent reads share one helper thread: a read that finds it taken reads alone."""
  one, ran = _spans({})
  with twothreads._HELPER:
    assert twothreads.in_two(one, 10) == 10
  assert sorted(s for s, _ in ran) == list(range(10))
  assert {name for _, name in ran} == {threading.current_thread().name}
  one, ran = _spans({})
  assert twothreads.in_two(one, 10) == 10  # free again: the odd spans on the pool's thread
  assert {name for s, name in ran if s % 2} == {"jaxreshard-read_0"}


def test_tables_the_checker_is_given_strided_are_read_as_their_values(way):
  """Strided tables are copied contiguous before C reads them by address (a strided
  length table was read as raw memory: 2**40 bytes past the buffer)."""
  buf = np.arange(64, dtype=np.uint8)
  lengths = np.array([8, 2**40, 8, 2**40])[::2]
  joined = [buf[0:8].tobytes(), buf[16:24].tobytes()]
  checker = chunkcrc.Checker(
    (buf,),
    np.zeros(4, np.int64)[::2],
    np.array([0, 9, 16, 9])[::2],
    lengths,
    np.array([0, 9, 1, 9, 2])[::2],
    [google_crc32c.value(b) for b in joined],
  )
  assert checker.first_bad(0, 2) is None


@pytest.mark.parametrize("bad", [-1, 2**32, 2**32 + 5])
def test_a_recorded_crc_outside_32_bits_is_never_checked(bad):
  with pytest.raises(AssertionError, match="32-bit"):
    chunkcrc.Checker((np.zeros(4, np.uint8),), [0], [0], [4], [0, 1], [bad])


def test_a_failing_read_names_the_data_file(tmp_path, two, way):
  data, root, crcs = _file(tmp_path, 2000, 8)
  f = shardread.ShardFile(root, "b", 2000, np.float32, 8, crcs)
  os.close(f.fd)
  out = np.zeros(1990, np.float32)
  try:
    with pytest.raises(OSError) as e:
      runread.read_runs(
        f, np.array([5]), np.array([0]), np.array([1990]), out, np.empty(0, np.uint8)
      )
    assert e.value.filename.endswith("/b/c/0"), e.value.filename
  finally:
    f.fd = os.open(os.devnull, os.O_RDONLY)  # what the file's close then closes
    f.close()
    root.close()

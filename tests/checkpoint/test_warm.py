"""Asking the kernel ahead for a read's files when they are on disk only.

Files are dropped from the page cache with ``POSIX_FADV_DONTNEED`` (any user may
drop the clean pages of a file it can open); where the file system keeps them
anyway (tmpfs), the tests that need a cold file are skipped.
"""

import concurrent.futures
import os
import threading
import time

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import shardfile, shardread
from tests._core_util import assert_records_equal

pytestmark = pytest.mark.skipif(
  not hasattr(os, "posix_fadvise") or not hasattr(os, "RWF_NOWAIT"),
  reason="needs posix_fadvise and RWF_NOWAIT",
)


def _evict(path: str) -> None:
  """Drops every file below ``path`` from the page cache."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _open_fds() -> set[str]:
  return set(os.listdir("/proc/self/fd"))


def _shard_file(tmp_path, n=300_000, chunk=1024):
  data = np.arange(n, dtype=np.float32)
  crcs = shardfile.write_array(str(tmp_path), "b", data, chunk)
  root = shardread.Dir.root(str(tmp_path))
  return root, shardread.ShardFile(root, "b", n, np.dtype(np.float32), chunk, crcs)


def test_hint_ranges_merge_close_ranges_and_add_nothing_else():
  rng = np.random.default_rng(0)
  gap = shardread.HINT_GAP_BYTES
  for _ in range(200):
    n = int(rng.integers(1, 40))
    starts = np.sort(rng.integers(0, 40 * gap, n))
    stops = starts + rng.integers(1, gap, n)
    rng.shuffle(starts := starts.copy())
    stops = starts + rng.integers(1, gap, n)
    got = shardread.hint_ranges(starts, stops)
    a = np.array([s for s, _ in got])
    b = np.array([s + n for s, n in got])
    assert (np.diff(a) > 0).all() and (a[1:] - b[:-1] > gap).all()  # sorted, far apart
    # Every input range lies inside one output range...
    k = np.searchsorted(a, starts, side="right") - 1
    assert (k >= 0).all() and (stops <= b[k]).all()
    # ...and every output range begins at an input start and ends at an input stop.
    assert set(a.tolist()) <= set(starts.tolist()) and set(b.tolist()) <= set(stops.tolist())


def test_chunk_ranges_are_the_chunks_the_runs_lie_in(tmp_path):
  root, f = _shard_file(tmp_path)
  rng = np.random.default_rng(1)
  src = rng.integers(0, f.size - 50, 30)
  length = rng.integers(0, 50, 30)
  ranges = f.chunk_ranges(src, length)
  touched = set()
  for s, n in zip(src.tolist(), length.tolist()):
    if n:
      touched.update(range(s // f.chunk, (s + n - 1) // f.chunk + 1))
  covered = set()
  for start, n in ranges:
    assert start % f.stride == 0 and n % f.stride == 0  # whole chunks with their checksums
    covered.update(range(start // f.stride, (start + n) // f.stride))
  assert touched <= covered
  # What is covered beyond the runs' chunks is only gaps shorter than HINT_GAP_BYTES.
  extra = sorted(covered - touched)
  assert len(extra) * f.stride <= len(ranges) * 0 + len(touched) * shardread.HINT_GAP_BYTES
  assert f.chunk_ranges(src, np.zeros_like(length)) == []
  f.close()
  root.close()


def test_chunk_ranges_leave_out_a_chunk_between_two_read(tmp_path):
  # A restore at thousands of ranks reads a chunk of every few: the chunks
  # between are not asked of the disk (a gap of a chunk is more than a page).
  root, f = _shard_file(tmp_path)
  assert f.stride > 4096
  src, length = np.array([0, 2 * f.chunk, 3 * f.chunk]), np.array([1, 1, 1])
  assert f.chunk_ranges(src, length) == [(0, f.stride), (2 * f.stride, 2 * f.stride)]
  f.close()
  root.close()


def test_warm_brings_a_file_into_the_page_cache(tmp_path):
  root, f = _shard_file(tmp_path)
  _evict(str(tmp_path))
  if f.cached(0):
    pytest.skip("this file system keeps the file in memory")
  tasks = shardread.warm(root, [(("b", "c", "0"), [(0, 0)])])
  concurrent.futures.wait(tasks, timeout=30)
  deadline = time.monotonic() + 10
  while not (f.cached(0) and f.cached(f.size - 1)) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert f.cached(0) and f.cached(f.size - 1)
  f.close()
  root.close()


def test_warm_skips_what_is_not_a_regular_file_and_keeps_nothing_open(tmp_path):
  """A FIFO (which a blocking open would wait on forever), a symbolic link, a
  directory and a missing name are skipped; every descriptor is closed."""
  (tmp_path / "d").mkdir()
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "real").write_bytes(b"x" * 100)
  os.symlink(tmp_path / "real", tmp_path / "link")
  root = shardread.Dir.root(str(tmp_path))
  before = _open_fds()
  names = ["fifo", "link", "d", "missing", "real"]
  tasks = shardread.warm(root, [((name,), [(0, 0)]) for name in names])
  done, pending = concurrent.futures.wait(tasks, timeout=30)
  assert not pending and all(t.exception() is None for t in done)
  assert _open_fds() == before
  root.close()


def test_a_cold_restore_asks_ahead_and_a_warm_one_does_not(tmp_path, monkeypatch):
  """The bits are the same either way; only a read whose first chunk is not in
  the page cache asks for the later archives' files."""
  # Buffers of 4 MB: opening a file (its index, at the end) leaves its first
  # chunks on disk.
  opt = optax.adam(1e-3)
  params = {"w": np.zeros(3_000_000, np.float32), "b": np.zeros(7, np.float32)}
  rng = np.random.default_rng(2)
  state = jax.tree.map(
    lambda x: rng.standard_normal(np.shape(x)).astype(np.float32), opt.init(params)
  )
  records = jr.shard_state(opt, params, state, 6)
  path = str(tmp_path / "ckpt")
  jr.save_records(path, records)
  want = jr.reshard(records, jr.plan(records, world_size=4, rank=1))
  calls = []
  real = shardread.warm
  monkeypatch.setattr(
    shardread, "warm", lambda root, files, stop=None: calls.append(files) or real(root, files, stop)
  )

  assert_records_equal(jr.restore(path, world_size=4, rank=1), want)  # just written: cached
  assert calls == []
  _evict(path)
  # Whether the files left the cache, seen in an archive rank 1 does not read (a
  # look that misses may start reading what it looked for).
  f_probe = jr.open_checkpoint(path).open_buffer(4, np.dtype(np.float32))
  cold = not f_probe.cached(0)
  f_probe.close()
  if not cold:
    pytest.skip("this file system keeps the files in memory")
  assert_records_equal(jr.restore(path, world_size=4, rank=1), want)
  asked = {parts for files in calls for parts, _ in files}
  # Rank 1 of 4 reads archives 1 and 2 of 6: the first is read at once, the
  # second's metadata and chunks are asked for ahead.
  assert ("archive_00002", "float32", "zarr.json") in asked
  assert ("archive_00002", "float32", "c", "0") in asked
  assert not any(parts[0] == "archive_00001" for parts in asked)
  calls.clear()
  assert_records_equal(jr.restore(path, world_size=4, rank=1), want)  # cached again
  assert calls == []


def test_warm_asks_for_nothing_once_the_read_is_over(tmp_path, monkeypatch):
  """A set ``stop`` (the read ended or was refused) leaves every file not yet asked for."""
  (tmp_path / "real").write_bytes(b"x" * 100)
  root = shardread.Dir.root(str(tmp_path))
  asked = []
  real = os.posix_fadvise
  monkeypatch.setattr(
    os, "posix_fadvise", lambda fd, a, n, how: asked.append(a) or real(fd, a, n, how)
  )
  stop = threading.Event()
  stop.set()
  concurrent.futures.wait(shardread.warm(root, [(("real",), [(0, 0)])], stop), timeout=30)
  assert asked == []
  concurrent.futures.wait(shardread.warm(root, [(("real",), [(0, 0)])]), timeout=30)
  assert asked == [0]
  root.close()

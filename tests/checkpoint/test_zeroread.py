"""Zero ranges of many shard files read together: the checks, and the refusal named,
of one ``read_runs`` per file in turn."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jaxreshard._src.checkpoint import runread, shardfile, shardread, zeroread
from jaxreshard._src.errors import ArchiveError
from tests._archive_util import zero_file_reading_a_directory

_DTYPES = [np.float16, np.float32, np.float64]


def _file(tmp_path, rng, k):
  """A buffer file of mostly zero bits, a few nonzero elements and a -0.0 (a sign bit is
  not zero bits), written in chunks of 1-8 elements; its data and recorded checksums."""
  dtype = _DTYPES[int(rng.integers(3))]
  size, chunk = int(rng.integers(20, 400)), int(rng.integers(1, 9))
  data = np.zeros(size, dtype)
  data[rng.choice(size, max(1, size // 20), replace=False)] = 1
  data[rng.integers(size)] = -0.0
  crcs = shardfile.write_array(str(tmp_path), f"b{k}", data, chunk)
  return data, chunk, crcs


def _ranges(rng, data):
  """Disjoint ranges of 1-4 elements in random order, zero bits only but for up to three;
  now and then two that overlap, or one of no elements."""
  bits = data.view(f"u{data.itemsize}")
  size = len(data)
  starts = np.sort(rng.choice(size - 4, min(size - 4, int(rng.integers(1, 25))), replace=False))
  length = rng.integers(1, 5, len(starts))
  length = np.minimum(length, np.append(np.diff(starts), size - starts[-1]))
  clean = np.array([not bits[s : s + n].any() for s, n in zip(starts, length)])
  clean[rng.choice(len(starts), min(len(starts), int(rng.integers(0, 4))), replace=False)] = True
  starts, length = starts[clean], length[clean]
  if len(starts) > 1 and rng.random() < 0.1:
    length[0] = starts[1] - starts[0] + 1  # overlaps the next
  if len(starts) and rng.random() < 0.1:
    length[-1] = 0
  order = rng.permutation(len(starts))
  return starts[order], length[order]


def _corrupt(path, pos):
  with open(path, "r+b") as fh:
    fh.seek(pos)
    old = fh.read(1)
    fh.seek(pos)
    fh.write(b"\x7f" if old != b"\x7f" else b"\x00")


def _refuse(file, i, pos):
  return ArchiveError(f"file {file}: range {i} position {pos} is not zero bits")


@pytest.mark.parametrize("seed", range(60))
def test_files_read_together_refuse_as_one_by_one(tmp_path, monkeypatch, seed):
  rng = np.random.default_rng(seed)
  monkeypatch.setattr(runread, "SPAN_BYTES", int(rng.choice([24, 200, 1 << 20])))
  monkeypatch.setattr(zeroread, "MAX_FILES", int(rng.choice([1, 2, 64])))
  files = []
  for k in range(int(rng.integers(1, 7))):
    data, chunk, crcs = _file(tmp_path, rng, k)
    files.append((f"b{k}", data, chunk, crcs, *_ranges(rng, data)))
  for _ in range(int(rng.integers(0, 3))):  # chunk bytes or stored checksums
    name, data, chunk = files[int(rng.integers(len(files)))][:3]
    path = os.path.join(tmp_path, name, "c", "0")
    n = shardfile.n_chunks(len(data), chunk)
    _corrupt(path, int(rng.integers(0, n * (chunk * data.itemsize + 4))))
  truncated = int(rng.integers(len(files))) if rng.random() < 0.15 else None
  scratch_bytes = int(rng.choice([0, 64, 1 << 16]))
  root = shardread.Dir.root(str(tmp_path))

  def outcome(read):
    opened = [
      shardread.ShardFile(root, name, len(data), data.dtype, chunk, crcs)
      for name, data, chunk, crcs, *_ in files
    ]
    if truncated is not None:  # after the open, which checks the file's size
      name, data, chunk = files[truncated][:3]
      path = os.path.join(tmp_path, name, "c", "0")
      with open(path, "rb") as fh:
        whole = fh.read()
      os.truncate(path, chunk * data.itemsize)
    stats = shardread.ReadStats()
    try:
      read(opened, stats, np.empty(scratch_bytes, np.uint8))
      return "ok", stats.chunks, stats.bytes
    except ArchiveError as e:
      return str(e)
    finally:
      for f in opened:
        f.close()
      if truncated is not None:  # whole again for the other read
        with open(path, "wb") as fh:
          fh.write(whole)

  def together(opened, stats, scratch):
    reads = zeroread.ZeroReads(scratch, stats)
    for k, (f, (_, _, _, _, src, length)) in enumerate(zip(opened, files)):
      reads.add(f, src, length, lambda i, pos, k=k: _refuse(k, i, pos))
      if reads.full:
        reads.run()
    reads.run()

  def one_by_one(opened, stats, scratch):
    for k, (f, (_, _, _, _, src, length)) in enumerate(zip(opened, files)):
      zero = (src, length)
      runread.read_runs(
        f, [], [], [], None, scratch, stats, zero, lambda i, pos, k=k: _refuse(k, i, pos)
      )

  assert outcome(together) == outcome(one_by_one)
  root.close()


def test_a_later_file_refused_first_checks_the_zero_ranges_read_before_it(tmp_path):
  """Nonzero padding in the first file, a corrupted chunk in the second: one read
  per file names the padding, and so do the files read together (the second
  file's check fails before the first file's zero ranges are checked)."""
  data = np.zeros(64, np.float32)
  data[10] = 1
  crcs = [shardfile.write_array(str(tmp_path), f"b{k}", data, 8) for k in range(2)]
  _corrupt(os.path.join(tmp_path, "b1", "c", "0"), 3)
  root = shardread.Dir.root(str(tmp_path))
  files = [shardread.ShardFile(root, f"b{k}", 64, np.float32, 8, crcs[k]) for k in range(2)]
  reads = zeroread.ZeroReads(np.empty(1 << 16, np.uint8))
  for k, f in enumerate(files):
    reads.add(f, [8, 0], [4, 2], lambda i, pos, k=k: _refuse(k, i, pos))
  with pytest.raises(ArchiveError, match="file 0: range 0 position 10 is not zero bits"):
    reads.run()
  # The second file alone is refused for its chunk.
  reads.add(files[1], [0], [2], lambda i, pos: _refuse(1, i, pos))
  with pytest.raises(ArchiveError, match="chunk 0 fails its crc32c check"):
    reads.run()
  for f in files:
    f.close()
  root.close()


@pytest.mark.parametrize("given", [[(8, 2), (2, 2)], [(2, 2), (8, 2)]])
def test_two_nonzero_ranges_in_one_chunk_are_named_as_one_by_one(tmp_path, given):
  """Pieces of one chunk are checked in the order their ranges were given, as
  ``read_runs`` checks them."""
  data = np.zeros(32, np.float32)
  data[3] = data[9] = 1
  crcs = shardfile.write_array(str(tmp_path), "b", data, 16)
  root = shardread.Dir.root(str(tmp_path))
  f = shardread.ShardFile(root, "b", 32, np.float32, 16, crcs)
  src, length = (np.array(x) for x in zip(*given))
  errors = []
  for read in ("together", "one by one"):
    with pytest.raises(ArchiveError) as e:
      if read == "together":
        reads = zeroread.ZeroReads(np.empty(0, np.uint8))
        reads.add(f, src, length, lambda i, pos: _refuse(0, i, pos))
        reads.run()
      else:
        runread.read_runs(
          f,
          [],
          [],
          [],
          None,
          np.empty(0, np.uint8),
          None,
          (src, length),
          lambda i, pos: _refuse(0, i, pos),
        )
    errors.append(str(e.value))
  assert errors[0] == errors[1] == f"file 0: range 0 position {given[0][0] + 1} is not zero bits"
  f.close()
  root.close()


def test_a_restore_names_the_first_archive_of_bad_padding_before_a_later_bad_chunk(tmp_path):
  """The last target rank of 3 checks every all-padding source rank after its
  slots: archives 3-7 for ``p3`` and 5-7 for ``p5`` (3 and 5 elements over 8
  ranks), from which it copies nothing. Nonzero padding in archive 6 and a
  corrupted chunk in archive 7: the padding of archive 6 is named, as when each
  archive's file is read on its own, in archive order."""
  import jax
  import optax

  import jaxreshard as jr
  from tests._archive_util import padding_unchecked
  from tests._core_util import replace_history

  params = {"p3": np.zeros((3,), np.float32), "p5": np.zeros((5,), np.float32)}
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, jax.tree.map(np.asarray, opt.init(params)), world_size=8)

  def pad(a):
    a = np.array(a)
    a.view(np.uint32)[-1] = 0x80000000  # -0.0: bits that are not zero
    return a

  records[6] = replace_history(records[6], "p3", 1, pad)
  with padding_unchecked():
    jr.save_records(tmp_path / "ck", records)
  with pytest.raises(jr.ArchiveError, match=r"param 'p3': history buffer 1 of archive 6 "):
    jr.restore(tmp_path / "ck", world_size=3, rank=2)
  names = sorted(os.listdir(tmp_path / "ck"))
  chunk = os.path.join(tmp_path / "ck", [n for n in names if n.endswith("7")][0], "float32", "c")
  _corrupt(os.path.join(chunk, "0"), 1)
  with pytest.raises(jr.ArchiveError, match=r"param 'p3': history buffer 1 of archive 6 "):
    jr.restore(tmp_path / "ck", world_size=3, rank=2)
  # The chunk alone is refused once the padding is zero again.
  records[6] = replace_history(records[6], "p3", 1, np.zeros_like)
  jr.save_records(tmp_path / "ck2", records)
  names = sorted(os.listdir(tmp_path / "ck2"))
  chunk = os.path.join(tmp_path / "ck2", [n for n in names if n.endswith("7")][0], "float32", "c")
  _corrupt(os.path.join(chunk, "0"), 1)
  with pytest.raises(jr.ArchiveError, match=r"archive 7 .*chunk 0 fails its crc32c check"):
    jr.restore(tmp_path / "ck2", world_size=3, rank=2)


def _chunk1_corrupted(tmp_path, name, size):
  """A float32 file of chunks of one element, element 0 nonzero, chunk 1 corrupted."""
  data = np.zeros(size, np.float32)
  data[0] = 1
  crcs = shardfile.write_array(str(tmp_path), name, data, 1)
  _corrupt(os.path.join(tmp_path, name, "c", "0"), 8)  # chunk 1's first byte
  return crcs


def _both(tmp_path, files):
  """The refusal of ``files`` ``(name, size, chunk, crcs, src, length)`` read together
  and read one by one."""
  root = shardread.Dir.root(str(tmp_path))
  opened = [shardread.ShardFile(root, n, s, np.float32, c, crcs) for n, s, c, crcs, *_ in files]
  got = []
  for way in ("together", "one by one"):
    try:
      reads = zeroread.ZeroReads(np.empty(0, np.uint8))
      for k, (f, (*_, src, length)) in enumerate(zip(opened, files)):
        refuse = lambda i, pos, k=k: _refuse(k, i, pos)  # noqa: E731
        if way == "together":
          reads.add(f, src, length, refuse)
        else:
          runread.read_runs(f, [], [], [], None, np.empty(0, np.uint8), None, (src, length), refuse)
      reads.run()
      got.append("ok")
    except ArchiveError as e:
      got.append(str(e))
  for f in opened:
    f.close()
  root.close()
  return got


def test_an_empty_range_inside_another_makes_the_ranges_overlap(tmp_path):
  """``read_runs`` tells ranges apart with empty ones included: ``[0, 3)`` and an
  empty range at 1 overlap, and are read through the scratch, which checks the
  padding of chunk 0 before reading chunk 1."""
  crcs = _chunk1_corrupted(tmp_path, "b", 4)
  got = _both(tmp_path, [("b", 4, 1, crcs, [0, 1], [3, 0])])
  assert got == ["file 0: range 0 position 0 is not zero bits"] * 2


def test_a_file_read_on_its_own_gets_the_callers_scratch_not_one_grown_before(tmp_path):
  """A first file read together grows the scratch; a second whose ranges overlap is
  read on its own through the scratch it would have had alone (its spans, and so
  the refusal named, depend on that scratch's size)."""
  data = np.zeros(64, np.float32)
  first = shardfile.write_array(str(tmp_path), "a", data, 64)
  crcs = _chunk1_corrupted(tmp_path, "b", 4)
  files = [("a", 64, 64, first, [0], [64]), ("b", 4, 1, crcs, [0, 0], [3, 3])]
  assert _both(tmp_path, files) == ["file 1: range 0 position 0 is not zero bits"] * 2


def _zeros_with(tmp_path, name, stored=(), data=()):
  """64 zero float32 elements in chunks of 8 (a stride of 36 bytes), with the
  checksum stored after each chunk of ``stored`` and the first byte of each chunk
  of ``data`` changed on disk; the recorded checksums are those written."""
  crcs = shardfile.write_array(str(tmp_path), name, np.zeros(64, np.float32), 8)
  path = os.path.join(tmp_path, name, "c", "0")
  for ch in stored:
    _corrupt(path, ch * 36 + 32)
  for ch in data:
    _corrupt(path, ch * 36)
  return crcs


@pytest.mark.parametrize("first_clean", [True, False])
def test_a_stored_checksum_that_is_not_the_recorded_one_is_refused(tmp_path, first_clean):
  """A chunk whose bytes match the recorded crc32c but whose checksum stored in the
  file does not is refused, naming that chunk, by the files read together as by one
  read per file; nonzero padding in a file read before it is named first."""
  a = np.zeros(64, np.float32)
  if not first_clean:
    a[5] = -0.0  # a sign bit: not zero bits
  first = shardfile.write_array(str(tmp_path), "a", a, 8)
  crcs = _zeros_with(tmp_path, "b", stored=[2])
  files = [("a", 64, 8, first, [0], [8]), ("b", 64, 8, crcs, [16, 40], [4, 4])]
  got = _both(tmp_path, files)
  assert got[0] == got[1]
  if first_clean:
    assert got[0].startswith(f"{os.path.join(tmp_path, 'b')}/c/0: chunk 2 fails its crc32c check")
  else:
    assert got[0] == "file 0: range 0 position 5 is not zero bits"


def test_in_one_span_every_chunks_bytes_are_checked_before_the_stored_checksums(tmp_path):
  """Chunk 1's stored checksum and chunk 3's bytes both changed, one range over
  chunks 1-3 (one span): the bytes of every chunk of a span are checked before the
  checksums stored in the file, so both ways of reading name chunk 3. Apart (two
  ranges, chunks 1 and 3 in spans of their own) chunk 1's span comes first."""
  crcs = _zeros_with(tmp_path, "b", stored=[1], data=[3])
  one_span = _both(tmp_path, [("b", 64, 8, crcs, [8], [24])])
  assert one_span[0] == one_span[1]
  assert "chunk 3 fails its crc32c check" in one_span[0]
  apart = _both(tmp_path, [("b", 64, 8, crcs, [8, 24], [2, 2])])
  assert apart[0] == apart[1]
  assert "chunk 1 fails its crc32c check" in apart[0]


def test_a_failing_read_of_files_read_together_names_the_file(tmp_path):
  """An error of the read itself (here: the file's descriptor made to read a
  directory, EISDIR) is raised as an OSError naming the file."""
  with zero_file_reading_a_directory(tmp_path) as f, pytest.raises(OSError) as e:
    reads = zeroread.ZeroReads(np.empty(0, np.uint8))
    reads.add(f, [0], [8], lambda i, pos: _refuse(0, i, pos))
    reads.run()
  assert e.value.errno == errno.EISDIR
  assert e.value.filename == os.path.join(tmp_path, "b")

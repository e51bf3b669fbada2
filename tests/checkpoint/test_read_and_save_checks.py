"""Checks of a checkpoint's readers and of a save that no other test reaches alone: the
padding of an archive of two groups, the staged read's checksums, reads before element
0, values of a table index, a file truncated during a save, and the fsync after the
lock file is unlinked."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import runread, shardfile, shardread, tempdir
from jaxreshard._src.errors import ArchiveError
from tests._archive_util import padding_unchecked
from tests._core_util import adam_records
from tests.checkpoint.test_index_table import _edit_table, _refused_everywhere, ckpt  # noqa: F401
from tests.checkpoint.test_save_liveness import _PausedSave, _temp_dir

# --- padding of an archive that holds params of two groups ---------------------------


def _record(held):
  """A record of 5-element float32 params over 2 ranks: ``held`` maps a param to (rank, mu)."""
  placements = tuple(
    jr.ParamPlacement(p, (5,), r, 2, np.dtype(np.float32), True)
    for p, (r, _) in sorted(held.items())
  )
  state = {"count": np.int32(3), "mu": {p: v for p, (_, v) in held.items()}}
  return jr.ShardRecord(1, placements, state, (None, *sorted(held)))


@pytest.mark.parametrize("read", ["load_records", "restore"])
def test_nonzero_padding_in_an_archive_of_two_groups_is_refused(tmp_path, read):
  """A padding slot holding -0.0 in an archive of two groups is refused as nonzero padding."""
  x, y = np.arange(1, 6, dtype=np.float32), np.arange(10, 15, dtype=np.float32)
  # x's rank 1 holds x[3:5] and one padding slot, whose sign bit is set.
  bad = np.array([x[3], x[4], -0.0], np.float32)
  assert bad.view(np.uint32)[2] == 0x80000000
  records = [
    _record({"x": (1, bad), "y": (0, y[:3])}),  # archive 0: x's group and y's group
    _record({"x": (0, x[:3])}),
    _record({"y": (1, np.array([y[3], y[4], 0], np.float32))}),
  ]
  with padding_unchecked():
    jr.save_records(tmp_path / "t", records)
  with pytest.raises((jr.ArchiveError, jr.PlacementError), match="padding is not zero"):
    if read == "load_records":
      jr.load_records(tmp_path / "t")
    else:
      jr.restore(tmp_path / "t", world_size=1, rank=0)


# --- the staged read path checks both checksums of each chunk ------------------------

DATA = np.arange(1, 101, dtype=np.float32)
CHUNK = 8  # elements; chunk 6 holds elements 48..55


def _open(path, crcs):
  root = shardread.Dir.root(str(path))
  return root, shardread.ShardFile(root, "b", DATA.size, DATA.dtype, CHUNK, crcs)


def _overlapping_read(f) -> np.ndarray:
  """Elements [40, 55) and [45, 60): runs that overlap, read through the scratch."""
  out = np.zeros(30, np.float32)
  runread.read_runs(
    f, np.array([40, 45]), np.array([0, 15]), np.array([15, 15]), out, np.empty(0, np.uint8)
  )
  return out


@pytest.mark.parametrize("damage", ["recorded crc", "stored crc"])
def test_a_staged_read_refuses_a_chunk_whose_recorded_or_stored_crc_differs(tmp_path, damage):
  """A chunk of overlapping runs is refused unless it matches both its recorded crc32c and
  the one stored after it in the file."""
  crcs = shardfile.write_array(str(tmp_path), "b", DATA, CHUNK)
  root, f = _open(tmp_path, crcs)
  try:
    want = np.concatenate([DATA[40:55], DATA[45:60]])
    assert (_overlapping_read(f).view(np.uint32) == want.view(np.uint32)).all()
  finally:
    f.close()
    root.close()
  if damage == "recorded crc":
    crcs = list(crcs)
    crcs[6] ^= 1
  else:
    # A file holds each chunk's bytes followed by its 4-byte crc32c.
    at = 6 * (CHUNK * 4 + 4) + CHUNK * 4
    path = os.path.join(tmp_path, "b", "c", "0")
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
      fh.seek(at)
      b = fh.read(1)[0]
      fh.seek(at)
      fh.write(bytes([b ^ 1]))
  root, f = _open(tmp_path, crcs)
  try:
    with pytest.raises(ArchiveError, match="chunk 6 fails its crc32c check"):
      _overlapping_read(f)
  finally:
    f.close()
    root.close()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_a_read_starting_before_element_0_is_refused(tmp_path, layout):
  """A planned run starting at element -2 lies outside the file and is refused."""
  crcs = shardfile.write_array(str(tmp_path), "b", DATA, CHUNK)
  root, f = _open(tmp_path, crcs)
  out = np.zeros(4, np.float32) if layout == "contiguous" else np.zeros(8, np.float32)[::2]
  try:
    with pytest.raises(ArchiveError, match="lies outside its 100 elements"):
      runread.read_runs(f, np.array([-2]), np.array([0]), np.array([4]), out, np.empty(0, np.uint8))
  finally:
    f.close()
    root.close()
  assert (out.view(np.uint32) == 0).all()


# --- values of a table index ---------------------------------------------------------


def test_a_table_rank_equal_to_the_world_size_is_outside_it(ckpt):  # noqa: F811
  """Rank 4 of a group of world_size 4 lies outside the world and is refused on open."""

  def edit(a, _):
    assert a["group_world"].tolist() == [4]
    a["group_rank"][2] = 4

  _edit_table(ckpt, edit)
  _refused_everywhere(ckpt, "has rank 4, outside world_size 4")


def test_a_table_repeating_a_param_id_is_refused(ckpt):  # noqa: F811
  """Param ids of a table that repeat one (layer00/w twice) are refused on open."""

  def edit(a, _):
    raw = bytes(a["name_bytes"])
    at = raw.index(b"layer01/w") + len("layer0")
    a["name_bytes"][at] = ord("0")  # layer01/w -> layer00/w
    assert bytes(a["name_bytes"]).count(b"layer00/w") == 2

  _edit_table(ckpt, edit)
  _refused_everywhere(ckpt, "not distinct and sorted")


# --- a save ---------------------------------------------------------------------------


def test_a_save_whose_file_was_truncated_meanwhile_commits_nothing(tmp_path):
  """A file of the save cut 4 bytes shorter before the commit fails the save, naming it."""
  save = _PausedSave(tmp_path / "ckpt", adam_records(6), at=4)
  try:
    shard = os.path.join(_temp_dir(tmp_path), "archive_00002", "float32", "c", "0")
    size = os.path.getsize(shard)
    os.chmod(shard, 0o644)
    with open(shard, "r+b") as f:
      f.truncate(size - 4)
  finally:
    save.finish()
  assert isinstance(save.error, jr.ArchiveError), save.error
  assert "was removed or changed while it was written" in str(save.error)
  assert "archive_00002" in str(save.error)
  assert os.listdir(tmp_path) == []


def test_a_durable_save_fsyncs_the_checkpoint_after_unlinking_its_lock_file(tmp_path, monkeypatch):
  """The checkpoint directory is fsync'ed after its lock file is unlinked from it."""
  calls = []
  real_unlink, real_fsync = os.unlink, os.fsync

  def identity(fd):
    try:
      st = os.fstat(fd)
    except (OSError, TypeError):
      return None
    return st.st_dev, st.st_ino

  def unlink(path, *args, **kwargs):
    dir_fd = kwargs.get("dir_fd")
    calls.append(("unlink", os.fspath(path), None if dir_fd is None else identity(dir_fd)))
    return real_unlink(path, *args, **kwargs)

  def fsync(fd):
    calls.append(("fsync", None, identity(fd)))
    return real_fsync(fd)

  monkeypatch.setattr(os, "unlink", unlink)
  monkeypatch.setattr(os, "fsync", fsync)
  out = tmp_path / "ckpt"
  jr.save_records(out, adam_records(2, {"w": ((10,), jnp.float32)}))
  monkeypatch.undo()
  st = os.stat(out)
  final = (st.st_dev, st.st_ino)
  assert not os.path.exists(out / tempdir.LOCK_FILE)
  unlinked = [i for i, c in enumerate(calls) if c == ("unlink", tempdir.LOCK_FILE, final)]
  assert len(unlinked) == 1, calls
  assert ("fsync", None, final) in calls[unlinked[0] + 1 :], calls

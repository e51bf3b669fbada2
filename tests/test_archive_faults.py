"""Checkpoints are untrusted data: every fault is a clear refusal, never a crash or a wrong answer."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

import jaxreshard as jr
from tests._archive_util import adam_records, buffer_file, file_hashes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ckpt(tmp_path):
  path = tmp_path / "ckpt"
  jr.save_records(path, adam_records(4), chunk_bytes=8)
  return path


def _edit_json(path, fn):
  data = json.loads(open(path).read())
  fn(data)
  with open(path, "w") as f:
    json.dump(data, f)


def _record_json(ckpt, archive=0):
  return ckpt / f"archive_{archive:05d}" / "record.json"


def _both(ckpt):
  """load_records and restore, the two ways into a checkpoint."""
  return [lambda: jr.load_records(ckpt), lambda: jr.restore(ckpt, 0, 3)]


def test_missing_checkpoint_names_the_path(tmp_path):
  for fn in _both(tmp_path / "nowhere"):
    with pytest.raises(FileNotFoundError, match="nowhere"):
      fn()


def test_not_a_jaxreshard_checkpoint(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "file").write_text("hello")
  for path in (tmp_path / "empty", tmp_path / "file"):
    for fn in _both(path):
      with pytest.raises(jr.ArchiveError, match="not a jaxreshard checkpoint"):
        fn()
  (tmp_path / "foreign").mkdir()
  (tmp_path / "foreign" / "jaxreshard.json").write_text('{"format": "something else"}')
  with pytest.raises(jr.ArchiveError, match="does not describe"):
    jr.load_records(tmp_path / "foreign")


def test_missing_rank_archive(ckpt):
  shutil.rmtree(ckpt / "archive_00002")
  for fn in _both(ckpt):
    with pytest.raises(jr.ArchiveError, match="archive_00002"):
      fn()


def test_archive_dropped_from_the_index_is_an_incomplete_group(ckpt):
  _edit_json(ckpt / "jaxreshard.json", lambda d: d["archives"].remove("archive_00002"))
  with pytest.raises(jr.PlacementError, match="missing ranks"):
    jr.restore(ckpt, 0, 3)


def test_archives_from_different_steps(tmp_path):
  jr.save_records(tmp_path / "a", adam_records(4, seed=1))
  other = adam_records(4, seed=1)
  other = [jr.ShardRecord(r.version, r.placements,
                          (r.state[0]._replace(count=r.state[0].count + 1),) + r.state[1:],
                          r.roles) for r in other]
  jr.save_records(tmp_path / "b", other)
  shutil.rmtree(tmp_path / "a" / "archive_00003")
  shutil.copytree(tmp_path / "b" / "archive_00003", tmp_path / "a" / "archive_00003")
  with pytest.raises(jr.PlacementError, match="not one checkpoint"):
    jr.restore(tmp_path / "a", 1, 3)


def test_archive_of_another_version(ckpt):
  _edit_json(_record_json(ckpt, 1), lambda d: d.update(version=2))
  for fn in _both(ckpt):
    with pytest.raises(jr.PlacementError, match="version 2"):
      fn()


def test_truncated_array_file(ckpt):
  path = buffer_file(ckpt, 1)
  os.truncate(path, os.path.getsize(path) - 7)
  for fn in _both(ckpt):
    with pytest.raises(jr.ArchiveError, match="truncated"):
      fn()


@pytest.mark.parametrize("offset", [0, 5, -30, -1])  # data, data, index, index checksum
def test_corrupted_array_file(ckpt, offset):
  path = buffer_file(ckpt, 0)
  with open(path, "r+b") as f:
    f.seek(offset % os.path.getsize(path))
    byte = f.read(1)
    f.seek(offset % os.path.getsize(path))
    f.write(bytes([byte[0] ^ 0x10]))
  for fn in _both(ckpt):
    with pytest.raises(jr.ArchiveError, match="corrupted"):
      fn()


def test_missing_and_garbage_array_metadata(ckpt):
  zarr = os.path.join(os.path.dirname(os.path.dirname(buffer_file(ckpt, 0))), "zarr.json")
  with open(zarr, "w") as f:
    f.write("{not json")
  for fn in _both(ckpt):
    with pytest.raises(jr.ArchiveError, match="cannot open"):
      fn()
  os.remove(buffer_file(ckpt, 2))
  with pytest.raises(jr.ArchiveError, match="missing"):
    jr.load_records(ckpt)


def test_garbage_record_metadata(ckpt):
  _record_json(ckpt, 0).write_text('{"format": NaN}')
  with pytest.raises(jr.ArchiveError, match="not valid JSON"):
    jr.load_records(ckpt)
  _record_json(ckpt, 0).write_bytes(b"\xff\xfe")
  with pytest.raises(jr.ArchiveError, match="UTF-8"):
    jr.load_records(ckpt)


def test_huge_shape_in_metadata_is_refused_not_allocated(ckpt):
  def huge(d):
    # Consistent metadata (placement and buffers agree): only the files disagree.
    pid = d["placements"][0]["param"]
    d["placements"][0]["shape"] = [2**40]
    for leaf, role in zip(d["leaves"], d["roles"]):
      if role == pid:
        leaf["buffer"]["shape"] = [2**38]

  for i in range(4):
    _edit_json(_record_json(ckpt, i), huge)
  for fn in _both(ckpt):
    with pytest.raises(jr.ArchiveError, match="truncated or not from this checkpoint"):
      fn()


def test_unknown_dtype_and_bad_scalars(ckpt):
  def bad_dtype(d):
    next(x for x in d["leaves"] if "buffer" in x)["buffer"]["dtype"] = "object"

  _edit_json(_record_json(ckpt, 0), bad_dtype)
  with pytest.raises(jr.ArchiveError, match="dtype 'object'"):
    jr.load_records(ckpt)


def test_scalar_bytes_must_match_their_shape(ckpt):
  def bad(d):
    next(x for x in d["leaves"] if "scalar" in x)["scalar"]["shape"] = [100000]

  _edit_json(_record_json(ckpt, 0), bad)
  with pytest.raises(jr.ArchiveError, match="does not match"):
    jr.load_records(ckpt)


@pytest.mark.parametrize("name", ["../../etc", "/etc/passwd", "b00001/../../x", "b1"])
def test_path_traversal_buffer_name(ckpt, name):
  def evil(d):
    next(x for x in d["leaves"] if "buffer" in x)["buffer"]["name"] = name

  _edit_json(_record_json(ckpt, 0), evil)
  with pytest.raises(jr.ArchiveError, match="not a valid name"):
    jr.load_records(ckpt)


def test_path_traversal_archive_name_and_symlink(ckpt, tmp_path):
  index = ckpt / "jaxreshard.json"
  original = index.read_text()
  _edit_json(index, lambda d: d["archives"].__setitem__(0, "../outside"))
  with pytest.raises(jr.ArchiveError, match="not a valid name"):
    jr.load_records(ckpt)
  index.write_text(original)
  shutil.move(ckpt / "archive_00000", tmp_path / "elsewhere")
  os.symlink(tmp_path / "elsewhere", ckpt / "archive_00000")
  with pytest.raises(jr.ArchiveError, match="outside the checkpoint"):
    jr.load_records(ckpt)


def test_buffer_directory_that_is_a_symlink_is_refused(ckpt, tmp_path):
  archive = ckpt / "archive_00000"
  buffer = sorted(p for p in archive.iterdir() if p.is_dir())[0]
  shutil.move(buffer, tmp_path / "elsewhere")
  os.symlink(tmp_path / "elsewhere", buffer)
  with pytest.raises(jr.ArchiveError, match="symbolic link"):
    jr.load_records(ckpt)
  with pytest.raises(jr.ArchiveError, match="symbolic link"):
    jr.restore(ckpt, rank=0, world_size=3)


def test_namedtuple_of_a_foreign_module_is_never_looked_up(ckpt):
  def foreign(d):
    node = d["tree"]["c"][0]  # ScaleByAdamState
    node["m"], node["n"] = "os", "system"

  _edit_json(_record_json(ckpt, 0), foreign)
  records = jr.load_records(ckpt)
  cls = type(records[0].state[0])
  assert cls.__name__ == "system" and cls.__module__ != "os" and issubclass(cls, tuple)


def test_existing_output_is_refused_and_untouched(ckpt):
  before = file_hashes(ckpt)
  with pytest.raises(jr.ArchiveExistsError, match="already exists"):
    jr.save_records(ckpt, adam_records(2))
  assert file_hashes(ckpt) == before


def test_inputs_unchanged_by_loads_restores_and_refusals(ckpt):
  before = file_hashes(ckpt)
  jr.load_records(ckpt)
  jr.restore(ckpt, 2, 3)
  with pytest.raises(jr.PlacementError):
    jr.restore(ckpt, 5, 3)
  assert file_hashes(ckpt) == before


_KILLED_SAVE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import jaxreshard as jr
    from tests._archive_util import adam_records

    def slow():
      for i, r in enumerate(adam_records(6)):
        if i == 2:
          print("two written", flush=True)
          time.sleep(60)  # killed here, mid-save
        yield r

    jr.save_records({out!r}, slow(), chunk_bytes=8)
""")


def test_killed_save_leaves_nothing_loadable_and_a_rerun_succeeds(tmp_path):
  out = str(tmp_path / "out")
  proc = subprocess.Popen(
      [sys.executable, "-c", _KILLED_SAVE.format(root=ROOT, out=out)],
      stdout=subprocess.PIPE, cwd=ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    assert proc.stdout.readline().strip() == b"two written"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  assert not os.path.exists(out)
  with pytest.raises(FileNotFoundError):
    jr.load_records(out)
  (leftover,) = glob.glob(str(tmp_path / ".out.tmp-*"))
  assert os.path.isdir(os.path.join(leftover, "archive_00001"))
  with pytest.raises(jr.ArchiveError, match="not a jaxreshard checkpoint"):
    jr.load_records(leftover)
  records = adam_records(6)
  jr.save_records(out, records, chunk_bytes=8)
  assert len(jr.load_records(out)) == 6

"""Checkpoints are untrusted data: every fault is a clear refusal, never a crash or a wrong answer.

A checkpoint (format version 3) is ``jaxreshard.json`` (the index) plus one
``archive_NNNNN/`` per source rank holding ``archive.json`` and, per dtype, a
zarr v3 array ``DTYPE/zarr.json`` + ``DTYPE/c/0`` (the shard file: chunks with
their crc32c, then the shard index and its crc32c). Every test damages a real
save and checks the exact refusal of ``load_records`` and of ``restore``.
"""

import base64
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import google_crc32c
import jax
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.checkpoint.reader import open_checkpoint
from tests._archive_util import (
  file_hashes,
  read_json,
  shard_file,
  write_consistent_index,
  write_signed_json,
)
from tests._core_util import adam_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A refusal takes milliseconds; a reader that needs longer than this hangs.
PATIENCE_S = 20.0
# Refusing a metadata bomb allocates nothing near the sizes it claims: metadata
# is read up to its file's size, buffers only after their files are checked.
MAX_TRACED_BYTES = 64 << 20
HUGE = 2**40


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  path = tmp_path_factory.mktemp("pristine") / "ckpt"
  jr.save_records(path, adam_records(4), chunk_bytes=8)
  return path


@pytest.fixture
def ckpt(pristine, tmp_path):
  """A private copy of a 4-rank Adam checkpoint, 2 elements per float32 chunk."""
  path = tmp_path / "ckpt"
  shutil.copytree(pristine, path)
  return path


# --- helpers ------------------------------------------------------------------


_read_json = read_json


def _write_json(path, data):
  """The index and archive.json are signed (re-signed after an edit); zarr.json is plain."""
  if os.path.basename(path) == "zarr.json":
    with open(path, "w") as f:
      json.dump(data, f)
  else:
    write_signed_json(path, data)


def _edit_json(path, fn):
  data = _read_json(path)
  fn(data)
  _write_json(path, data)


def _index(ckpt):
  return ckpt / "jaxreshard.json"


def _edit_index_consistently(ckpt, fn):
  """An index edit that every archive.json is re-signed to agree with."""
  data = _read_json(_index(ckpt))
  fn(data)
  write_consistent_index(ckpt, data)


def _archive_json(ckpt, archive):
  return ckpt / f"archive_{archive:05d}" / "archive.json"


def _zarr_json(ckpt, archive, dtype="float32"):
  return ckpt / f"archive_{archive:05d}" / dtype / "zarr.json"


def _param(index, pid):
  return next(e for e in index["params"] if e[0] == pid)


def _load(path):
  return jr.load_records(path)


def _restore_all(path):
  """Every target rank of world size 3: together they read every source archive."""
  return [jr.restore(path, world_size=3, rank=r) for r in range(3)]


READERS = {"load_records": _load, "restore": _restore_all}


def _both(path):
  """load_records and restore, the two ways into a checkpoint."""
  return [lambda: _load(path), lambda: _restore_all(path)]


def _refused(fn, error, *patterns):
  """``fn()`` raises ``error`` whose message matches every regex of ``patterns``."""
  with pytest.raises(error) as info:
    fn()
  for p in patterns:
    assert re.search(p, str(info.value)), f"{p!r} not in {str(info.value)!r}"
  return info.value


def _outcome(fn, seconds=PATIENCE_S, unblock=None):
  """What ``fn()`` raises (None when it returns), run in a thread: a hang fails the test."""
  box = {}

  def run():
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects whatever it is
      box["error"] = e

  worker = threading.Thread(target=run, daemon=True)
  worker.start()
  worker.join(seconds)
  if worker.is_alive():
    if unblock is not None:
      unblock()
    pytest.fail(f"still running after {seconds} s: the reader hangs")
  return box.get("error")


def _quick_refusal(fn, error, *patterns):
  """``fn()`` raises ``error`` (matching ``patterns``) quickly, allocating little."""
  tracemalloc.start()
  try:
    e = _outcome(fn)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert isinstance(e, error), f"expected {error.__name__}, got {e!r}"
  for p in patterns:
    assert re.search(p, str(e)), f"{p!r} not in {str(e)!r}"
  assert peak < MAX_TRACED_BYTES, f"{peak} bytes allocated to refuse a metadata bomb"


def _same(a, b):
  """Two lists of records are equal bit for bit (tree, placements, leaf bytes and dtypes)."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.version == y.version and x.placements == y.placements and x.roles == y.roles
    assert jax.tree.structure(x.state) == jax.tree.structure(y.state)
    for u, v in zip(jax.tree.leaves(x.state), jax.tree.leaves(y.state)):
      u, v = np.asarray(u), np.asarray(v)
      assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes()


def _flip_bit(path, offset, bit=4):
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ (1 << bit)]))


def _shard_geometry(ckpt, archive, dtype="float32"):
  """(chunks, bytes per chunk with its crc32c, offset of the shard index) of a shard file."""
  b = _read_json(_archive_json(ckpt, archive))["buffers"][dtype]
  n = -(-b["elements"] // b["chunk"])
  stride = b["chunk"] * jax.numpy.dtype(dtype).itemsize + _shardfile.CRC_BYTES
  return n, stride, n * stride


def _xor_buffers(records):
  """The same records (same step, same structure) with the bits of every element a
  rank owns changed (padding stays zero: a save refuses anything else)."""
  out = []
  for r in records:
    leaves, tree = jax.tree.flatten(r.state)
    changed = []
    for leaf, role in zip(leaves, r.roles):
      if role is not None:
        p = r.placement(role)
        owned = jr.FlatShard(p.shape, p.rank, p.world_size).owned
        bits = np.array(leaf).view(f"u{np.dtype(leaf.dtype).itemsize}")
        bits[:owned] ^= 1
        leaf = bits.view(leaf.dtype)
      changed.append(leaf)
    out.append(jr.ShardRecord(r.version, r.placements, jax.tree.unflatten(tree, changed), r.roles))
  return out


# --- not a checkpoint, missing pieces -----------------------------------------


def test_missing_checkpoint_names_the_path(tmp_path):
  for fn in _both(tmp_path / "nowhere"):
    _refused(fn, FileNotFoundError, "nowhere")


def test_not_a_jaxreshard_checkpoint(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "file").write_text("hello")
  for path in (tmp_path / "empty", tmp_path / "file"):
    for fn in _both(path):
      _refused(fn, jr.ArchiveError, re.escape(str(path)), "not a jaxreshard checkpoint")
  (tmp_path / "foreign").mkdir()
  for text in ('{"format": "something else"}', "[]", "0"):
    (tmp_path / "foreign" / "jaxreshard.json").write_text(text)
    for fn in _both(tmp_path / "foreign"):
      _refused(fn, jr.ArchiveError, "jaxreshard.json does not describe a jaxreshard-checkpoint")


def test_the_root_itself_may_be_a_symlink(ckpt, tmp_path):
  link = tmp_path / "link"
  os.symlink(ckpt, link)
  _same(jr.load_records(link), jr.load_records(ckpt))
  _same([jr.restore(link, world_size=3, rank=1)], [jr.restore(ckpt, world_size=3, rank=1)])


def test_missing_rank_archive(ckpt):
  shutil.rmtree(ckpt / "archive_00002")
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(ckpt / "archive_00002")) + " is missing")


@pytest.mark.parametrize(
  "entry",
  [
    "archive_00002/archive.json",
    "archive_00002/float32",
    "archive_00002/float32/zarr.json",
    "archive_00002/float32/c",
    "archive_00002/float32/c/0",
  ],
)
def test_missing_file_of_an_archive(ckpt, entry):
  path = ckpt / entry
  if path.is_dir():
    shutil.rmtree(path)
  else:
    path.unlink()
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(path)) + " is missing")


@pytest.mark.parametrize("then", ["removed", "replaced"])
def test_a_checkpoint_removed_or_replaced_after_it_was_opened_is_named_so(tmp_path, then):
  """An opened checkpoint reads below the directory it opened; once that directory is
  removed (and another checkpoint saved at its path), its archives are gone: the
  refusal says the checkpoint changed since it was opened, not that an archive of it
  'is missing'. Opened again, the new checkpoint reads."""
  path = tmp_path / "ck"
  jr.save_records(path, adam_records(2, seed=0))
  opened = jr.open_checkpoint(path)
  shutil.rmtree(path)
  words = "removed and another is at its path now" if then == "replaced" else "removed"
  if then == "replaced":
    jr.save_records(path, adam_records(2, seed=1))
  needle = (
    f"archive 0: {path} changed since the checkpoint was opened: that directory was {words},"
    " so its archive_00000 cannot be read; open the checkpoint again to read what is there now"
  )
  for fn in (
    lambda: jr.restore_ranks(path, [0], world_size=3, checkpoint=opened),
    lambda: opened.record(0),
  ):
    _refused(fn, jr.ArchiveError, re.escape(needle))
  if then == "replaced":
    again = jr.restore_ranks(path, [0], world_size=3, checkpoint=jr.open_checkpoint(path))
    _same(again, jr.restore_ranks(path, [0], world_size=3))


def test_missing_index_is_an_unfinished_save(ckpt):
  (ckpt / "jaxreshard.json").unlink()
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, "not a jaxreshard checkpoint", "no jaxreshard.json")


def test_archive_dropped_from_the_index_is_an_incomplete_group(ckpt):
  def drop(d):
    del d["archives"][2]
    for g in d["groups"]:
      g["ranks"] = [[a - 1 if a > 2 else a, r] for a, r in g["ranks"] if a != 2]

  _edit_json(_index(ckpt), drop)
  _refused(
    lambda: jr.restore(ckpt, world_size=3, rank=0),
    jr.PlacementError,
    r"world_size 4; missing ranks \[2\]",
  )


# --- archives that do not belong to this checkpoint ---------------------------


def test_archive_of_a_later_step_is_refused(tmp_path):
  jr.save_records(tmp_path / "a", adam_records(4, seed=1), chunk_bytes=8)
  later = [
    jr.ShardRecord(
      r.version,
      r.placements,
      (r.state[0]._replace(count=r.state[0].count + 1),) + r.state[1:],
      r.roles,
    )
    for r in adam_records(4, seed=1)
  ]
  jr.save_records(tmp_path / "b", later, chunk_bytes=8)
  ids = [_read_json(tmp_path / x / "jaxreshard.json")["checkpoint"] for x in "ab"]
  shutil.rmtree(tmp_path / "a" / "archive_00003")
  shutil.copytree(tmp_path / "b" / "archive_00003", tmp_path / "a" / "archive_00003")
  for fn in _both(tmp_path / "a"):
    _refused(
      fn,
      jr.ArchiveError,
      "archive_00003",
      f"belongs to checkpoint '{ids[1]}'",
      f"not to this checkpoint '{ids[0]}'",
    )


def test_archives_with_different_clocks_are_not_one_checkpoint(ckpt):
  def later_clock(d):
    count = dict(d["clocks"][0][0], bytes="0wQAAA==")  # int32 1235, one step after 1234
    d["clocks"].append([count])
    d["archives"][3][2] = 1

  _edit_json(_index(ckpt), later_clock)
  _refused(lambda: _restore_all(ckpt), jr.PlacementError, "1235", "1234", "not one checkpoint")


def test_archive_of_another_save_of_the_same_records(tmp_path):
  records = adam_records(4)
  jr.save_records(tmp_path / "a", records, chunk_bytes=8)
  jr.save_records(tmp_path / "b", records, chunk_bytes=8)
  ids = [_read_json(tmp_path / x / "jaxreshard.json")["checkpoint"] for x in "ab"]
  assert ids[0] != ids[1]
  # Bit-identical data: only the checkpoint identity tells the two saves apart.
  assert file_hashes(tmp_path / "a" / "archive_00002" / "float32") == file_hashes(
    tmp_path / "b" / "archive_00002" / "float32"
  )
  shutil.rmtree(tmp_path / "a" / "archive_00002")
  shutil.copytree(tmp_path / "b" / "archive_00002", tmp_path / "a" / "archive_00002")
  for fn in _both(tmp_path / "a"):
    _refused(
      fn,
      jr.ArchiveError,
      re.escape(str(tmp_path / "a" / "archive_00002")),
      f"belongs to checkpoint '{ids[1]}'",
      f"not to this checkpoint '{ids[0]}'",
    )


def test_buffer_files_of_another_checkpoint(tmp_path):
  records = adam_records(4)
  jr.save_records(tmp_path / "a", records, chunk_bytes=8)
  jr.save_records(tmp_path / "b", _xor_buffers(records), chunk_bytes=8)
  target = tmp_path / "a" / "archive_00002" / "float32"
  # Same sizes and chunking (zarr.json is identical), different bits.
  assert _zarr_json(tmp_path / "a", 2).read_bytes() == _zarr_json(tmp_path / "b", 2).read_bytes()
  shutil.rmtree(target)
  shutil.copytree(tmp_path / "b" / "archive_00002" / "float32", target)
  # The first chunk read fails: chunk 0 for a whole read; a restore may first read
  # the padding of a param whose elements all lie on an earlier rank.
  for fn in _both(tmp_path / "a"):
    _refused(
      fn, jr.ArchiveError, re.escape(str(target / "c" / "0")), "chunk [0-9]+ fails its crc32c"
    )


def test_swapped_buffer_directories_of_one_checkpoint(ckpt, tmp_path):
  a0, a1 = ckpt / "archive_00000" / "float32", ckpt / "archive_00001" / "float32"
  shutil.move(a0, tmp_path / "swap")
  shutil.move(a1, a0)
  shutil.move(tmp_path / "swap", a1)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(a0 / "c" / "0")), "fails its crc32c check")


def test_swapped_archives_of_one_checkpoint(ckpt, tmp_path):
  a1, a2 = ckpt / "archive_00001", ckpt / "archive_00002"
  shutil.move(a1, tmp_path / "swap")
  shutil.move(a2, a1)
  shutil.move(tmp_path / "swap", a2)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(a1)), "names archive 'archive_00002'")


# --- versions -----------------------------------------------------------------


def test_index_of_format_version_1(ckpt):
  _write_json(
    _index(ckpt),
    {
      "format": "jaxreshard-checkpoint",
      "format_version": 1,
      "archives": [f"archive_{i:05d}" for i in range(4)],
    },
  )
  for fn in _both(ckpt) + [lambda: open_checkpoint(ckpt)]:
    _refused(
      fn,
      jr.ArchiveError,
      re.escape(str(_index(ckpt))),
      "version 1 is not supported",
      "reads versions 3 and 4",
    )


@pytest.mark.parametrize("version", [5, 2, 0, "3", None])
def test_index_of_an_unsupported_version(ckpt, version):
  _edit_json(_index(ckpt), lambda d: d.update(format_version=version))
  for fn in _both(ckpt):
    _refused(
      fn,
      jr.ArchiveError,
      f"format version {re.escape(repr(version))} is not supported",
      "reads versions 3 and 4",
    )


@pytest.mark.parametrize("version", [1, 2, 3, 5, "4"])
def test_archive_of_an_unsupported_version(ckpt, version):
  _edit_json(_archive_json(ckpt, 1), lambda d: d.update(format_version=version))
  for fn in _both(ckpt):
    _refused(
      fn,
      jr.ArchiveError,
      "archive_00001",
      f"archive format version {re.escape(repr(version))} is not supported",
    )


def test_record_of_another_version(ckpt):
  _edit_json(_index(ckpt), lambda d: d.update(record_version=2))
  for fn in _both(ckpt):
    _refused(fn, jr.PlacementError, "record version 2 is not supported")


# --- garbage metadata ---------------------------------------------------------

_METADATA = {
  "index": lambda c: _index(c),
  "archive.json": lambda c: _archive_json(c, 1),
  "zarr.json": lambda c: _zarr_json(c, 1),
}


@pytest.mark.parametrize(
  "content, message",
  [
    (b'{"format": NaN}', "not valid JSON"),
    (b"{not json", "not valid JSON"),
    (b'{"format": 1, "format": 2}', "duplicate key 'format'"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON|more than its metadata can have"),
  ],
)
@pytest.mark.parametrize("which", sorted(_METADATA))
def test_garbage_metadata(ckpt, which, content, message):
  path = _METADATA[which](ckpt)
  path.write_bytes(content)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(path)), message)


@pytest.mark.parametrize("which", sorted(_METADATA))
def test_metadata_file_too_large_is_refused_unread(ckpt, which):
  path = _METADATA[which](ckpt)
  os.truncate(path, 1 << 40)  # sparse: a terabyte that occupies nothing
  try:
    for fn in _both(ckpt):
      _quick_refusal(fn, jr.ArchiveError, re.escape(str(path)), "more than its metadata can have")
  finally:
    path.unlink()


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda d: d.update(extra=1), "unexpected index keys"),
    (lambda d: d.pop("clocks"), "unexpected index keys"),
    (lambda d: d.update(checkpoint="../../etc"), "invalid checkpoint identity"),
    (lambda d: d.update(checkpoint=7), "invalid checkpoint identity"),
    (lambda d: d.update(archives=[]), "the archive list is empty"),
    (
      lambda d: d["archives"].__setitem__(1, ["archive_00001", 0]),
      r"expected \[name, layout, clock\]",
    ),
    (lambda d: d["archives"][1].__setitem__(1, 5), "layout 5 or clock 0 does not exist"),
    (lambda d: d["archives"][1].__setitem__(2, -1), "layout 0 or clock -1 does not exist"),
    (
      lambda d: d["archives"].__setitem__(1, list(d["archives"][0])),
      "the archive list has repeats",
    ),
    (lambda d: d["groups"][0]["params"].append(99), "a param index is out of range"),
    (lambda d: d["groups"][0]["params"].append(0), "group 0 lists a param twice"),
    (lambda d: d["groups"][0]["ranks"].append([7, 0]), "archive 7 does not exist"),
    (
      # One archive at every rank: refused before any work per (rank, param).
      lambda d: d["groups"][0].update(ranks=[[0, r] for r in range(4)]),
      r"group 0: archive 0 \(archive_00000\) is listed twice",
    ),
    (lambda d: d["groups"][0].update(world_size=True), "expected int, got bool"),
    (lambda d: d["layouts"][0]["leaves"].__setitem__(0, {"s": 1}), "numbered in order"),
    (lambda d: d["layouts"][0]["leaves"][1].__setitem__(2, -1), "-1 slots is not a buffer size"),
    (lambda d: d["layouts"][0]["leaves"][1].__setitem__(2, 2**63), "slots is not a buffer size"),
    (lambda d: d["clocks"].__setitem__(0, []), "its clock has 0 scalars but its layout 1"),
    # Clocks no archive has cost a device array per scalar to decode: refused first.
    (lambda d: d["clocks"].append(list(d["clocks"][0])), "clock 1: no archive has it"),
    (
      lambda d: d["clocks"].__setitem__(0, [{"py": "int", "v": 0}] * (1 << 16 | 1)),
      "more than an optimizer has",
    ),
  ],
)
def test_malformed_index(ckpt, edit, message):
  _edit_json(_index(ckpt), edit)
  for fn in _both(ckpt) + [lambda: open_checkpoint(ckpt)]:
    _refused(fn, jr.ArchiveError, message)


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda d: d.update(extra=1), "does not describe a jaxreshard-checkpoint archive"),
    (lambda d: d.pop("buffers"), "does not describe a jaxreshard-checkpoint archive"),
    (lambda d: d.update(format="zarr"), "does not describe a jaxreshard-checkpoint archive"),
    (lambda d: d.update(archive="archive_00002"), "names archive 'archive_00002'"),
    (lambda d: d["buffers"].pop("float16"), "holds buffers .* but its layout needs"),
    (
      lambda d: d["buffers"]["float32"].update(elements=25),
      "holds buffers .* but its layout needs",
    ),
    (lambda d: d["buffers"]["float32"].update(elements=-24), "invalid chunking or checksums"),
    (lambda d: d["buffers"]["float32"].update(chunk=0), "invalid chunking or checksums"),
    (lambda d: d["buffers"]["float32"].update(chunk=25), "invalid chunking or checksums"),
    (lambda d: d["buffers"]["float32"]["crc32c"].__setitem__(0, 2**32), "invalid chunking"),
    (lambda d: d["buffers"]["float32"]["crc32c"].__setitem__(0, True), "invalid chunking"),
    (lambda d: d["buffers"]["float32"]["crc32c"].pop(), "records 11 chunk checksums for 12"),
    (lambda d: d["buffers"]["float32"].update(chunk=3), "records 12 chunk checksums for 8"),
    (
      lambda d: d["buffers"]["float32"].update(chunk=3, crc32c=[0] * 8),
      r"does not describe float32\[24\] in chunks of 3",
    ),
    (lambda d: d["buffers"]["float32"].pop("crc32c"), "expected elements, chunk and crc32c"),
  ],
)
def test_malformed_archive_metadata(ckpt, edit, message):
  _edit_json(_archive_json(ckpt, 1), edit)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, "archive_00001", message)


# --- sizes: refused before anything is allocated -------------------------------


def _claim_huge(ckpt, elements_by_archive):
  """archive.json and zarr.json of float32 describe ``elements`` in one chunk."""
  for a, n in elements_by_archive.items():

    def huge(d, n=n):
      d["buffers"]["float32"].update(elements=n, chunk=n, crc32c=[0])

    _edit_json(_archive_json(ckpt, a), huge)
    _write_json(_zarr_json(ckpt, a), _shardfile.zarr_metadata(n, np.dtype("float32"), n))


def _huge_layout(d):
  """The index claims a ``[2**40]`` kernel: ``2**38`` slots per rank, consistently."""
  _param(d, "dense/kernel")[1] = [HUGE]
  for leaf in d["layouts"][0]["leaves"]:
    if isinstance(leaf, list) and leaf[0] == "dense/kernel":
      leaf[2] = HUGE // 4


@pytest.mark.parametrize("reader", sorted(READERS))
def test_sparse_file_matching_metadata_that_disagrees_with_the_layout(ckpt, reader):
  # archive.json, zarr.json and the (sparse) file agree on 2**40 elements; the
  # index's layout needs 24: the layout wins before anything is allocated.
  _claim_huge(ckpt, {2: HUGE})
  path = shard_file(ckpt, 2)
  os.truncate(path, _shardfile.file_size(HUGE, 4, HUGE))
  try:
    _quick_refusal(
      lambda: READERS[reader](ckpt),
      jr.ArchiveError,
      "archive_00002",
      "'float32': 1099511627776",
      "but its layout needs",
      "'float32': 24",
    )
  finally:
    os.unlink(path)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_huge_shape_in_the_index_only_is_refused_not_allocated(ckpt, reader):
  _edit_index_consistently(ckpt, _huge_layout)
  _quick_refusal(
    lambda: READERS[reader](ckpt),
    jr.ArchiveError,
    "archive_0000",
    "but its layout needs",
    str(2 * (HUGE // 4) + 6),
  )


def test_huge_shape_in_the_index_at_metadata_level(ckpt):
  _edit_index_consistently(ckpt, _huge_layout)
  c = open_checkpoint(ckpt)
  assert c.complete_groups()  # shapes alone are no fault
  _quick_refusal(
    lambda: c.archive_meta(0), jr.ArchiveError, "archive_00000", "but its layout needs"
  )


@pytest.mark.parametrize("reader", ["load_records", "restore"])
def test_huge_shape_in_consistent_metadata_is_refused_not_allocated(ckpt, reader):
  # Index, archive.json and zarr.json agree on a [2**40] kernel; only the files disagree.
  _edit_index_consistently(ckpt, _huge_layout)
  _claim_huge(ckpt, {a: 2 * (HUGE // 4) + 6 for a in range(4)})
  _quick_refusal(
    lambda: READERS[reader](ckpt),
    jr.ArchiveError,
    "c/0 has 340 bytes",
    "truncated or not from this checkpoint",
  )


@pytest.mark.parametrize(
  "shape",
  [
    [2**62, 4],
    [-1],
    [2**31, 2**31, 2**31],
    # Empty, yet no array holds them: numpy multiplies the nonzero dimensions.
    [2**70, 0],
    [2**60, 0],
    [2**40, 2**40, 0],
    [1] * 64 + [0],
    [1] * 65,
  ],
)
def test_impossible_shape_in_the_index(ckpt, shape):
  _edit_json(_index(ckpt), lambda d: _param(d, "dense/bias").__setitem__(1, shape))
  for fn in _both(ckpt):
    _quick_refusal(fn, jr.ArchiveError, "param 0", "is not a valid array shape")


def test_buffers_whose_sizes_add_up_past_an_array_are_refused(ckpt):
  # Each history buffer of a valid size, but one dtype's add up past any array
  # (at 2**64 the int64 sum wraps to the size on disk): refused as the index is parsed.
  big = 2**58

  def edit(d):
    for pid in ("dense/bias", "dense/kernel"):
      _param(d, pid)[1] = [big]
    for leaf in d["layouts"][0]["leaves"]:
      if isinstance(leaf, list) and leaf[0] in ("dense/bias", "dense/kernel"):
        leaf[2] = big

  _edit_index_consistently(ckpt, edit)
  for fn in [*_both(ckpt), lambda: open_checkpoint(ckpt)]:
    _quick_refusal(
      fn, jr.ArchiveError, r"float32 buffers of a layout add up to 1152921504606846\d\d\d "
    )


def _metadata_readers(ckpt):
  """The two readers, and the index alone with its groups checked."""
  return {
    "open_checkpoint": lambda: open_checkpoint(ckpt).complete_groups(),
    **{k: lambda f=f: f(ckpt) for k, f in READERS.items()},
  }


def _huge_world_size(d):
  d["groups"][0]["world_size"] = 10**12


def _huge_rank(d):
  d["groups"][0]["ranks"][3][1] = 10**12


def _huge_param_shape(d):
  _param(d, "dense/kernel")[1] = [HUGE]  # the layout keeps its 9 slots per rank


@pytest.mark.parametrize("edit", [_huge_world_size, _huge_rank, _huge_param_shape])
@pytest.mark.parametrize("reader", ["load_records", "restore", "open_checkpoint"])
def test_huge_geometry_in_the_index_finishes_quickly(ckpt, reader, edit):
  # Whatever the answer, it comes at once, allocates nothing near the claimed
  # sizes and is no other error than a refusal.
  _edit_json(_index(ckpt), edit)
  tracemalloc.start()
  try:
    e = _outcome(_metadata_readers(ckpt)[reader])
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert e is None or isinstance(e, jr.ReshardError), repr(e)
  assert peak < MAX_TRACED_BYTES, f"{peak} bytes allocated for a metadata bomb"


@pytest.mark.parametrize("reader", ["load_records", "restore", "open_checkpoint"])
def test_huge_world_size_in_a_group(ckpt, reader):
  _edit_json(_index(ckpt), _huge_world_size)
  _quick_refusal(_metadata_readers(ckpt)[reader], jr.ReshardError, "world_size 1000000000000")


@pytest.mark.parametrize("reader", ["load_records", "restore", "open_checkpoint"])
def test_huge_rank_in_a_group(ckpt, reader):
  _edit_json(_index(ckpt), _huge_rank)
  _quick_refusal(_metadata_readers(ckpt)[reader], jr.ReshardError, "1000000000000")


@pytest.mark.parametrize("reader", ["load_records", "restore"])
def test_huge_shape_that_disagrees_with_the_layout(ckpt, reader):
  _edit_json(_index(ckpt), _huge_param_shape)
  _quick_refusal(
    lambda: READERS[reader](ckpt),
    jr.ShapeError,
    "param 'dense/kernel'",
    r"has shape \(9,\), not \(274877906944,\)",
  )


# --- dtypes, scalars, names ---------------------------------------------------


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda d: _param(d, "dense/bias").__setitem__(2, "object"), "dtype 'object' is not one"),
    (
      lambda d: d["layouts"][0]["leaves"][1].__setitem__(1, "complex64"),
      "dtype 'complex64' is not one",
    ),
    (
      lambda d: d["layouts"][0]["leaves"][1].__setitem__(1, "int32"),
      "leaf 1: history buffer dtype int32 is not a floating dtype jaxreshard stores",
    ),
    (
      lambda d: d["layouts"][0]["leaves"][1].__setitem__(1, "../../etc"),
      "dtype '../../etc' is not one",
    ),
    (
      lambda d: d["clocks"][0].__setitem__(0, {"py": "float", "v": "nonsense"}),
      "invalid Python scalar",
    ),
    (
      lambda d: d["clocks"][0].__setitem__(0, {"py": "eval", "v": "__import__('os')"}),
      "invalid Python scalar",
    ),
    (lambda d: d["clocks"][0][0].update(dtype="object"), "dtype 'object' is not one"),
    (
      # uint64 key words: jax would keep only their low 32 bits with x64 off.
      lambda d: d["clocks"][0].__setitem__(
        0,
        {
          "key": "threefry2x32",
          "dtype": "uint64",
          "shape": [2],
          "weak": False,
          "bytes": base64.b64encode(np.array([2**32 + 5, 7], np.uint64).tobytes()).decode(),
        },
      ),
      "threefry2x32 key data must be uint32 words",
    ),
    (
      lambda d: d["clocks"][0].__setitem__(0, {"py": "int", "v": 1, "key": "threefry2x32"}),
      "either a Python number or a PRNG key",
    ),
    (lambda d: d["clocks"][0][0].update(pickle="x"), "are not a scalar"),
    (lambda d: d["clocks"][0][0].update(bytes="!!!!!!!!"), "scalar bytes are not base64"),
  ],
)
def test_unknown_dtype_and_bad_scalars(ckpt, edit, message):
  _edit_json(_index(ckpt), edit)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, message)


@pytest.mark.parametrize(
  "shape", [[100000], [2], [HUGE, HUGE], [0] * 65, [2**70, 0], [2**62, 0], [2**29, 2**29, 0]]
)
def test_scalar_bytes_must_match_their_shape(ckpt, shape):
  _edit_json(_index(ckpt), lambda d: d["clocks"][0][0].update(shape=shape))
  for fn in _both(ckpt):
    _quick_refusal(fn, jr.ArchiveError, "does not match|not a valid array shape|larger than a")


@pytest.mark.parametrize(
  "name",
  ["../../etc", "/etc/passwd", "archive_00001/../../x", "a1", "archive_00001/", ".", "archive_1"],
)
def test_path_traversal_archive_name(ckpt, name):
  _edit_json(_index(ckpt), lambda d: d["archives"][0].__setitem__(0, name))
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, f"name {re.escape(repr(name))} is not a valid name")


@pytest.mark.parametrize("name", ["../float32", "/etc/passwd", "float32/../../x", "float64"])
def test_buffer_names_come_from_the_layout_not_from_the_archive(ckpt, name):
  def rename(d):
    d["buffers"][name] = d["buffers"].pop("float32")

  _edit_json(_archive_json(ckpt, 1), rename)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, "archive_00001", "holds buffers", "but its layout needs")


def test_namedtuple_of_a_foreign_module_is_never_looked_up(ckpt):
  def foreign(d):
    node = d["layouts"][0]["tree"][1][0]  # ScaleByAdamState: ["n", module, name, fields, children]
    assert node[0] == "n" and node[2] == "ScaleByAdamState"
    node[1], node[2] = "os", "system"

  _edit_index_consistently(ckpt, foreign)
  records = jr.load_records(ckpt)
  cls = type(records[0].state[0])
  assert cls.__name__ == "system" and cls.__module__ != "os" and issubclass(cls, tuple)
  assert records[0].state[0].count == 1234


# --- links, FIFOs and hostile array metadata ----------------------------------

_ENTRIES = [
  "jaxreshard.json",
  "archive_00002",
  "archive_00002/archive.json",
  "archive_00002/float32",
  "archive_00002/float32/zarr.json",
  "archive_00002/float32/c",
  "archive_00002/float32/c/0",
]


def _link_out(ckpt, tmp_path, entry):
  """Moves ``entry`` out of the checkpoint, unchanged, and leaves a link to it."""
  outside = tmp_path / "outside" / entry.replace("/", "_")
  outside.parent.mkdir(exist_ok=True)
  shutil.move(ckpt / entry, outside)
  os.symlink(outside, ckpt / entry)
  return ckpt / entry


@pytest.mark.parametrize("entry", _ENTRIES)
def test_symlink_below_the_root_is_never_followed(ckpt, tmp_path, entry):
  # The link's target is the very file or directory that was there: following
  # it would load the checkpoint without a complaint.
  link = _link_out(ckpt, tmp_path, entry)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(link)))


@pytest.mark.parametrize("entry", _ENTRIES)
def test_symlink_refusal_says_it_is_a_symbolic_link(ckpt, tmp_path, entry):
  link = _link_out(ckpt, tmp_path, entry)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(link)) + " is a symbolic link")


def test_symlinked_shard_file_of_the_right_size_outside(ckpt, tmp_path):
  # A valid shard file of the right size, elsewhere: another save's rank 2.
  jr.save_records(tmp_path / "other", _xor_buffers(adam_records(4)), chunk_bytes=8)
  outside = shard_file(tmp_path / "other", 2)
  path = shard_file(ckpt, 2)
  assert os.path.getsize(outside) == os.path.getsize(path)
  os.unlink(path)
  os.symlink(outside, path)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(path) + " is a symbolic link")
  # A relative link to a sibling inside the checkpoint is refused all the same.
  os.unlink(path)
  shutil.copy(shard_file(ckpt, 1), ckpt / "archive_00002" / "float32" / "c" / "1")
  os.symlink("1", path)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(path) + " is a symbolic link")


def test_hard_link_to_a_file_of_the_checkpoint_is_checked_like_a_copy(ckpt):
  # A hard link is a regular file: its bytes are checked like any other.
  path = shard_file(ckpt, 2)
  os.unlink(path)
  os.link(shard_file(ckpt, 1), path)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(path), "chunk 0 fails its crc32c")


@pytest.mark.parametrize(
  "entry",
  [
    "jaxreshard.json",
    "archive_00002/archive.json",
    "archive_00002/float32/zarr.json",
    "archive_00002/float32/c/0",
  ],
)
def test_fifo_in_place_of_a_file(ckpt, entry, monkeypatch):
  path = ckpt / entry
  path.unlink()
  os.mkfifo(path)
  opened, open_ = [], os.open

  def logged(name, flags, *args, dir_fd=None, **kwargs):
    where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
    opened.append(os.path.join(where, os.fspath(name)))
    return open_(name, flags, *args, dir_fd=dir_fd, **kwargs)

  monkeypatch.setattr(os, "open", logged)
  _refused_as_no_regular_file(ckpt, path)
  assert str(path) not in opened  # refused unopened: opening a device node may act


def _refused_as_no_regular_file(ckpt, path) -> None:
  """Both readers refuse the FIFO at ``path`` by name, without waiting on it."""

  def unblock():  # a writer that closes at once ends a reader's wait on the FIFO
    try:
      os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
      pass

  for fn in _both(ckpt):
    e = _outcome(fn, unblock=unblock)
    assert isinstance(e, jr.ArchiveError), repr(e)
    assert f"{path} is not a regular file" in str(e)


@pytest.mark.parametrize(
  "entry", ["jaxreshard.json", "archive_00002/archive.json", "archive_00002/float32/c/0"]
)
def test_fifo_swapped_in_after_the_stat_check(ckpt, entry, monkeypatch):
  """A FIFO that replaces a file between its stat and its open: the open does not wait
  (O_NONBLOCK) and what it opened is refused as not a regular file, never read."""
  path = ckpt / entry
  regular = os.stat(path, follow_symlinks=False)  # what every stat of it still reports
  path.unlink()
  os.mkfifo(path)
  stat_ = os.stat

  def raced(name, *args, dir_fd=None, **kwargs):
    where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
    if os.path.join(where, os.fspath(name)) == str(path):
      return regular
    return stat_(name, *args, dir_fd=dir_fd, **kwargs)

  monkeypatch.setattr(os, "stat", raced)
  _refused_as_no_regular_file(ckpt, path)


@pytest.mark.parametrize(
  "entry", ["jaxreshard.json", "archive_00002/archive.json", "archive_00002/float32/zarr.json"]
)
def test_metadata_that_grows_while_it_is_read(ckpt, entry, monkeypatch):
  """A metadata file a writer appends to between its fstat and its read is refused,
  even where what was appended (whitespace) leaves it valid JSON."""
  path = ckpt / entry
  pread_ = os.pread

  def growing(fd, n, offset):
    if os.readlink(f"/proc/self/fd/{fd}") == str(path):
      with open(path, "ab") as f:
        f.write(b" " * 16)
    return pread_(fd, n, offset)

  monkeypatch.setattr(os, "pread", growing)
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(f"{path} grew while it was read"))


@pytest.mark.parametrize("entry", ["archive_00002/archive.json", "archive_00002/float32/c/0"])
def test_directory_in_place_of_a_file(ckpt, entry):
  path = ckpt / entry
  path.unlink()
  path.mkdir()
  for fn in _both(ckpt):
    _refused(fn, jr.ArchiveError, re.escape(str(path)), "not a regular file")


def _sharding(meta):
  """The configuration of a zarr.json's sharding codec."""
  return meta["codecs"][0]["configuration"]


@pytest.mark.parametrize(
  "edit",
  [
    lambda m: m.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
    lambda m: m.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "."}}),
    lambda m: m.update(
      codecs=[{"name": "bytes", "configuration": {"endian": "little"}}],
      chunk_grid={"name": "regular", "configuration": {"chunk_shape": [2]}},
    ),
    lambda m: m.update(codecs=[{"name": "bytes", "configuration": {"endian": "little"}}]),
    lambda m: m["codecs"].append({"name": "gzip", "configuration": {"level": 1}}),
    lambda m: _sharding(m).update(chunk_shape=[4]),
    lambda m: _sharding(m).update(index_location="start"),
    lambda m: _sharding(m)["codecs"][0]["configuration"].update(endian="big"),
    lambda m: _sharding(m)["codecs"].pop(),
    lambda m: _sharding(m)["index_codecs"].pop(),
    lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[12]),
    lambda m: m.update(data_type="float64"),
    lambda m: m.update(data_type="int32"),
    lambda m: m.update(shape=[12]),
    lambda m: m.update(fill_value="NaN"),
    lambda m: m.update(zarr_format=2),
  ],
  ids=[
    "v2-keys",
    "dot-keys",
    "plain-bytes",
    "plain-bytes-one-chunk",
    "gzip",
    "inner-chunk",
    "index-start",
    "big-endian",
    "no-chunk-crc",
    "no-index-crc",
    "outer-chunk",
    "float64",
    "int32",
    "shape",
    "fill",
    "zarr2",
  ],
)
def test_hostile_zarr_json_with_the_shard_file_untouched(ckpt, edit):
  path = _zarr_json(ckpt, 2)
  before = _read_json(path)
  _edit_json(path, edit)
  assert _read_json(path) != before
  for fn in _both(ckpt):
    _refused(
      fn, jr.ArchiveError, re.escape(str(path)), r"does not describe float32\[24\] in chunks of 2"
    )


def test_zarr_json_without_the_default_index_location_is_accepted(ckpt, pristine):
  # zarr's default index location is the end; tensorstore leaves it out.
  _edit_json(_zarr_json(ckpt, 2), lambda m: _sharding(m).pop("index_location"))
  _same(jr.load_records(ckpt), jr.load_records(pristine))


# --- shard files: truncated, corrupted, forged --------------------------------


@pytest.mark.parametrize("delta", [-7, -1, 1, 4096])
def test_shard_file_of_the_wrong_size(ckpt, delta):
  path = shard_file(ckpt, 1)
  size = os.path.getsize(path)
  os.truncate(path, size + delta)
  for fn in _both(ckpt):
    _refused(
      fn,
      jr.ArchiveError,
      re.escape(path),
      f"has {size + delta} bytes",
      f"needs {size}",
      "truncated or not from this checkpoint",
    )


def _where(ckpt, part):
  """(shard file, byte offset, expected message) of one part of a shard file."""
  if part == "padding":  # float16: 6 elements in chunks of 4, the last half padding
    path = shard_file(ckpt, 0, "float16")
    return path, 4 * 2 + 4 + 3 * 2, "chunk 1 fails its crc32c check"
  n, stride, index_at = _shard_geometry(ckpt, 0)
  return (shard_file(ckpt, 0),) + {
    "chunk data": (stride + 5, "chunk 1 fails its crc32c check"),
    "chunk crc32c": (stride - 2, "chunk 0 fails its crc32c check"),
    "last chunk": ((n - 1) * stride, f"chunk {n - 1} fails its crc32c check"),
    "index offset": (index_at + 16 * 3 + 1, "the shard index fails its crc32c"),
    "index length": (index_at + 16 * 5 + 8, "the shard index fails its crc32c"),
    "index crc32c": (index_at + 16 * n + 3, "the shard index fails its crc32c"),
  }[part]


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(
  "part",
  [
    "chunk data",
    "chunk crc32c",
    "last chunk",
    "padding",
    "index offset",
    "index length",
    "index crc32c",
  ],
)
def test_flipped_bit_in_a_shard_file(ckpt, part, reader):
  path, offset, message = _where(ckpt, part)
  _flip_bit(path, offset)
  _refused(lambda: READERS[reader](ckpt), jr.ArchiveError, re.escape(path), message, "corrupted")


def _write_with_crc32c(path, offset, data):
  """Writes ``data`` and its crc32c (4 bytes, little endian) at ``offset``: a consistent forgery."""
  with open(path, "r+b") as f:
    f.seek(offset)
    f.write(data + google_crc32c.value(data).to_bytes(4, "little"))


@pytest.mark.parametrize("reader", sorted(READERS))
def test_chunk_rewritten_with_its_own_crc32c_fails_the_archive_checksums(ckpt, reader):
  # The shard file alone is consistent; archive.json's checksum of chunk 1 is not.
  _, stride, _ = _shard_geometry(ckpt, 0)
  path = shard_file(ckpt, 0)
  _write_with_crc32c(path, stride, bytes(stride - 4))  # zeros
  _refused(
    lambda: READERS[reader](ckpt),
    jr.ArchiveError,
    re.escape(path),
    "chunk 1 fails its crc32c check",
    "not the one this archive's metadata describes",
  )


@pytest.mark.parametrize("reader", sorted(READERS))
def test_forged_shard_index_with_a_valid_crc32c(ckpt, reader):
  # Chunks 0 and 1 swapped in the index, its crc32c recomputed.
  n, stride, index_at = _shard_geometry(ckpt, 0)
  path = shard_file(ckpt, 0)
  with open(path, "rb") as f:
    f.seek(index_at)
    index = np.frombuffer(f.read(16 * n), "<u8").reshape(n, 2).copy()
  index[[0, 1]] = index[[1, 0]]
  _write_with_crc32c(path, index_at, index.tobytes())
  _refused(
    lambda: READERS[reader](ckpt),
    jr.ArchiveError,
    re.escape(path),
    "the shard index does not lay chunks out as jaxreshard writes them",
  )


# --- saving -------------------------------------------------------------------


def test_existing_output_is_refused_and_untouched(ckpt):
  before = file_hashes(ckpt)
  with pytest.raises(jr.ArchiveExistsError, match="already exists"):
    jr.save_records(ckpt, adam_records(2))
  assert file_hashes(ckpt) == before


def test_inputs_unchanged_by_loads_restores_and_refusals(ckpt):
  before = file_hashes(ckpt)
  jr.load_records(ckpt)
  jr.restore(ckpt, world_size=3, rank=2)
  with pytest.raises(jr.PlacementError):
    jr.restore(ckpt, world_size=3, rank=5)
  assert file_hashes(ckpt) == before


_KILLED_SAVE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import jaxreshard as jr
    from tests._core_util import adam_records

    def slow():
      for i, r in enumerate(adam_records(6)):
        if i == 2:
          print("two written", flush=True)
          time.sleep(60)  # killed here, mid-save
        yield r

    jr.save_records({out!r}, slow(), chunk_bytes=8)
""")


@pytest.mark.slow
def test_killed_save_leaves_nothing_loadable_and_a_rerun_succeeds(tmp_path):
  out = str(tmp_path / "out")
  proc = subprocess.Popen(
    [sys.executable, "-c", _KILLED_SAVE.format(root=ROOT, out=out)],
    stdout=subprocess.PIPE,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  try:
    assert proc.stdout.readline().strip() == b"two written"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  assert not os.path.exists(out)
  with pytest.raises(FileNotFoundError, match="out"):
    jr.load_records(out)
  (leftover,) = glob.glob(str(tmp_path / ".out.tmp-*"))
  assert os.path.isdir(os.path.join(leftover, "archive_00001", "float32"))
  with pytest.raises(jr.ArchiveError, match="a save's temporary directory"):
    jr.load_records(leftover)
  records = adam_records(6)
  jr.save_records(out, records, chunk_bytes=8)
  _same(jr.load_records(out), records)

"""The index and archive metadata are checksummed; data that contradicts the layout is refused
on every read path; reads hold one root descriptor, leak none, and never die of MemoryError.

Edits that must reach a rule behind the checksum are re-signed with the test helper
(``write_signed_json``), written independently of the library.
"""

import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import encoding as _archive_format
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.cli.commands import EXIT_ERROR, app
from tests._archive_util import (
  describes,
  padding_unchecked,
  read_json,
  shard_file,
  write_consistent_index,
  write_signed_json,
)
from tests._core_util import (
  adam_records,
  assert_records_equal,
  device_mesh,
  replace_history,
  standard,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _index(path):
  return os.path.join(path, "jaxreshard.json")


def _archive_json(path, archive):
  return os.path.join(path, f"archive_{archive:05d}", "archive.json")


def _edit_consistently(root, fn):
  """An index edit that every archive.json is re-signed to agree with."""
  data = read_json(_index(root))
  fn(data)
  write_consistent_index(root, data)


def _edit_signed(path, fn):
  data = read_json(path)
  fn(data)
  write_signed_json(path, data)


def _replace_bytes(path, old: bytes, new: bytes):
  with open(path, "rb") as f:
    data = f.read()
  assert data.count(old) == 1, (old, data.count(old))
  with open(path, "wb") as f:
    f.write(data.replace(old, new))


def _message(fn, error=jr.ReshardError):
  with pytest.raises(error) as info:
    fn()
  return str(info.value)


# --- a small, real save: w of shape (3, 4), adam at step 2 -----------------------------


OPT = optax.adam(1e-2)


def _state(shape=(3, 4)):
  """Adam after two steps: count 2, every element of mu and nu non-zero."""
  params = {"w": jnp.arange(1, 1 + int(np.prod(shape)), dtype=jnp.float32).reshape(shape)}
  state = OPT.init(params)
  for step in range(2):
    grads = jax.tree.map(lambda p: p * 0.5 + float(step + 1), params)
    _, state = standard(OPT.update, grads, state, params)
  return params, state


def _save(path, world, shape=(3, 4)):
  params, state = _state(shape)
  records = jr.shard_state(OPT, params, state, world_size=world)
  jr.save_records(path, records, chunk_bytes=8)
  return records


# --- the checksum ------------------------------------------------------------------


@pytest.mark.slow
def test_signed_bytes_are_the_documented_scheme(tmp_path):
  # What the library writes is byte for byte what the independent helper writes.
  _save(tmp_path / "c", 4)
  for path in (_index(tmp_path / "c"), _archive_json(tmp_path / "c", 2)):
    with open(path, "rb") as f:
      written = f.read()
    write_signed_json(tmp_path / "again.json", read_json(path))
    assert (tmp_path / "again.json").read_bytes() == written
    assert _archive_format.signed_json(read_json(path)) == written
    assert _archive_format.verified_json(written, "x") == read_json(path)
  # zarr.json stays plain zarr metadata.
  meta = (tmp_path / "c" / "archive_00000" / "float32" / "zarr.json").read_bytes()
  assert b"checksum" not in meta and json.loads(meta)["zarr_format"] == 3


def _readers(path):
  return {
    "open_checkpoint": lambda: jr.open_checkpoint(path),
    "load_records": lambda: jr.load_records(path),
    "restore": lambda: jr.restore(path, world_size=1, rank=0),
    "digest": lambda: jr.digest(path),
  }


def test_a_flipped_clock_value_is_refused_by_the_checksum(tmp_path):
  path = tmp_path / "c"
  _save(path, 4)
  two, ten = b'"AgAAAA=="', b'"CgAAAA=="'  # int32 count 2 and 10, one bit apart
  _replace_bytes(_index(path), two, ten)
  for name, fn in _readers(path).items():
    msg = _message(fn, jr.ArchiveError)
    assert f"{path / 'jaxreshard.json'} fails its checksum" in msg, (name, msg)
  # The same edit re-signed passes the checksum but not the archives: each
  # archive.json records a digest of its clock.
  data = json.loads(open(_index(path), "rb").read())
  del data["checksum"]
  write_signed_json(_index(path), data)
  for name, fn in _readers(path).items():
    if name == "open_checkpoint":
      continue  # reads the index alone; an archive is checked when it is read
    msg = _message(fn, jr.ArchiveError)
    assert "disagree on its optimizer clock" in msg, (name, msg)


# Bodies signed over their own bytes, so the checksum matches: each edit of the
# file's value, its body's bytes, and the words every reader refuses it with.
_SIGNED_BODIES = {
  # UTF-8, not the ASCII JSON a checkpoint's metadata is.
  "utf8": (
    lambda data: {**data, "note": "caf\u00e9"},
    lambda value: json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"),
    "{target} is not ASCII JSON",
  ),
  # A second "checksum" member inside the checked body: which of the two a JSON
  # parser keeps is its own choice, so neither is read.
  "second_checksum": (
    lambda data: {"checksum": "sha256:" + "0" * 64, **data},
    lambda value: json.dumps(value, separators=(",", ":")).encode("ascii"),
    "{target}: its checked body is not a JSON object without a checksum member",
  ),
}


@pytest.mark.parametrize("which", ["index", "archive"])
@pytest.mark.parametrize("case", sorted(_SIGNED_BODIES))
def test_a_signed_body_that_is_not_checkpoint_json_is_refused(tmp_path, which, case):
  edit, encode, words = _SIGNED_BODIES[case]
  path = tmp_path / "c"
  _save(path, 4)
  target = _index(path) if which == "index" else _archive_json(path, 0)
  body = encode(edit(read_json(target)))
  digest = hashlib.sha256(body).hexdigest().encode("ascii")
  with open(target, "wb") as f:
    f.write(b'{"checksum":"sha256:' + digest + b'",' + body[1:])
  for name, fn in _readers(path).items():
    if name == "open_checkpoint" and which == "archive":
      continue  # reads the index alone
    msg = _message(fn, jr.ArchiveError)
    assert words.format(target=target) in msg, (name, msg)


def test_each_archive_json_records_the_documented_digests_of_its_index_entry(tmp_path):
  path = tmp_path / "c"
  _save(path, 4)
  index = read_json(_index(path))
  want = describes(index)  # the format's rule, computed independently of the library
  assert len({d["placements"] for d in want}) == 4  # one per rank
  for a in range(4):
    assert read_json(_archive_json(path, a))["describes"] == want[a]


def test_a_re_signed_rank_swap_is_refused_on_every_read_path(tmp_path):
  # The index says archive 0 holds rank 1 and archive 1 rank 0, re-signed: every
  # check of the index alone passes, and each archive's data would land on the
  # other rank; the archives' own signed record of their ranks refuses it.
  path = tmp_path / "c"
  _save(path, 2)

  def swap(d):
    (group,) = d["groups"]
    assert group["ranks"] == [[0, 0], [1, 1]]
    group["ranks"] = [[0, 1], [1, 0]]

  _edit_signed(_index(path), swap)
  outcomes = _every_read_path(path, 2, tmp_path, target_shape=(3, 4))
  silent = [name for name, msg in outcomes.items() if msg is None]
  assert not silent, f"{silent} returned the ranks swapped"
  for name, msg in outcomes.items():
    assert "disagree on which params it holds at which rank" in msg, (name, msg)


def test_a_re_signed_index_listing_archives_out_of_name_order_is_refused(tmp_path):
  # Archives 0 and 1 swapped in the list, re-signed: position 0 would name
  # archive_00001's directory. The list follows the names' order, so a reordered
  # list cannot relabel whose data is whose; every reader refuses it in those words.
  path = tmp_path / "c"
  _save(path, 2)

  def swap(d):
    listed = d["archives"]
    assert [a[0] for a in listed] == ["archive_00000", "archive_00001"]
    listed[0], listed[1] = listed[1], listed[0]

  _edit_signed(_index(path), swap)
  for name, read in _readers(path).items():
    msg = _message(read)
    assert "archive_00000 is listed after archive_00001" in msg, (name, msg)
    assert "archives are listed in the order of their names" in msg, (name, msg)


def test_a_re_signed_index_of_another_format_is_refused(tmp_path):
  # A signed file is parsed after its checksum, so the format it names is checked
  # there too: an index re-signed as another format is not read as this one.
  path = tmp_path / "c"
  _save(path, 2)
  _edit_signed(_index(path), lambda d: d.update(format="zarr-checkpoint"))
  for name, read in _readers(path).items():
    msg = _message(read)
    assert msg.endswith("jaxreshard.json does not describe a jaxreshard-checkpoint"), (name, msg)


@pytest.mark.parametrize(
  "edit, words",
  [
    (lambda d: d["layouts"][0].update(extra=[]), "layout 0: expected tree and leaves"),
    (lambda d: d["layouts"][0]["leaves"].__setitem__(1, ["w", "float32"]), "leaf 1: invalid leaf"),
    (lambda d: d["groups"][0].update(extra=[]), "group 0: expected world_size, params and ranks"),
    (lambda d: d["groups"][0]["ranks"][1].append(1), "group 0: expected [archive, rank] pairs"),
    (
      lambda d: d["groups"][0]["ranks"].reverse(),
      "group 0: [archive, rank] pairs must list archives in increasing order; archive 0"
      " follows archive 1",
    ),
    # mu's dict key renamed in the layout's tree: its leaf is w's history under key 'v'.
    (
      lambda d: d["layouts"][0]["tree"][1][0][4][1][1][0].__setitem__(1, "v"),
      "layout 0: the leaf at [0].mu['v'] is not under a key path 'w'",
    ),
  ],
  ids=["layout-key", "leaf-fields", "group-key", "rank-triple", "ranks-reversed", "tree-key"],
)
def test_a_re_signed_malformed_layout_or_group_is_refused(tmp_path, edit, words):
  # The index's layouts and groups, edited and re-signed: an unknown key, a leaf of
  # two fields, a rank pair of three or pairs out of archive order is refused as a
  # malformed index, never skipped.
  path = tmp_path / "c"
  _save(path, 2)
  _edit_signed(_index(path), edit)
  for name, read in _readers(path).items():
    msg = _message(read, jr.ArchiveError)
    assert words in msg, (name, msg)


@pytest.mark.parametrize(
  "groups",
  [[{"world_size": 2, "params": [], "ranks": [[0, 0], [1, 1]]}], []],
  ids=["one-group-of-none", "no-group"],
)
def test_an_index_edited_consistently_to_hold_no_params_is_refused_by_a_restore(tmp_path, groups):
  # Every param dropped, its optimizer state with it (a layout of EmptyState alone),
  # the archives re-signed to agree: a target rank would hold nothing. One group of
  # no params takes the regular plan, no group at all the general one; both refuse.
  path = tmp_path / "c"
  _save(path, 2)

  def no_params(d):
    d.update(params=[], groups=groups, clocks=[[]])
    d["layouts"] = [{"tree": ["t", [["n", "optax._src.base", "EmptyState", [], []]]], "leaves": []}]

  _edit_consistently(path, no_params)
  for read in (
    lambda: jr.restore(path, world_size=1, rank=0),
    lambda: jr.restore_ranks(path, [0, 1], world_size=2),
  ):
    msg = _message(read, jr.PlacementError)
    assert msg == "no migrations: a target rank needs at least one parameter", msg
  # Its archives' archive.json still describe w's buffers (and, with a group, its
  # ranks): a read of the whole checkpoint refuses them, the digest's as a load's.
  loaded, digested = (
    _message(read, jr.ArchiveError)
    for read in (lambda: jr.load_records(path), lambda: jr.digest(path))
  )
  assert loaded == digested and loaded.startswith("archive 0 ("), (loaded, digested)
  if not groups:
    assert "holds buffers {'float32': 12} but its layout needs {}" in loaded, loaded


def test_a_re_signed_archive_json_without_a_full_describes_entry_is_refused(tmp_path):
  # archive.json's record of the index entry it was written for, one digest dropped
  # and re-signed: the archive is refused by every read of it.
  path = tmp_path / "c"
  _save(path, 2)
  _edit_signed(_archive_json(path, 1), lambda d: d["describes"].pop("clock"))
  for name, read in _readers(path).items():
    if name == "open_checkpoint":  # reads the index alone
      read()
      continue
    msg = _message(read, jr.ArchiveError)
    assert msg.endswith("archive.json has no valid 'describes' entry"), (name, msg)


def test_a_re_signed_index_putting_an_archive_in_two_groups_of_one_param_is_refused(tmp_path):
  # A second group (world size 1, archive 0 as its rank 0) listing the same params,
  # re-signed: archive 0 would hold each of them twice; every read of it refuses.
  path = tmp_path / "c"
  _save(path, 2)

  def second_group(d):
    (group,) = d["groups"]
    d["groups"].append({"world_size": 1, "params": list(group["params"]), "ranks": [[0, 0]]})

  _edit_signed(_index(path), second_group)
  for name, read in _readers(path).items():
    if name == "open_checkpoint":  # reads the index alone
      read()
      continue
    msg = _message(read, jr.PlacementError)
    assert msg == "param 'w': archive 0 lists it twice", (name, msg)


def test_a_one_character_shape_edit_is_refused_by_the_checksum(tmp_path):
  path = tmp_path / "c"
  _save(path, 4)
  _replace_bytes(_index(path), b'"w",[3,4]', b'"w",[3,3]')
  for name, fn in _readers(path).items():
    msg = _message(fn, jr.ArchiveError)
    assert "jaxreshard.json fails its checksum" in msg, (name, msg)


def test_an_edited_archive_json_is_refused_by_the_checksum(tmp_path):
  path = tmp_path / "c"
  _save(path, 4)
  a1 = _archive_json(path, 1)
  # One character of the format version edited: still valid JSON, not the signed bytes.
  _replace_bytes(a1, b'"format_version":4', b'"format_version":5')
  for name in ("load_records", "restore", "digest"):
    msg = _message(_readers(path)[name], jr.ArchiveError)
    assert "archive_00001/archive.json fails its checksum" in msg, (name, msg)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["index", "archive.json"])
def test_every_flipped_bit_of_the_metadata_is_refused(tmp_path, which):
  path = tmp_path / "c"
  _save(path, 2)
  target = _index(path) if which == "index" else _archive_json(path, 1)
  original = open(target, "rb").read()
  for pos in range(0, len(original), max(1, len(original) // 97)):
    for bit in (0, 5):
      data = bytearray(original)
      data[pos] ^= 1 << bit
      with open(target, "wb") as f:
        f.write(data)
      with pytest.raises(jr.ArchiveError):
        jr.load_records(path)


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_an_unsigned_version_is_refused_in_its_own_words(tmp_path, version):
  path = tmp_path / "c"
  _save(path, 2)
  for f in (_index(path), _archive_json(path, 0), _archive_json(path, 1)):
    data = read_json(f)
    data["format_version"] = version
    with open(f, "w") as out:
      json.dump(data, out, separators=(",", ":"))  # as versions 1 and 2 wrote them: no checksum
  for name, fn in _readers(path).items():
    msg = _message(fn, jr.ArchiveError)
    assert f"checkpoint format version {version} is not supported" in msg, (name, msg)
    assert "reads versions 3 and 4" in msg, (name, msg)
    if version == 1:
      assert "needs the jaxreshard that wrote it" in msg, (name, msg)
    else:
      assert "no checksum" in msg, (name, msg)


def test_a_re_signed_param_entry_that_is_not_four_fields_is_refused(tmp_path):
  # An entry of the params list cut to three fields, re-signed: refused as a
  # malformed index, never read past its end.
  path = tmp_path / "c"
  _save(path, 2)

  def cut(d):
    assert len(d["params"][0]) == 4
    d["params"][0] = d["params"][0][:3]

  _edit_signed(_index(path), cut)
  for name, read in _readers(path).items():
    msg = _message(read, jr.ArchiveError)
    assert msg.endswith("param 0: expected [id, shape, dtype, trainable]"), (name, msg)


def test_unsigned_metadata_of_this_version_is_refused(tmp_path):
  path = tmp_path / "c"
  _save(path, 2)
  a1 = _archive_json(path, 1)
  data = read_json(a1)
  with open(a1, "w") as out:
    json.dump(data, out)  # the checksum dropped, every value intact
  msg = _message(lambda: jr.load_records(path), jr.ArchiveError)
  assert "archive_00001/archive.json has no checksum" in msg, msg
  data = read_json(_index(path))
  with open(_index(path), "w") as out:
    json.dump(data, out)
  msg = _message(lambda: jr.open_checkpoint(path), jr.ArchiveError)
  assert "jaxreshard.json has no checksum" in msg, msg


# --- data that contradicts the layout ------------------------------------------------


def _target(shape):
  """An abstract adam state for ``w`` of ``shape``, every leaf replicated on the mesh."""
  mesh = device_mesh((8,), ("fsdp",))
  abstract = jax.eval_shape(OPT.init, {"w": jnp.zeros(shape, jnp.float32)})
  every = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=every), abstract)


def _every_read_path(path, world, tmp_path, target_shape=(3, 3)):
  """Every way into a checkpoint on disk; each must refuse (names -> error message)."""
  mesh = device_mesh((8,), ("fsdp",))
  out = {}
  paths = {
    "load_records": lambda: jr.load_records(path),
    "reshard from disk": lambda: jr.reshard(
      jr.load_records(path), jr.plan(jr.load_records(path), world_size=1, rank=0)
    ),
    "restore (one rank)": lambda: jr.restore(path, world_size=1, rank=0),
    "restore_ranks": lambda: jr.restore_ranks(path, range(world), world_size=world),
    "restore_ranks (other world)": lambda: jr.restore_ranks(path, range(3), world_size=3),
    "restore_sharded": lambda: jr.restore_sharded(path, mesh, "fsdp"),
    "restore_sharded target": lambda: jr.restore_sharded(path, mesh, target=_target(target_shape)),
    "digest": lambda: jr.digest(path),
  }
  for name, fn in paths.items():
    try:
      fn()
    except jr.ReshardError as e:
      out[name] = str(e)
    else:
      out[name] = None
  result = CliRunner().invoke(app, ["reshard", str(path), str(tmp_path / "cli-out"), "-w", "2"])
  out["CLI reshard"] = result.stderr if result.exit_code == EXIT_ERROR else None
  return out


@pytest.mark.parametrize("world", [4, 8])
def test_a_re_signed_shape_edit_that_hides_real_elements_is_refused_everywhere(tmp_path, world):
  # (3, 4) -> (3, 3) keeps every rank's slots (3 over 4 ranks, 2 over 8), so the
  # layout's sizes agree; the elements 9..11 the edit turns into padding are not zero.
  path = tmp_path / "c"
  _save(path, world)

  def edit(d):
    (entry,) = d["params"]
    assert entry[1] == [3, 4]
    entry[1] = [3, 3]

  _edit_consistently(path, edit)
  outcomes = _every_read_path(path, world, tmp_path)
  silent = [name for name, msg in outcomes.items() if msg is None]
  assert not silent, f"{silent} returned a state that drops real elements"
  assert not os.path.exists(tmp_path / "cli-out")
  for name, msg in outcomes.items():
    assert "param 'w'" in msg and "padding is not zero" in msg, (name, msg)
    assert "contradicts the layout" in msg, (name, msg)


@pytest.mark.slow
def test_non_zero_padding_is_refused_where_a_read_touches_it(tmp_path):
  # w (3, 3) over 2 ranks: 5 slots each, rank 1 owns 4 and one padding slot.
  params, state = _state((3, 3))
  records = jr.shard_state(OPT, params, state, world_size=2)
  good = tmp_path / "good"
  jr.save_records(good, records, chunk_bytes=8)

  def pad(a):
    a.view(np.uint32)[-1] = 0x80000000  # -0.0: bits that are not zero
    return a

  bad = tmp_path / "bad"
  with padding_unchecked():  # a save refuses it; another writer may not
    jr.save_records(bad, [records[0], replace_history(records[1], "w", 1, pad)], chunk_bytes=8)
  msg = _message(lambda: jr.load_records(bad), jr.ArchiveError)
  assert "param 'w': history buffer 1 of archive 1" in msg and "local index 4" in msg, msg
  # Target rank 2 of 3 copies rank 1's last elements, so it reads that padding.
  msg = _message(lambda: jr.restore(bad, world_size=3, rank=2), jr.ArchiveError)
  assert "padding is not zero" in msg and "rank 1 of shape (3, 3)" in msg, msg
  # A target rank that reads nothing next to the padding gets the same bits as before.
  assert_records_equal(
    jr.restore(bad, world_size=3, rank=0), jr.restore(good, world_size=3, rank=0)
  )
  # Non-zero padding: verify is an error, not "different".
  result = CliRunner().invoke(app, ["verify", str(good), str(bad)])
  assert result.exit_code == EXIT_ERROR and "padding is not zero" in result.stderr


def test_padding_checks_leave_valid_checkpoints_exact(tmp_path):
  # Trailing all-padding ranks (7 elements over 8 ranks) read back exactly.
  records = adam_records(8)
  jr.save_records(tmp_path / "c", records, chunk_bytes=8)
  for got, want in zip(jr.load_records(tmp_path / "c"), records):
    assert_records_equal(got, want)
  want = [jr.reshard(records, jr.plan(records, world_size=3, rank=r)) for r in range(3)]
  for got, w in zip(jr.restore_ranks(tmp_path / "c", range(3), world_size=3), want):
    assert_records_equal(got, w)


# --- descriptors ---------------------------------------------------------------------


def _open_fds():
  return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_refused_reads_leak_no_descriptor(tmp_path):
  path = tmp_path / "c"
  _save(path, 2)
  records = jr.load_records(path)
  # A bad shard index: one flipped bit in its crc32c, the last bytes of the file.
  f = shard_file(path, 1)
  size = os.path.getsize(f)
  with open(f, "r+b") as fh:
    fh.seek(size - 2)
    b = fh.read(1)
    fh.seek(size - 2)
    fh.write(bytes([b[0] ^ 4]))
  gc.collect()
  before = _open_fds()
  for _ in range(300):
    for fn in (lambda: jr.load_records(path), lambda: jr.restore(path, world_size=1, rank=0)):
      with pytest.raises(jr.ArchiveError, match="the shard index fails its crc32c"):
        fn()
  assert _open_fds() == before
  with open(f, "r+b") as fh:  # repaired: the same process still reads it
    fh.seek(size - 2)
    fh.write(b)
  for got, want in zip(jr.load_records(path), records):
    assert_records_equal(got, want)


def test_every_file_is_opened_below_the_one_root_descriptor(tmp_path):
  # The checkpoint is opened, then its path is made to hold another save: every
  # read of the opened checkpoint still reads the files it opened the root of.
  a, b = tmp_path / "a", tmp_path / "b"
  records = _save(a, 2)
  _save(b, 2)
  ckpt = jr.open_checkpoint(a)
  os.rename(a, tmp_path / "a-moved")
  os.rename(b, a)
  for i, want in enumerate(records):
    assert_records_equal(ckpt.record(i), want)
  want = jr.reshard(records, jr.plan(records, world_size=3, rank=1))
  (got,) = jr.restore_ranks(a, [1], world_size=3, checkpoint=ckpt)
  assert_records_equal(got, want)
  root_fd = ckpt._root.fd  # pylint: disable=protected-access
  assert os.path.samestat(os.fstat(root_fd), os.stat(tmp_path / "a-moved"))
  ckpt.close()
  with pytest.raises(OSError):
    os.fstat(root_fd)
  with pytest.raises(jr.ArchiveError, match="the checkpoint was closed"):
    ckpt.record(0)


# --- memory --------------------------------------------------------------------------


HUGE = 2**31  # float32 elements: an 8 GiB history buffer
CHUNK = 1 << 20  # elements per chunk (4 MiB)


def _huge_checkpoint(path):
  """A consistent checkpoint of sgd momentum over one (2**31,) param, world 1: the index,
  archive.json, zarr.json and the sparse shard file (zeros, every crc32c right) agree."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.zeros(4, jnp.float32)}
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=1))

  def index(d):
    d["params"][0][1] = [HUGE]
    for leaf in d["layouts"][0]["leaves"]:
      if isinstance(leaf, list):
        leaf[2] = HUGE

  _edit_consistently(path, index)
  n = HUGE // CHUNK
  zero_crc = google_crc32c.value(bytes(CHUNK * 4))
  _edit_signed(
    _archive_json(path, 0),
    lambda d: d["buffers"]["float32"].update(elements=HUGE, chunk=CHUNK, crc32c=[zero_crc] * n),
  )
  adir = os.path.join(path, "archive_00000", "float32")
  with open(os.path.join(adir, "zarr.json"), "w") as f:
    json.dump(_shardfile.zarr_metadata(HUGE, np.dtype("float32"), CHUNK), f)
  stride = CHUNK * 4 + 4
  shard = os.path.join(adir, "c", "0")
  os.unlink(shard)
  fd = os.open(shard, os.O_WRONLY | os.O_CREAT)
  try:
    os.truncate(shard, _shardfile.file_size(HUGE, 4, CHUNK))
    crc = zero_crc.to_bytes(4, "little")
    for i in range(n):
      os.pwrite(fd, crc, i * stride + CHUNK * 4)
    index_bytes = np.stack(
      [np.arange(n, dtype="<u8") * stride, np.full(n, stride, "<u8")], axis=1
    ).tobytes()
    os.pwrite(fd, index_bytes + google_crc32c.value(index_bytes).to_bytes(4, "little"), n * stride)
  finally:
    os.close(fd)
  assert os.stat(shard).st_blocks * 512 < 64 << 20  # sparse: it occupies almost nothing


@pytest.mark.slow
def test_a_buffer_beyond_the_process_memory_is_a_reshard_error(tmp_path):
  path = tmp_path / "huge"
  _huge_checkpoint(path)
  out = tmp_path / "out"
  code = f"""
      import os, resource
      import jaxreshard as jr
      from jaxreshard._src.cli.commands import app
      from typer.testing import CliRunner
      vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
      limit = vm * 1024 + (2 << 30)  # what is mapped now, plus 2 GiB: less than 8 GiB
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
      for name, fn in [("load_records", lambda: jr.load_records({str(path)!r})),
                       ("restore", lambda: jr.restore({str(path)!r}, world_size=1, rank=0)),
                       ("restore_ranks", lambda: jr.restore_ranks({str(path)!r}, [1],
                                                                  world_size=2))]:
        try:
          fn()
          print(name, "returned")
        except jr.ReshardError as e:
          print(name, "refused", str(e)[:300])
        except MemoryError:
          print(name, "MemoryError")
      result = CliRunner().invoke(app, ["reshard", {str(path)!r}, {str(out)!r}, "-w", "1"])
      print("cli", result.exit_code, len(result.output), result.stderr.strip()[:300])
      """
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  for name in ("load_records", "restore", "restore_ranks"):
    (line,) = [x for x in lines if x.startswith(name + " ")]
    assert line.startswith(f"{name} refused"), proc.stdout
    assert "needs more memory than this process can get" in line and "float32" in line, line
  (cli,) = [x for x in lines if x.startswith("cli ")]
  code_, size = cli.split()[1:3]
  assert int(code_) == EXIT_ERROR and int(size) < 2000, cli
  assert "needs more memory than this process can get" in cli, cli
  assert not os.path.exists(out) and len(proc.stdout) < 10000

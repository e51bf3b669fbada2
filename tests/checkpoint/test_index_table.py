"""An index of large layouts keeps its arrays in a binary table beside its JSON (format
version 4): the same bits on every read path as the JSON index, old (version 3)
checkpoints still read exactly, and the table is covered by the index's checksum.

Edits of the table are re-signed here as an attacker would: the table re-encoded and
the index's JSON re-signed (``write_signed_json``) with the table's new size and
sha256, so that the edit reaches the checks behind the checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import writer as _writer
from tests._archive_util import read_json, write_signed_json
from tests._core_util import adam_records, assert_records_equal
from tests._v3_recipe import records as v3_records

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "v3_checkpoint")
F32 = np.dtype(np.float32)
SHAPES = {f"layer{i:02d}/w": ((i + 3,), F32) for i in range(12)} | {"dense/kernel": ((3, 4), F32)}


@pytest.fixture
def always_table(monkeypatch):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0)


def _save(path, records, table: bool):
  old = _writer.TABLE_MIN_BUFFERS
  _writer.TABLE_MIN_BUFFERS = 0 if table else 1 << 30
  try:
    jr.save_records(path, records, chunk_bytes=32)
  finally:
    _writer.TABLE_MIN_BUFFERS = old


@pytest.fixture
def ckpt(tmp_path):
  path = tmp_path / "t"
  _save(path, adam_records(4, SHAPES), table=True)
  return path


def _index(path):
  return os.path.join(path, "jaxreshard.json")


def _table_path(path):
  return os.path.join(path, _table.TABLE_FILE)


def _readers(path):
  return {
    "open_checkpoint": lambda: jr.open_checkpoint(path).complete_groups(),
    "load_records": lambda: jr.load_records(path),
    "restore": lambda: [jr.restore(path, world_size=3, rank=r) for r in range(3)],
    "digest": lambda: jr.digest(path),
  }


def _refused_everywhere(path, *words, error=jr.ArchiveError):
  for name, fn in _readers(path).items():
    with pytest.raises(error) as info:
      fn()
    for w in words:
      assert w in str(info.value), (name, w, str(info.value))


def _arrays(path) -> tuple[dict, dict]:
  index = read_json(_index(path))
  data = open(_table_path(path), "rb").read()
  out = {}
  for name, (offset, count) in index["table"]["arrays"].items():
    out[name] = np.frombuffer(data, _table.SCHEMA[name], count, offset).copy()
  return index, out


def _edit_table(path, fn):
  """Edits the table's arrays (``fn(arrays, index)``) and re-signs the index over it."""
  index, arrays = _arrays(path)
  fn(arrays, index)
  data, entry = _table.encode(arrays)
  os.chmod(_table_path(path), 0o644)
  with open(_table_path(path), "wb") as f:
    f.write(data)
  index["table"] = entry
  write_signed_json(_index(path), index)


# --- the same bits as the JSON index ------------------------------------------------


def test_a_large_layout_keeps_its_index_in_a_table_and_reads_the_same_bits(tmp_path):
  records = adam_records(4, SHAPES)
  _save(tmp_path / "json", records, table=False)
  _save(tmp_path / "table", records, table=True)
  assert not os.path.exists(_table_path(tmp_path / "json"))
  index = read_json(_index(tmp_path / "table"))
  assert index["format_version"] == jr.CHECKPOINT_FORMAT_VERSION == 4
  assert "params" not in index and "table" in index
  for a, b, c in zip(
    records, jr.load_records(tmp_path / "json"), jr.load_records(tmp_path / "table")
  ):
    assert_records_equal(a, b)
    assert_records_equal(a, c)
  for world in (3, 5):
    for rank in range(world):
      want = jr.reshard(records, jr.plan(records, world_size=world, rank=rank))
      assert_records_equal(jr.restore(tmp_path / "table", world_size=world, rank=rank), want)
      plans = [
        _read_plan.read_plan(jr.open_checkpoint(tmp_path / p), world_size=world, rank=rank)
        for p in ("json", "table")
      ]
      assert plans[0].reads == plans[1].reads and plans[0].target_bytes == plans[1].target_bytes
  assert jr.digest(tmp_path / "table") == jr.digest(tmp_path / "json") == jr.digest(records)


def test_masked_frozen_bfloat16_and_list_params_read_exactly_from_a_table(tmp_path):
  records = v3_records()
  _save(tmp_path / "t", records, table=True)
  for a, b in zip(records, jr.load_records(tmp_path / "t")):
    assert_records_equal(a, b)
  for rank in range(2):
    want = jr.reshard(records, jr.plan(records, world_size=2, rank=rank))
    assert_records_equal(jr.restore(tmp_path / "t", world_size=2, rank=rank), want)


def _odd_params():
  """Params whose ids JSON escapes (quote, backslash, non-ASCII, a control character)
  beside plain ones, of every shape kind and storage dtype."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return {
    'a"q': {"w": jnp.arange(5.0)},
    "b\\s": {"w": jnp.ones((2, 3), jnp.bfloat16)},
    "c\u00e9": {"w": jnp.float32(2.0)},
    "d\tt": {"w": jnp.arange(4.0, dtype=jnp.float16)},
    "plain": {"w": jnp.zeros((3, 1, 2))},
  }


@pytest.mark.parametrize("which", ["odd", "plain", "v3"])
def test_the_describes_digest_text_is_json_dumps_of_the_entries(tmp_path, which):
  """The text a table index's placements digest hashes is exactly ``json.dumps`` of its
  param entries, whether it is joined from their parts (plain ids) or dumped."""
  import optax  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.checkpoint import tableindex as _tableindex  # pylint: disable=g-import-not-at-top

  if which == "v3":
    records = v3_records()
  else:
    params = _odd_params()
    if which == "plain":
      params = {"plain": params["plain"], "p2": params['a"q']}
    opt = optax.adam(1e-3)
    records = jr.shard_state(opt, params, opt.init(params), world_size=3)
  _save(tmp_path / "t", records, table=True)
  index = jr.open_checkpoint(tmp_path / "t").index
  t = index.tables
  for g in range(len(t.g_world)):
    for ps in (np.sort(t.group_params(g)), np.arange(len(t.p_name))):
      want = json.dumps(_tableindex._entries(index, ps), separators=(",", ":"))
      assert _tableindex._entries_json(index, ps) == want
  # The digests agree with those the writer recorded: every rank restores exactly.
  for rank in range(2):
    want = jr.reshard(records, jr.plan(records, world_size=2, rank=rank))
    assert_records_equal(jr.restore(tmp_path / "t", world_size=2, rank=rank), want)


def test_the_json_of_a_table_index_does_not_grow_with_the_params(tmp_path):
  small = {f"p{i:03d}": ((5,), F32) for i in range(10)}
  large = {f"p{i:03d}": ((5,), F32) for i in range(400)}
  _save(tmp_path / "s", adam_records(2, small), table=True)
  _save(tmp_path / "l", adam_records(2, large), table=True)
  # The same but for the table's size, sha256 and array offsets.
  assert os.path.getsize(_index(tmp_path / "l")) < os.path.getsize(_index(tmp_path / "s")) + 200


def test_a_save_decides_the_table_by_its_first_archive(tmp_path):
  few = adam_records(2, {"w": ((3,), F32)})
  jr.save_records(tmp_path / "few", few)
  assert not os.path.exists(_table_path(tmp_path / "few"))
  many = adam_records(2, {f"p{i:03d}": ((3,), F32) for i in range(_writer.TABLE_MIN_BUFFERS // 2)})
  jr.save_records(tmp_path / "many", many)
  assert os.path.exists(_table_path(tmp_path / "many"))


def test_a_version_3_checkpoint_still_reads_bit_exactly(tmp_path):
  # Written by the jaxreshard of format version 3 (``tests/_v3_recipe.py``).
  path = tmp_path / "v3"
  shutil.copytree(DATA, path)
  assert read_json(_index(path))["format_version"] == 3
  records = v3_records()
  for a, b in zip(records, jr.load_records(path)):
    assert_records_equal(a, b)
  for rank in range(2):
    want = jr.reshard(records, jr.plan(records, world_size=2, rank=rank))
    assert_records_equal(jr.restore(path, world_size=2, rank=rank), want)
  assert jr.digest(path) == jr.digest(records)


# --- the table is covered by the index's checksum -----------------------------------


def test_a_truncated_table_is_refused(ckpt):
  data = open(_table_path(ckpt), "rb").read()
  with open(_table_path(ckpt), "wb") as f:
    f.write(data[:-8])
  _refused_everywhere(ckpt, "jaxreshard.table has", "truncated or not this checkpoint's")


def test_a_table_with_bytes_appended_is_refused(ckpt):
  with open(_table_path(ckpt), "ab") as f:
    f.write(b"\0" * 8)
  _refused_everywhere(ckpt, "jaxreshard.table")


@pytest.mark.parametrize("where", [0, 1 / 3, 2 / 3, -1])
def test_a_flipped_byte_of_the_table_is_refused(ckpt, where):
  data = bytearray(open(_table_path(ckpt), "rb").read())
  pos = int(where * len(data)) if where != -1 else len(data) - 1
  data[pos] ^= 0x10
  with open(_table_path(ckpt), "wb") as f:
    f.write(data)
  _refused_everywhere(ckpt, "jaxreshard.table fails its checksum")


def test_the_table_of_another_checkpoint_is_refused(ckpt, tmp_path):
  other = tmp_path / "other"
  _save(other, adam_records(4, SHAPES | {"extra": ((2,), F32)}), table=True)
  shutil.copy(_table_path(other), _table_path(ckpt))
  _refused_everywhere(ckpt, "jaxreshard.table")


def test_another_checkpoints_table_with_its_index_entry_is_refused(ckpt, tmp_path):
  # The index re-signed to name the other table: the archives' own digests refuse it.
  other = tmp_path / "other"
  _save(other, adam_records(4, {**SHAPES, "dense/kernel": ((4, 3), F32)}), table=True)
  shutil.copy(_table_path(other), _table_path(ckpt))
  index = read_json(_index(ckpt))
  index["table"] = read_json(_index(other))["table"]
  write_signed_json(_index(ckpt), index)
  for name in ("load_records", "restore", "digest"):
    with pytest.raises(jr.ArchiveError, match="the index does not describe this archive"):
      _readers(ckpt)[name]()


def test_a_missing_table_is_refused_by_name(ckpt):
  os.unlink(_table_path(ckpt))
  _refused_everywhere(ckpt, "jaxreshard.table is missing", "incomplete")


def test_a_table_that_is_a_link_or_a_directory_is_refused(ckpt, tmp_path):
  real = tmp_path / "real.table"
  shutil.move(_table_path(ckpt), real)
  os.symlink(real, _table_path(ckpt))
  _refused_everywhere(ckpt, "symbolic link")
  os.unlink(_table_path(ckpt))
  os.mkdir(_table_path(ckpt))
  _refused_everywhere(ckpt, "not a regular file")


def test_the_table_entry_of_the_index_is_checked(ckpt):
  index = read_json(_index(ckpt))
  for edit, words in [
    (lambda t: t.update(file="../x"), "not jaxreshard.table"),
    (lambda t: t.update(bytes=-1), "invalid size or sha256"),
    (lambda t: t.update(sha256="0" * 63), "invalid size or sha256"),
    (lambda t: t.pop("arrays"), "needs file, bytes, sha256 and arrays"),
    (lambda t: t["arrays"].pop("param_name"), "holds arrays"),
    (lambda t: t["arrays"].update(param_name=[3, 1]), "does not lie inside the table"),
    (lambda t: t["arrays"].update(param_name=[0, 10**9]), "does not lie inside the table"),
  ]:
    changed = json.loads(json.dumps(index))
    edit(changed["table"])
    write_signed_json(_index(ckpt), changed)
    _refused_everywhere(ckpt, *([words] if isinstance(words, str) else words))
  write_signed_json(_index(ckpt), {**index, "format_version": 3})
  _refused_everywhere(ckpt, "unexpected index keys")


# --- values of the table: checked as the JSON index's are ---------------------------


def test_a_re_signed_rank_swap_in_the_table_is_refused(ckpt):
  def swap(a, _):
    a["group_rank"][[0, 1]] = a["group_rank"][[1, 0]]

  _edit_table(ckpt, swap)
  for name in ("load_records", "restore", "digest"):
    with pytest.raises(jr.ArchiveError, match="the index does not describe this archive"):
      _readers(ckpt)[name]()


def test_a_re_signed_shape_edit_in_the_table_is_refused(ckpt):
  def grow(a, _):
    a["param_dims"][-1] += 1

  _edit_table(ckpt, grow)
  for name in ("load_records", "restore", "digest"):
    with pytest.raises(jr.ReshardError):
      _readers(ckpt)[name]()


def _first_id_of_4097_characters(arrays, index):
  """The first param id ("dense/kernel") made 4097 characters long, the others kept."""
  raw, ends = arrays["name_bytes"].tobytes(), arrays["name_ends"]
  first, long = int(ends[0]), b"d" + b"x" * 4096
  arrays["name_bytes"] = np.frombuffer(long + raw[first:], arrays["name_bytes"].dtype).copy()
  arrays["name_ends"] = (ends - first + len(long)).astype(ends.dtype)


@pytest.mark.parametrize(
  "edit, words",
  [
    (lambda a, i: a["group_world"].__setitem__(0, 10**12), "world_size 1000000000000 must be"),
    (lambda a, i: a["group_world"].__setitem__(0, 0), "world_size 0 must be"),
    (lambda a, i: a["group_rank"].__setitem__(2, 10**12), "has rank 1000000000000, outside"),
    (lambda a, i: a["group_archive"].__setitem__(0, 7), "archive 7 does not exist"),
    (lambda a, i: a["group_archive"].__setitem__(1, a["group_archive"][0]), "is listed twice"),
    (lambda a, i: i["clocks"].append(list(i["clocks"][0])), "clock 1: no archive has it"),
    (lambda a, i: a["group_params"].__setitem__(0, 99), "a param index is out of range"),
    (lambda a, i: a["group_params"].__setitem__(1, a["group_params"][0]), "lists a param twice"),
    (lambda a, i: a["param_dims"].__setitem__(0, -1), "is not a valid array shape"),
    (lambda a, i: a["param_dims"].__setitem__(0, 2**62), "is not a valid array shape"),
    (lambda a, i: a["param_dtype"].__setitem__(0, 9), "dtype 9 does not exist"),
    (lambda a, i: a["param_name"].__setitem__(0, 10**6), "param id 1000000 does not exist"),
    (lambda a, i: a["param_trainable"].__setitem__(0, 2), "trainable flag"),
    (lambda a, i: a["name_bytes"].__setitem__(0, 0xFF), "not UTF-8"),
    (lambda a, i: a["name_ends"].__setitem__(0, 10**6), "do not tile"),
    (
      lambda a, i: a.update(name_ends=a["name_ends"][:0]),
      f"param ids holds {sum(map(len, SHAPES))} values in no row",
    ),
    (_first_id_of_4097_characters, "param id 0 has 4097 characters (at most 4096)"),
    (lambda a, i: a["name_bytes"].__setitem__(0, ord("z")), "the param ids are not distinct and"),
    (lambda a, i: a["archive_number"].__setitem__(1, 0), "listed after archive_00000"),
    (lambda a, i: a["archive_number"].__setitem__(0, -1), "not one of an archive's name"),
    (lambda a, i: a["archive_layout"].__setitem__(1, 5), "layout 5 or clock 0 does not exist"),
    (lambda a, i: a["archive_clock"].__setitem__(1, -1), "layout 0 or clock -1 does not exist"),
    (lambda a, i: a["leaf_slots"].__setitem__(0, -1), "-1 slots is not a buffer size"),
    (lambda a, i: a["leaf_dtype"].__setitem__(0, 7), "dtype 7 does not exist"),
    (lambda a, i: a["structure_ids"].__setitem__(1, a["structure_ids"][0]), "appears twice"),
    (lambda a, i: a["mirror_leaves_end"].__setitem__(0, 1), "1 leaves for the 13 positions"),
    (lambda a, i: i["layouts"][0].update(mirrors=[0]), "mirrors but it lists 1"),
    (lambda a, i: i["layouts"][0].pop("skeleton"), "expected skeleton, slots and mirrors"),
    (lambda a, i: i["layouts"][0].update(extra=1), "expected skeleton, slots and mirrors"),
    (lambda a, i: i["layouts"][0]["mirrors"].__setitem__(1, 9), "structure 9 does not exist"),
    (lambda a, i: i["layouts"][0]["mirrors"].__setitem__(1, -1), "structure -1 does not exist"),
    (lambda a, i: i["layouts"][0]["mirrors"].__setitem__(1, True), "structure True does not"),
    (lambda a, i: i["layouts"][0]["slots"].__setitem__(0, {"s": 1}), "numbered in order"),
    (lambda a, i: i["dtypes"].__setitem__(0, "object"), "dtype 'object' is not one"),
    (
      lambda a, i: i["dtypes"].__setitem__(i["dtypes"].index("float32"), "int32"),
      "history buffer dtype int32 is not a floating dtype jaxreshard stores",
    ),
    (lambda a, i: i["clocks"].__setitem__(0, []), "its clock has 0 scalars but its layout 1"),
    (lambda a, i: i["dtypes"].append(i["dtypes"][0]), "its dtypes repeat"),
    (lambda a, i: a.update(param_dtype=a["param_dtype"][:-1]), "param_dtype has 12 rows for 13"),
    (
      lambda a, i: a.update(param_trainable=np.append(a["param_trainable"], 1)),
      "param_trainable has 14 rows for 13 params",
    ),
    (
      lambda a, i: a.update(
        archive_number=a["archive_number"][:0],
        archive_layout=a["archive_layout"][:0],
        archive_clock=a["archive_clock"][:0],
      ),
      "the archive list is empty",
    ),
    (
      lambda a, i: a.update(archive_layout=a["archive_layout"][:-1]),
      "every archive needs a number, a layout and a clock",
    ),
    (
      lambda a, i: a.update(group_rank=a["group_rank"][:-1]),
      "every [archive, rank] pair of a group needs both",
    ),
    (lambda a, i: a.update(leaf_slots=a["leaf_slots"][:-1]), "every leaf needs a dtype and slots"),
    (
      lambda a, i: a.update(
        mirror_leaves_end=np.append(a["mirror_leaves_end"], a["mirror_leaves_end"][-1])
      ),
      "its layouts have 2 mirrors but its table 3",
    ),
  ],
)
def test_malformed_table_values_are_refused_when_opened(ckpt, edit, words):
  _edit_table(ckpt, edit)
  _refused_everywhere(ckpt, words)


def _redescribe(path):
  """Re-signs every archive.json to describe its (edited) table layout: the sha256 of
  the layout's canonical text, so that a re-signed edit reaches the checks made when a
  state is first built (the skeleton and params trees are decoded then, not when
  the index is opened)."""
  layouts = jr.open_checkpoint(path).index.layouts
  assert len(layouts) == 1
  digest = hashlib.sha256(layouts[0].digest_text.encode("ascii")).hexdigest()
  for name in sorted(os.listdir(path)):
    if name.startswith("archive_"):
      meta_path = os.path.join(path, name, "archive.json")
      meta = read_json(meta_path)
      meta["describes"]["layout"] = digest
      os.chmod(meta_path, 0o644)
      write_signed_json(meta_path, meta)


def _refused_when_built(path, words):
  for name in ("load_records", "restore", "digest"):
    with pytest.raises(jr.ArchiveError) as info:
      _readers(path)[name]()
    assert words in str(info.value), (name, str(info.value))


def test_a_skeleton_whose_leaves_are_not_in_flatten_order_is_refused(ckpt):
  # mu's and nu's mirrors swapped in the skeleton: each would be read with the other's
  # buffers.
  def swap(a, i):
    adam = i["layouts"][0]["skeleton"][1][0]
    assert adam[2] == "ScaleByAdamState" and adam[4] == [0, 1, 2], adam
    adam[4] = [0, 2, 1]

  _edit_table(ckpt, swap)
  _redescribe(ckpt)
  _refused_when_built(ckpt, "the skeleton's leaves are not numbered in flatten order")


def test_params_tree_ids_out_of_flatten_order_are_refused(ckpt):
  # layer00/w and layer01/w (one slot each at world size 4) swapped in the params
  # tree's ids: each would be read back under the other's name.
  def swap(a, _):
    assert a["structure_ids"][1:3].tolist() == [1, 2]
    a["structure_ids"][1:3] = [2, 1]

  _edit_table(ckpt, swap)
  _redescribe(ckpt)
  _refused_when_built(ckpt, "its ids do not form a tree of nested dicts")


def test_a_params_tree_whose_key_paths_are_not_its_ids_is_refused(tmp_path):
  # A params tree kept as JSON (it holds a list) whose key "kernel" is renamed: the
  # state read back would hold a key no param id names.
  path = tmp_path / "t"
  _save(path, v3_records(), table=True)

  def rename(a, _):
    tree = a["structure_tree"].tobytes()
    assert tree.count(b'"kernel"') == 1, tree
    tree = tree.replace(b'"kernel"', b'"kernal"')
    a["structure_tree"] = np.frombuffer(tree, a["structure_tree"].dtype).copy()

  _edit_table(path, rename)
  _redescribe(path)
  _refused_when_built(path, "its tree's key paths are not its ids in flatten order")


def test_a_structure_tree_that_is_not_ascii_is_refused(tmp_path):
  """A layout whose params trees are not nested dicts of the ids keeps them as JSON."""
  _save(tmp_path / "t", v3_records(), table=True)
  assert len(_arrays(tmp_path / "t")[1]["structure_tree"])
  _edit_table(tmp_path / "t", lambda a, i: a["structure_tree"].__setitem__(0, 0xC3))
  _refused_everywhere(tmp_path / "t", "a structure's tree is not ASCII JSON")


def test_every_table_value_out_of_range_is_a_reshard_error(ckpt):
  # Whatever a re-signed table holds, a reader refuses it as a ReshardError or reads it;
  # it never fails otherwise.
  pristine = {n: open(os.path.join(ckpt, n), "rb").read() for n in ("jaxreshard.json",)}
  table = open(_table_path(ckpt), "rb").read()
  for name in _table.SCHEMA:
    for value in (-1, 1, 2**31, 2**62, 2**63 - 1):
      for at in (0, -1):

        def edit(a, _, name=name, value=value, at=at):
          if len(a[name]):
            info = np.iinfo(a[name].dtype)
            a[name][at] = min(max(value, info.min), info.max)

        _edit_table(ckpt, edit)
        for reader, fn in _readers(ckpt).items():
          try:
            fn()
          except jr.ReshardError:
            pass
          except Exception as e:  # pylint: disable=broad-exception-caught
            raise AssertionError(f"{name}[{at}] = {value}: {reader} raised {e!r}") from e
        os.chmod(_table_path(ckpt), 0o644)
        with open(_table_path(ckpt), "wb") as f:
          f.write(table)
        with open(_index(ckpt), "wb") as f:
          f.write(pristine["jaxreshard.json"])


def test_the_table_is_written_before_its_index_and_both_are_durable(tmp_path, monkeypatch):
  order = []
  real = _writer._shardfile.OutDir.write_bytes

  def spy(self, name, data):
    order.append(name)
    return real(self, name, data)

  monkeypatch.setattr(_writer._shardfile.OutDir, "write_bytes", spy)
  _save(tmp_path / "c", adam_records(2, SHAPES), table=True)
  assert order.index(_table.TABLE_FILE) < order.index("jaxreshard.json")
  data = open(_table_path(tmp_path / "c"), "rb").read()
  assert read_json(_index(tmp_path / "c"))["table"]["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_table_larger_than_a_reader_reads_is_refused_by_the_save(tmp_path, monkeypatch):
  """A reader reads at most ``MAX_TABLE_BYTES`` of a table (1 GiB; lowered here to this
  table's size): one byte more is refused before the table is written, and nothing
  is left; at the bound it saves and loads exactly."""
  records = adam_records(4, SHAPES)
  _save(tmp_path / "measured", records, table=True)
  size = os.path.getsize(_table_path(tmp_path / "measured"))
  shutil.rmtree(tmp_path / "measured")
  monkeypatch.setattr(_table, "MAX_TABLE_BYTES", size - 1)
  with pytest.raises(jr.ArchiveError) as e:
    _save(tmp_path / "ck", records, table=True)
  assert f"{_table.TABLE_FILE} would have {size} bytes (a reader takes {size - 1})" in str(e.value)
  assert os.listdir(tmp_path) == []
  monkeypatch.setattr(_table, "MAX_TABLE_BYTES", size)
  _save(tmp_path / "ok", records, table=True)
  for got, want in zip(jr.load_records(tmp_path / "ok"), records, strict=True):
    assert_records_equal(got, want)
  # A reshard's output, committed with no restore's check (it may be some ranks): to
  # 8 ranks, a table larger than its source's.
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0)

  def reshard(out):
    return CliRunner().invoke(app, ["reshard", str(tmp_path / "ok"), str(out), "-w", "8"])

  monkeypatch.setattr(_table, "MAX_TABLE_BYTES", 1 << 30)
  assert reshard(tmp_path / "out").exit_code == 0
  out_size = os.path.getsize(_table_path(tmp_path / "out"))
  assert out_size > size
  shutil.rmtree(tmp_path / "out")
  monkeypatch.setattr(_table, "MAX_TABLE_BYTES", out_size - 1)
  result = reshard(tmp_path / "out")
  assert result.exit_code == 2, result.output
  assert f"would have {out_size} bytes (a reader takes {out_size - 1})" in result.output
  assert os.listdir(tmp_path) == ["ok"]


def test_an_archive_in_two_groups_of_one_rank_reads_from_a_table(tmp_path):
  # Archive 0 holds rank 0 of x and of y; archive 1 rank 1 of x, archive 2 rank 1 of y:
  # two groups meet in archive 0 at (world size 2, rank 0), whose digest covers both.
  def record(held: dict) -> jr.ShardRecord:
    placements = tuple(
      jr.ParamPlacement(p, (5,), r, 2, np.dtype(np.float32), True) for p, (r, _) in held.items()
    )
    state = {"count": np.int32(3), "mu": {p: v for p, (_, v) in held.items()}}
    roles = (None, *sorted(held))
    return jr.ShardRecord(1, tuple(sorted(placements, key=lambda p: p.param)), state, roles)

  x, y = np.arange(6, dtype=np.float32), np.arange(10, 16, dtype=np.float32)
  records = [
    record({"x": (0, x[:3]), "y": (0, y[:3])}),
    record({"x": (1, np.array([x[3], x[4], 0], np.float32))}),
    record({"y": (1, np.array([y[3], y[4], 0], np.float32))}),
  ]
  _save(tmp_path / "t", records, table=True)
  assert os.path.exists(_table_path(tmp_path / "t"))
  for a, b in zip(records, jr.load_records(tmp_path / "t")):
    assert_records_equal(a, b)
  for rank in range(3):
    want = jr.reshard(records, jr.plan(records, world_size=3, rank=rank))
    assert_records_equal(jr.restore(tmp_path / "t", world_size=3, rank=rank), want)


def test_a_forged_param_id_never_stands_for_another_checkpoint_s_ids(ckpt, tmp_path):
  # One param whose id is the others' ids joined by NUL: opening it must not change
  # what the first checkpoint's trees decode to in this process (a cache key of
  # joined ids made the two the same).
  forged = tmp_path / "forged"
  shutil.copytree(ckpt, forged)
  good = jr.load_records(ckpt)

  def one_param(a, _):
    names = bytes(a["name_bytes"]).decode()
    ids = [names[x:y] for x, y in zip([0, *a["name_ends"][:-1].tolist()], a["name_ends"].tolist())]
    evil = "\0".join(ids).encode()
    one = lambda *v: np.array(v, a["param_name"].dtype)  # noqa: E731
    a.update(
      name_bytes=np.frombuffer(evil, np.uint8),
      name_ends=one(len(evil)).astype(a["name_ends"].dtype),
      param_name=one(0),
      param_dims_end=one(1).astype(a["param_dims_end"].dtype),
      param_dims=one(2).astype(a["param_dims"].dtype),
      param_dtype=one(0).astype(a["param_dtype"].dtype),
      param_trainable=one(1).astype(a["param_trainable"].dtype),
      group_params=one(0).astype(a["group_params"].dtype),
      group_params_end=one(1).astype(a["group_params_end"].dtype),
      structure_ids=one(0).astype(a["structure_ids"].dtype),
      structure_ids_end=one(1).astype(a["structure_ids_end"].dtype),
      mirror_leaves_end=one(1, 2).astype(a["mirror_leaves_end"].dtype),
      leaf_dtype=one(0, 0).astype(a["leaf_dtype"].dtype),
      leaf_slots=one(1, 1).astype(a["leaf_slots"].dtype),
    )

  _edit_table(forged, one_param)
  try:
    repr(jr.open_checkpoint(forged))
  except jr.ReshardError:
    pass  # refused or not, it changes nothing about the other checkpoint
  for a, b in zip(jr.load_records(ckpt), good, strict=True):
    assert_records_equal(a, b)

"""A merge of parts with table indexes checks and assembles one layout once.

The one-rank parts of one reshard hold indexes that differ only in their identity,
their source, their archives' names and the ranks they hold. ``Index.content`` is
the digest of everything else, and a merge reuses what it made of one part's
index (its target layout, its assembly) for every part of the same content. These
tests check that the digest leaves out exactly those fields, that a merge through
the shortcut writes the files a merge without it writes, and that every refusal
still reaches a part whose content is shared.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import groupfacts as _groupfacts
from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import tableindex as _tableindex
from jaxreshard._src.checkpoint import writer as _writer
from jaxreshard._src.cli.commands import app
from jaxreshard._src.errors import PlacementError
from tests._archive_util import assert_same_files, read_json, write_signed_json
from tests._core_util import adam_records, assert_records_equal, bits

F32 = np.dtype(np.float32)
SHAPES = {f"layer{i:02d}/w": ((i + 3,), F32) for i in range(12)} | {"dense/kernel": ((3, 4), F32)}
WORLD = 6


@pytest.fixture(autouse=True)
def always_table(monkeypatch):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0)


def _parts(tmp_path, records, name="src", world=WORLD) -> list:
  src = tmp_path / name
  jr.save_records(src, records)
  out = []
  for r in range(world):
    out.append(tmp_path / f"{name}.part{r}")
    result = CliRunner().invoke(
      app, ["reshard", str(src), str(out[-1]), "-w", str(world), "-r", str(r)]
    )
    assert result.exit_code == 0, result.output
  return out


def _content(path):
  return jr.open_checkpoint(path).index.content


def _raw(path) -> tuple[dict, dict]:
  """A table index's JSON and its arrays, as stored."""
  index = read_json(os.path.join(path, "jaxreshard.json"))
  data = open(os.path.join(path, _table.TABLE_FILE), "rb").read()
  arrays = {
    name: np.frombuffer(data, _table.SCHEMA[name], count, offset).copy()
    for name, (offset, count) in index["table"]["arrays"].items()
  }
  return index, arrays


def test_the_parts_of_one_reshard_share_one_content_and_nothing_else_does(tmp_path, monkeypatch):
  records = adam_records(8, SHAPES)
  parts = _parts(tmp_path, records)
  contents = {_content(p) for p in parts}
  assert len(contents) == 1 and None not in contents
  # Another model (one param one element longer), another clock, the whole source:
  # each another content.
  other = dict(SHAPES, **{"layer03/w": ((7,), F32)})
  other_parts = _parts(tmp_path, adam_records(8, other), "other")
  later = [
    jr.ShardRecord(
      r.version, r.placements, (r.state[0]._replace(count=np.int32(9)), r.state[1]), r.roles
    )
    for r in records
  ]
  later_parts = _parts(tmp_path, later, "later")
  seen = [
    _content(parts[0]),
    _content(other_parts[0]),
    _content(later_parts[0]),
    _content(tmp_path / "src"),
  ]
  assert len(set(seen)) == 4
  # A JSON index has none.
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 1 << 30)
  jr.save_records(tmp_path / "json", records)
  assert _content(tmp_path / "json") is None


def test_the_content_digest_leaves_out_only_archive_names_and_ranks(tmp_path):
  parts = _parts(tmp_path, adam_records(8, SHAPES), world=3)
  index, arrays = _raw(parts[1])
  rv = index["record_version"]
  base = _tableindex.content_digest(index, arrays, rv)
  assert base == _content(parts[1])
  for name in sorted(arrays):
    edited = dict(arrays)
    a = arrays[name].copy()
    if a.size:
      a[0] = a[0] + 1
    else:
      a = np.zeros(1, a.dtype)
    edited[name] = a
    same = _tableindex.content_digest(index, edited, rv) == base
    assert same == (name in ("archive_number", "group_rank")), name
  for key, value in (("dtypes", ["float64"]), ("layouts", []), ("clocks", [])):
    assert _tableindex.content_digest(dict(index, **{key: value}), arrays, rv) != base, key
  assert _tableindex.content_digest(index, arrays, rv + 1) != base
  for key, value in (("checkpoint", "f" * 32), ("source", None)):
    assert _tableindex.content_digest(dict(index, **{key: value}), arrays, rv) == base, key


def test_a_merge_makes_one_target_layout_and_one_assembly_for_parts_of_one_content(
  tmp_path, monkeypatch, fixed_id
):
  records = adam_records(8, SHAPES)
  parts = _parts(tmp_path, records)
  made = {"layout": 0, "facts": 0}
  layout, facts = _reader.target_layout, _groupfacts.group_facts

  def count(name, fn):
    return lambda *a: made.__setitem__(name, made[name] + 1) or fn(*a)

  with monkeypatch.context() as m:
    m.setattr(_reader, "target_layout", count("layout", layout))
    m.setattr(_groupfacts, "group_facts", count("facts", facts))
    _merge.merge_parts(tmp_path / "merged", parts[::-1])
  assert made == {"layout": 1, "facts": 1}
  want = jr.reshard_ranks(
    records, [jr.plan(records, world_size=WORLD, rank=r) for r in range(WORLD)]
  )
  for got, w in zip(jr.load_records(tmp_path / "merged"), want):
    assert_records_equal(got, w)
  # The same merge with no index content: every part made on its own, the same files.
  with monkeypatch.context() as m:
    m.setattr(_index.Index, "content", property(lambda self: None))
    m.setattr(_reader, "target_layout", count("layout", layout))
    m.setattr(_groupfacts, "group_facts", count("facts", facts))
    _merge.merge_parts(tmp_path / "plain", parts[::-1])
  assert made == {"layout": 1 + WORLD, "facts": 1 + WORLD}
  assert_same_files(tmp_path / "merged", tmp_path / "plain")


@pytest.mark.parametrize("where", [0, WORLD - 1])
def test_a_part_that_declares_another_target_layout_is_refused_where_its_content_is_shared(
  tmp_path, where
):
  parts = _parts(tmp_path, adam_records(8, SHAPES))
  forged = tmp_path / "forged"
  shutil.copytree(parts[3], forged)
  index = read_json(os.path.join(forged, "jaxreshard.json"))
  index["source"]["layout"] = "0" * 64
  write_signed_json(os.path.join(forged, "jaxreshard.json"), index)
  assert _content(forged) == _content(parts[0])
  rest = [p for i, p in enumerate(parts) if i != 3]
  order = rest[:where] + [forged] + rest[where:]
  with pytest.raises(jr.ArchiveError, match="archive 0 does not have the target layout its index"):
    _merge.merge_parts(tmp_path / "out", order)
  assert not os.path.exists(tmp_path / "out")


def test_parts_of_two_saves_or_two_clocks_are_refused_with_table_indexes(tmp_path):
  records = adam_records(8, SHAPES)
  parts = _parts(tmp_path, records)
  again = _parts(tmp_path, records, "again")  # the same state saved twice: one content
  assert _content(again[2]) == _content(parts[0])
  with pytest.raises(PlacementError, match="parts of two different saves are never merged"):
    _merge.merge_parts(tmp_path / "out", parts[:2] + again[2:3] + parts[3:])
  later = [
    jr.ShardRecord(
      r.version, r.placements, (r.state[0]._replace(count=np.int32(9)), r.state[1]), r.roles
    )
    for r in records
  ]
  later_parts = _parts(tmp_path, later, "later")
  with pytest.raises(PlacementError, match="parts of different steps are never merged"):
    _merge.merge_parts(tmp_path / "out", parts[:2] + later_parts[2:3] + parts[3:])
  assert not os.path.exists(tmp_path / "out")


def test_parts_whose_states_are_other_trees_are_refused_naming_what_differs(tmp_path):
  # The refusal said "another optimizer state structure" of both parts, naming nothing.
  records = adam_records(8, SHAPES)
  parts = _parts(tmp_path, records)

  def other(name, state_of, roles_of):
    return _parts(
      tmp_path,
      [jr.ShardRecord(r.version, r.placements, state_of(r), roles_of(r)) for r in records],
      name,
    )

  extra = other("extra", lambda r: (*r.state, np.int32(5)), lambda r: (*r.roles, None))
  with pytest.raises(PlacementError) as info:
    _merge.merge_parts(tmp_path / "out", parts[:2] + extra[2:3] + parts[3:])
  assert f"{extra[2]} holds its optimizer state in another tree than {parts[0]}" in str(
    info.value
  ) and f"(clock scalar [2] is in {extra[2]} only)" in str(info.value), info.value
  nested = other("nested", lambda r: (r.state[0], (r.state[1],)), lambda r: r.roles)
  with pytest.raises(PlacementError) as info:
    _merge.merge_parts(tmp_path / "out", parts[:2] + nested[2:3] + parts[3:])
  assert "(the same clock scalars (1), in other nodes of the state tree)" in str(info.value)
  assert not os.path.exists(tmp_path / "out")


_DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)]
_SHAPES = st.lists(st.integers(0, 9), min_size=0, max_size=2).map(tuple)


@settings(
  max_examples=6,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
  shapes=st.dictionaries(
    st.sampled_from(["a", "b/w", "b/bias", "emb", "z[0]", "é"]),
    st.tuples(_SHAPES, st.sampled_from(_DTYPES)),
    min_size=1,
    max_size=5,
  ),
  source=st.integers(1, 5),
  world=st.integers(1, 6),
)
def test_a_merge_of_table_parts_is_the_one_shot_reshard_bit_for_bit(
  tmp_path_factory, shapes, source, world
):
  """Random params (scalars, empty and size-1 params, bf16/f16, unusual ids) over random
  world sizes: the merge of every one-rank part equals the reshard of every rank."""
  tmp = tmp_path_factory.mktemp("merge")
  records = adam_records(source, shapes)
  parts = _parts(tmp, records, world=world)
  assert len({_content(p) for p in parts}) == 1
  _merge.merge_parts(tmp / "merged", parts[::-1])
  want = jr.reshard_ranks(
    records, [jr.plan(records, world_size=world, rank=r) for r in range(world)]
  )
  got = jr.load_records(tmp / "merged")
  assert len(got) == world
  for g, w in zip(got, want):
    assert_records_equal(g, w)
    for x, y in zip(jax.tree.leaves(g.state), jax.tree.leaves(w.state)):
      assert np.array_equal(bits(x), bits(y))

"""``load_records`` of uniform groups: deferred records over each archive's packed buffers.

An archive that holds one rank of one uniform group is returned as a deferred
record over its packed buffers, read whole (``loaded.LoadedArchives``). Each such
record must be the one the archive gives read leaf by leaf (``Checkpoint.record``):
the same placements, roles, tree, leaf types, weak types and bits; a save of the
loaded records must write the checkpoint's files again byte for byte, every later
archive from its buffers alone; and every refusal is the leaf-by-leaf reader's.
"""

from __future__ import annotations

import gc
import os
import shutil
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import groupfacts as _groupfacts
from jaxreshard._src.checkpoint import loaded as _loaded
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.cli.commands import app
from jaxreshard._src.core.record import deferred_parts
from tests._archive_util import (
  assert_same_files,
  padding_unchecked,
  set_unchecked,
  spy_leaf_by_leaf,
)
from tests._core_util import (
  adam_records,
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  random_params,
  random_state,
  replace_history,
)
from tests._shapes import STORAGE_SHAPES

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "v3_checkpoint")


def _optimizers() -> dict:
  labels = lambda p: jax.tree.map(lambda x: "a" if np.size(x) % 2 else "b", p)  # noqa: E731
  return {
    "adam+hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3)),
    "momentum": optax.sgd(0.1, momentum=0.9),
    "masked": optax.chain(
      optax.masked(optax.scale_by_adam(), lambda p: jax.tree.map(lambda x: np.ndim(x) > 1, p)),
      optax.scale(-0.1),
    ),
    "multi_transform": optax.multi_transform(
      {"a": optax.adam(1e-3), "b": optax.sgd(0.1, momentum=0.5)}, labels
    ),
  }


def _records(opt, shapes: dict, world: int) -> list:
  params = random_params(shapes)
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=world)
  scalar = np.asarray(np.pi, np.float64)  # a float64 clock scalar, whatever x64 says
  return [
    jr.ShardRecord(r.version, r.placements, (r.state, scalar), r.roles + (None,)) for r in records
  ]


def _leaf_kinds(record) -> list:
  return [
    (type(x), getattr(x, "weak_type", None), np.dtype(x.dtype).str, np.shape(x))
    for x in jax.tree_util.tree_leaves(record.state)
  ]


def _assert_as_read_leaf_by_leaf(path, records) -> None:
  with _reader.open_checkpoint(str(path)) as ckpt:
    want = [ckpt.plain_record(i) for i in range(len(ckpt))]
  assert len(records) == len(want)
  for got, w in zip(records, want):
    assert_records_equal(got, w)
    assert _leaf_kinds(got) == _leaf_kinds(w)


@pytest.mark.parametrize("name", list(_optimizers()))
@pytest.mark.parametrize("world", [1, 2, 5, 8, 12])
@pytest.mark.parametrize("n_extra", [0, 140], ids=["json", "table"])
def test_loaded_records_are_deferred_and_saved_again_byte_for_byte(
  tmp_path, monkeypatch, fixed_id, name, world, n_extra
):
  shapes = dict(
    STORAGE_SHAPES,
    tiny=((1,), jnp.float32),
    **{f"extra/{i:03d}": ((i % 11 + 1,), jnp.float32) for i in range(n_extra)},
  )
  records = _records(_optimizers()[name], shapes, world)
  jr.save_records(tmp_path / "a", records)
  if name in ("adam+hyperparams", "multi_transform"):  # >= 280 buffers with the extras
    assert os.path.exists(tmp_path / "a" / _table.TABLE_FILE) == bool(n_extra)
  loaded = jr.load_records(tmp_path / "a")
  assert all(deferred_parts(r) is not None for r in loaded)
  assert all("state" not in vars(r) and "placements" not in vars(r) for r in loaded)
  with monkeypatch.context() as m:
    calls = spy_leaf_by_leaf(m)
    jr.save_records(tmp_path / "b", loaded)
  assert calls == [0]  # every later archive written from its packed buffers
  assert_same_files(tmp_path / "a", tmp_path / "b")
  _assert_as_read_leaf_by_leaf(tmp_path / "a", loaded)
  for got, want in zip(loaded, records):
    assert got.placements == want.placements and got.roles == want.roles
    assert_trees_bit_equal(got.state, want.state)


def test_each_loaded_record_has_clock_scalars_of_its_own(tmp_path):
  records = _records(_optimizers()["adam+hyperparams"], STORAGE_SHAPES, 3)
  jr.save_records(tmp_path / "a", records)
  loaded = jr.load_records(tmp_path / "a")
  assert all(deferred_parts(r) is not None for r in loaded)
  loaded[0].state[1][...] = 2.0  # a write into one rank's numpy clock scalar
  assert float(loaded[1].state[1]) == float(np.pi) == float(loaded[2].state[1])


def test_a_buffer_replaced_in_a_loaded_record_is_what_a_save_writes(tmp_path):
  records = _records(_optimizers()["momentum"], STORAGE_SHAPES, 4)
  jr.save_records(tmp_path / "a", records)
  loaded = jr.load_records(tmp_path / "a")
  trace = loaded[1].state[0][0].trace["dense"]
  old = trace["kernel"]
  trace["kernel"] = np.full_like(old, 7.0)  # the caller's container, another buffer
  jr.save_records(tmp_path / "b", loaded)
  back = jr.load_records(tmp_path / "b")
  got = back[1].state[0][0].trace["dense"]["kernel"]
  assert np.array_equal(got, np.full_like(old, 7.0))
  assert_trees_bit_equal(back[2].state, records[2].state)


def test_an_old_format_checkpoint_loads_as_read_leaf_by_leaf(tmp_path):
  shutil.copytree(DATA, tmp_path / "v3")
  loaded = jr.load_records(tmp_path / "v3")
  assert any(deferred_parts(r) is not None for r in loaded)
  _assert_as_read_leaf_by_leaf(tmp_path / "v3", loaded)


@pytest.mark.parametrize(
  "pid, rank, uint",
  [("half", 4, np.uint16), ("dense/bias", 7, np.uint32)],  # inside a rank; an all-padding rank
)
def test_nonzero_padding_is_refused_with_the_leaf_by_leaf_words(tmp_path, pid, rank, uint):
  records = _records(_optimizers()["momentum"], STORAGE_SHAPES, 8)

  def pad(a):
    a.view(uint)[-1] = 1  # a subnormal: bits that are not zero
    return a

  records[rank] = replace_history(records[rank], pid, 0, pad)
  with padding_unchecked():
    jr.save_records(tmp_path / "bad", records)
  with _reader.open_checkpoint(str(tmp_path / "bad")) as ckpt:
    with pytest.raises(jr.ArchiveError) as want:
      ckpt.plain_record(rank)
  with pytest.raises(jr.ArchiveError) as got:
    jr.load_records(tmp_path / "bad")
  assert "padding is not zero" in str(got.value)
  assert str(got.value) == str(want.value)


def test_archives_of_two_groups_load_as_read_leaf_by_leaf(tmp_path, fixed_id):
  """Two groups of different world sizes over different archives (two expert-parallel
  halves): every archive deferred, one assembly per group."""
  records = adam_records(2, {"x": ((6,), jnp.float32)}) + adam_records(
    3, {"y": ((5,), jnp.bfloat16), "z": ((), jnp.float32)}
  )
  jr.save_records(tmp_path / "a", records)
  loaded = jr.load_records(tmp_path / "a")
  assert all(deferred_parts(r) is not None for r in loaded)
  assert deferred_parts(loaded[0]).assembly is deferred_parts(loaded[1]).assembly
  assert deferred_parts(loaded[1]).assembly is not deferred_parts(loaded[2]).assembly
  _assert_as_read_leaf_by_leaf(tmp_path / "a", loaded)
  for got, want in zip(loaded, records):
    assert_records_equal(got, want)
  jr.save_records(tmp_path / "b", loaded)
  assert_same_files(tmp_path / "a", tmp_path / "b")


def test_an_archive_in_two_groups_is_read_leaf_by_leaf(tmp_path):
  # Archive 0 holds rank 0 of x and of y (two groups); archives 1 and 2 one each.
  def record(held: dict) -> jr.ShardRecord:
    placements = tuple(
      jr.ParamPlacement(p, (5,), r, 2, np.dtype(np.float32), True) for p, (r, _) in held.items()
    )
    state = {"count": np.int32(3), "mu": {p: v for p, (_, v) in held.items()}}
    return jr.ShardRecord(
      1, tuple(sorted(placements, key=lambda p: p.param)), state, (None, *sorted(held))
    )

  x, y = np.arange(6, dtype=np.float32), np.arange(10, 16, dtype=np.float32)
  records = [
    record({"x": (0, x[:3]), "y": (0, y[:3])}),
    record({"x": (1, np.array([x[3], x[4], 0], np.float32))}),
    record({"y": (1, np.array([y[3], y[4], 0], np.float32))}),
  ]
  jr.save_records(tmp_path / "t", records)
  loaded = jr.load_records(tmp_path / "t")
  assert deferred_parts(loaded[0]) is None
  _assert_as_read_leaf_by_leaf(tmp_path / "t", loaded)
  for a, b in zip(records, loaded):
    assert_records_equal(a, b)


def _with_clock(records, value):
  """The same archives with the float64 clock scalar set to ``value``."""
  return [
    jr.ShardRecord(r.version, r.placements, (r.state[0], np.asarray(value, np.float64)), r.roles)
    for r in records
  ]


def test_one_set_of_assemblies_shares_only_equal_content_across_checkpoints(tmp_path):
  records = _records(_optimizers()["adam+hyperparams"], STORAGE_SHAPES, 3)
  jr.save_records(tmp_path / "a", records)
  jr.save_records(tmp_path / "b", records)
  jr.save_records(tmp_path / "c", _with_clock(records, 2.5))
  jr.save_records(tmp_path / "d", _with_clock(records, -0.0))  # 0.0 and -0.0: two clocks
  jr.save_records(tmp_path / "e", _with_clock(records, 0.0))
  shared = _loaded.LoadedArchives()
  made = {}
  for name in "abcde":
    ckpt = jr.open_checkpoint(tmp_path / name)
    made[name] = [ckpt.record(i, shared) for i in range(len(ckpt))]
    _assert_as_read_leaf_by_leaf(tmp_path / name, made[name])
  assembly = {k: deferred_parts(v[0]).assembly for k, v in made.items()}
  assert all(deferred_parts(r).assembly is assembly[k] for k, v in made.items() for r in v)
  assert assembly["a"] is assembly["b"]
  assert len({id(assembly[k]) for k in "acde"}) == 4
  assert [int(bits(r.state[1])) for r in made["d"]] == [1 << 63] * 3


def test_a_merge_writes_every_part_after_the_first_from_its_buffers(tmp_path, monkeypatch):
  records = _records(_optimizers()["adam+hyperparams"], STORAGE_SHAPES, 8)
  jr.save_records(tmp_path / "src", records)
  parts = []
  for r in range(6):
    out = tmp_path / f"part{r}"
    result = CliRunner().invoke(
      app, ["reshard", str(tmp_path / "src"), str(out), "-w", "6", "--rank", str(r)]
    )
    assert result.exit_code == 0, result.output
    parts.append(out)
  with monkeypatch.context() as m:
    calls = spy_leaf_by_leaf(m)
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "merged"), *map(str, parts[::-1])])
  assert result.exit_code == 0, result.output
  assert calls == [0]
  want = jr.reshard_ranks(records, [jr.plan(records, world_size=6, rank=r) for r in range(6)])
  for got, w in zip(jr.load_records(tmp_path / "merged"), want):
    assert_records_equal(got, w)


def test_a_uniform_group_by_the_index_arrays_is_one_param_by_param(tmp_path):
  """``uniform_by_tables`` answers True only for groups ``is_uniform`` finds uniform, and
  does for the one rank of a reshard's part and for two groups of one checkpoint."""
  records = _records(_optimizers()["masked"], STORAGE_SHAPES, 8)
  jr.save_records(tmp_path / "src", records)
  result = CliRunner().invoke(
    app, ["reshard", str(tmp_path / "src"), str(tmp_path / "part"), "-w", "6", "--rank", "4"]
  )
  assert result.exit_code == 0, result.output
  jr.save_records(
    tmp_path / "two",
    adam_records(2, {"x": ((6,), jnp.float32)}) + adam_records(3, {"y": ((5,), jnp.bfloat16)}),
  )
  seen = []
  for name in ("src", "part", "two"):
    ckpt = jr.open_checkpoint(tmp_path / name)
    for gi in range(len(ckpt.groups)):
      fast = _groupfacts.uniform_by_tables(ckpt, gi)
      assert fast <= _groupfacts.is_uniform(ckpt, gi)
      seen.append(fast)
  assert all(seen)
  # A group whose archives have two clocks: not uniform by either.
  mixed = records[:4] + _with_clock(records[4:], 1.0)
  with set_unchecked():
    jr.save_records(tmp_path / "clocks", mixed)
  ckpt = jr.open_checkpoint(tmp_path / "clocks")
  assert not _groupfacts.uniform_by_tables(ckpt, 0) and not _groupfacts.is_uniform(ckpt, 0)


def _hand_records(world: int = 3) -> list:
  """Records whose clock holds a float64 numpy scalar and a dict of hyper-parameters."""

  def place(pid, n, rank):
    return jr.ParamPlacement(pid, (n,), rank, world, np.dtype(np.float32), True)

  def shard(n, rank, seed):
    per = -(-n // world)
    full = np.zeros(per * world, np.float32)
    full[:n] = np.arange(n) + 1 + seed
    return full[rank * per : (rank + 1) * per].copy()

  return [
    jr.ShardRecord(
      1,
      (place("a", 4, r), place("b", 7, r)),
      {
        "count": np.asarray(5, np.int32),
        "hp": {"lr": np.asarray(0.5, np.float32)},
        "mu": {"a": shard(4, r, 0), "b": shard(7, r, 10)},
        "s64": np.asarray(np.pi, np.float64),
      },
      None,
    )
    for r in range(world)
  ]


def _set(obj, name, value):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates setting strides
    setattr(obj, name, value)


# Edits a caller can make to a loaded record's state without replacing any leaf.
EDITS = {
  "clock written in place": lambda st: st["s64"].__setitem__(..., 7.0),
  "clock dtype set": lambda st: _set(st["s64"], "dtype", np.int64),
  "clock shape set": lambda st: _set(st["s64"], "shape", (1,)),
  "dict key renamed": lambda st: st["hp"].__setitem__("lr2", st["hp"].pop("lr")),
  "None added": lambda st: st["hp"].__setitem__("extra", None),
  "view shape set": lambda st: _set(st["mu"]["b"], "shape", (1, -1)),
  "view dtype set": lambda st: _set(st["mu"]["b"], "dtype", np.int32),
  "view strides set": lambda st: _set(st["mu"]["b"], "strides", (0,)),
}


def _outcome(path, records) -> Any:
  try:
    jr.save_records(path, records)
  except jr.ReshardError as e:
    return type(e), str(e).replace(str(path), "OUT")
  return jr.load_records(path)


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("which", [0, 1, "all"])
def test_a_loaded_record_edited_in_place_saves_as_read_leaf_by_leaf(tmp_path, edit, which):
  """The packed buffers say what a record holds only while its state is as made: an
  edit that keeps every leaf object (a write into a clock scalar, a view's shape or
  dtype, a container's keys) must be saved, or refused, as the same edit of the
  records read leaf by leaf."""
  jr.save_records(tmp_path / "src", _hand_records())
  got = jr.load_records(tmp_path / "src")
  assert all(deferred_parts(r) is not None for r in got)
  with _reader.open_checkpoint(str(tmp_path / "src")) as ckpt:
    plain = [ckpt.plain_record(i) for i in range(len(ckpt))]
  # Leaf by leaf, the archives share their clock scalars' objects: each its own here.
  plain = [
    jr.ShardRecord(r.version, r.placements, {**r.state, "s64": np.array(r.state["s64"])}, r.roles)
    for r in plain
  ]
  for records in (got, plain):
    for i, r in enumerate(records):
      if which == "all" or i == which:
        EDITS[edit](r.state)
  new, old = _outcome(tmp_path / "new", got), _outcome(tmp_path / "old", plain)
  if isinstance(old, tuple):
    assert new == old
  else:
    assert not isinstance(new, tuple), new
    for a, b in zip(new, old):
      assert_records_equal(a, b)


def test_a_checkpoint_is_freed_without_the_cycle_collector(tmp_path):
  jr.save_records(tmp_path / "a", _hand_records())
  gc.disable()
  try:
    ckpt = jr.open_checkpoint(tmp_path / "a")
    assert deferred_parts(ckpt.record(0)) is not None
    ref = weakref.ref(ckpt)
    del ckpt
    assert ref() is None
  finally:
    gc.enable()


def test_a_reshard_output_with_a_clock_written_in_place_is_refused_at_save(tmp_path):
  records = _hand_records()
  targets = jr.reshard_ranks(records, [jr.plan(records, world_size=2, rank=r) for r in range(2)])
  assert all(deferred_parts(t) is not None for t in targets)
  targets[1].state["s64"][...] = 7.0
  with pytest.raises(jr.PlacementError, match=r"archive 1 has clock scalar \['s64'\]"):
    jr.save_records(tmp_path / "out", targets)
  assert not os.path.exists(tmp_path / "out")


def test_groups_of_other_params_are_never_compared_for_one_assembly(tmp_path):
  """An expert layout: many groups alike in size, each on archives of its own. Each
  group's assembly is looked for among those of its own params only (it was compared
  with every one made before: load_records took time in the square of the groups)."""
  opt = optax.adam(1e-3)
  records = []
  for g in range(12):
    params = {f"e{g:02d}": {"w0": np.full((5,), g, np.float32), "w1": np.ones((5,), np.float32)}}
    records += jr.shard_state(opt, params, jax.tree.map(np.asarray, opt.init(params)), world_size=2)
  jr.save_records(tmp_path / "c", records)
  with jr.open_checkpoint(tmp_path / "c") as ckpt:
    loaded = [ckpt.record(a) for a in range(len(ckpt))]
    assert all(deferred_parts(r) is not None for r in loaded)
    buckets = ckpt.loaded._content.values()
    assert len(buckets) == 12 and all(len(b) == 1 for b in buckets)
  for got, want in zip(loaded, records, strict=True):
    assert_records_equal(got, want)

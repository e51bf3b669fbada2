"""``IndexBuilder.add_ranks``: every rank of one layout registered from the first.

A global flat-sharded state gives every rank the same state structure, clock and
params; only the placements' rank differs. ``add_ranks`` registers the first rank
leaf by leaf and the others from it. Its index and each archive's ``describes``
must be those of registering every rank leaf by leaf, whatever the world size
(trailing ranks all padding included), the dtypes and the index encoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import plainindex as _plainindex
from jaxreshard._src.checkpoint import writer as _writer
from tests._core_util import adam_records, bits, random_params, random_state
from tests._shapes import STORAGE_SHAPES

F32 = np.dtype(np.float32)
TRAILING = {"one": ((1,), F32), "three": ((3,), F32), "w": ((2, 5), jnp.bfloat16)}


def _plain(records):
  """The same records, each an ordinary record (leaf by leaf for the writer)."""
  return [jr.ShardRecord(r.version, r.placements, r.state, r.roles) for r in records]


def _masked_records(world):
  opt = optax.chain(
    optax.masked(optax.scale_by_adam(), lambda p: {k: k != "emb" for k in p}),
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
  )
  params = random_params(STORAGE_SHAPES, 3)
  return jr.shard_state(opt, params, random_state(opt, params, 4), world)


def _records_of(kind: str, world: int) -> list:
  """Plain records of ``world`` ranks of one of the three layouts the tests cover."""
  if kind == "masked":
    return _plain(_masked_records(world))
  return _plain(adam_records(world, STORAGE_SHAPES if kind == "storage" else TRAILING))


def _both_ways(monkeypatch, records) -> tuple[list, Any, Any]:
  """The archives ``add_ranks`` registered leaf by leaf, and the builders of ``records``
  registered by ``add_ranks`` and each leaf by leaf."""
  slow = _writer.IndexBuilder("0" * 32)
  for r, record in enumerate(records):
    slow.add(r, record, pack=False)
  fast = _writer.IndexBuilder("0" * 32)
  leaf_by_leaf = []
  add = fast._add_record
  monkeypatch.setattr(fast, "_add_record", lambda *a: leaf_by_leaf.append(a[0]) or add(*a))
  fast.add_ranks(range(len(records)), records.__getitem__)
  return leaf_by_leaf, fast, slow


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("kind", ["storage", "trailing", "masked"])
def test_add_ranks_makes_the_entries_of_every_rank_leaf_by_leaf(monkeypatch, table, world, kind):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0 if table else 1 << 30)
  records = _records_of(kind, world)
  leaf_by_leaf, fast, slow = _both_ways(monkeypatch, records)
  assert leaf_by_leaf == [0]
  assert fast.index() == slow.index()
  assert fast.describes == slow.describes
  assert fast.table == table


def test_add_ranks_of_records_in_two_world_sizes_registers_each_leaf_by_leaf(monkeypatch):
  """Records each holding params at two (world size, rank)s are no one block: every rank
  is registered leaf by leaf, as ``add`` registers it."""

  def record(r):
    placements = (
      jr.ParamPlacement("x", (6,), r, 2, F32, True),
      jr.ParamPlacement("y", (5,), r, 3, F32, True),
    )
    state = {"count": np.int32(3), "mu": {"x": np.zeros(3, F32), "y": np.zeros(2, F32)}}
    return jr.ShardRecord(1, placements, state, (None, "x", "y"))

  leaf_by_leaf, fast, slow = _both_ways(monkeypatch, [record(0), record(1)])
  assert leaf_by_leaf == [0, 1]
  assert fast.index() == slow.index() and fast.describes == slow.describes


def test_add_ranks_refuses_a_rank_outside_the_world_size():
  records = _plain(adam_records(2, {"x": ((6,), F32)}))
  with pytest.raises(jr.PlacementError, match="rank 2 is not a rank of world size 2"):
    _writer.IndexBuilder("0" * 32).add_ranks([0, 2], records.__getitem__)


# --- plain records of one layout, packed: the first leaf by leaf, the others from it ---


def _packed_both_ways(monkeypatch, records):
  """The archives the plain fast path took, and the (index, describes, bytes) of
  ``records`` added and packed by a builder with it and by one without it."""
  taken = []
  add = _plainindex.PlainLayouts.add

  def spy(self, builder, index, record, pack):
    got = add(self, builder, index, record, pack)
    if got is not None:
      taken.append(index)
    return got

  monkeypatch.setattr(_plainindex.PlainLayouts, "add", spy)
  fast = _writer.IndexBuilder("0" * 32)
  fast_bytes = [_bytes(fast.add(r, record)) for r, record in enumerate(records)]
  monkeypatch.setattr(_plainindex.PlainLayouts, "add", lambda *a: None)
  slow = _writer.IndexBuilder("0" * 32)
  slow_bytes = [_bytes(slow.add(r, record)) for r, record in enumerate(records)]
  assert fast_bytes == slow_bytes
  return taken, fast, slow


def _bytes(buffers):
  return {d.name: bits(b).tobytes() for d, b in buffers.items()}


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("kind", ["storage", "trailing", "masked"])
def test_plain_records_of_one_layout_give_the_entries_and_bytes_of_leaf_by_leaf(
  monkeypatch, table, world, kind
):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0 if table else 1 << 30)
  records = _records_of(kind, world)
  taken, fast, slow = _packed_both_ways(monkeypatch, records)
  assert taken == list(range(1, world))
  assert fast.index() == slow.index()
  assert fast.describes == slow.describes


def _with_padding(record, value):
  """A copy of a plain record whose last history buffer with padding holds ``value`` there."""
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  placement = {p.param: p for p in record.placements}
  for i in reversed(range(len(leaves))):
    pid = record.roles[i]
    if pid is None:
      continue
    p = placement[pid]
    g = jr.FlatShard(p.shape, p.rank, p.world_size)
    if g.owned < g.slots:
      leaves[i] = leaves[i].copy()
      leaves[i][g.owned] = value
      return jr.ShardRecord(
        record.version,
        record.placements,
        jax.tree_util.tree_unflatten(treedef, leaves),
        record.roles,
      )
  raise AssertionError("no buffer with padding")


@pytest.mark.parametrize("value", [1.0, -0.0, np.nan])
def test_a_later_plain_record_with_nonzero_padding_is_refused_with_the_words_of_leaf_by_leaf(
  monkeypatch, value
):
  records = _plain(adam_records(5, STORAGE_SHAPES))
  records[4] = _with_padding(records[4], value)
  with pytest.raises(jr.PlacementError) as slow:
    builder = _writer.IndexBuilder("0" * 32)
    monkeypatch.setattr(builder._plain, "add", lambda *a: None)
    for r, record in enumerate(records):
      builder.add(r, record)
  monkeypatch.undo()
  with pytest.raises(jr.PlacementError) as fast:
    builder = _writer.IndexBuilder("0" * 32)
    for r, record in enumerate(records):
      builder.add(r, record)
  assert "padding is not zero" in str(slow.value)
  assert str(fast.value) == str(slow.value)


def test_a_plain_record_that_differs_from_the_first_goes_leaf_by_leaf(monkeypatch):
  records = _plain(adam_records(4, STORAGE_SHAPES))
  first = records[1].placements[0]
  odd = [
    # trainable 1 for True: a reader takes it for no bool, and so does the check
    dataclasses.replace(p, trainable=1) if p is first else p
    for p in records[1].placements
  ]
  records[1] = jr.ShardRecord(1, tuple(odd), records[1].state, records[1].roles)
  # a clock of its own: another clock entry, not another path
  leaves, treedef = jax.tree_util.tree_flatten(records[2].state)
  leaves[0] = np.asarray(leaves[0]) + 1
  records[2] = jr.ShardRecord(
    1, records[2].placements, jax.tree_util.tree_unflatten(treedef, leaves), records[2].roles
  )
  with pytest.raises(jr.PlacementError, match="trainable=1, not a bool"):
    _packed_both_ways(monkeypatch, records)
  del records[1]
  taken, fast, slow = _packed_both_ways(monkeypatch, records)
  assert taken == [1, 2]
  assert fast.index() == slow.index() and fast.describes == slow.describes
  assert len(fast.index()["clocks"]) == 2


def test_a_first_plain_record_holding_one_array_at_two_places_is_not_learnt(monkeypatch):
  placements = tuple(jr.ParamPlacement(k, (4,), 0, 2, F32, True) for k in ("a", "b"))
  shared = np.arange(2, dtype=F32)
  records = [
    jr.ShardRecord(1, placements, {"mu": {"a": shared, "b": shared}}, ("a", "b")),
    jr.ShardRecord(
      1,
      tuple(dataclasses.replace(p, rank=1) for p in placements),
      {"mu": {"a": np.arange(2, 4, dtype=F32), "b": np.arange(4, 6, dtype=F32)}},
      ("a", "b"),
    ),
  ]
  taken, fast, slow = _packed_both_ways(monkeypatch, records)
  assert taken == []
  assert fast.index() == slow.index()


def _added(records, fast: bool) -> tuple[str | None, Any]:
  """The refusal (its words) of adding ``records`` to a builder with or without the
  plain fast path, and the builder."""
  builder = _writer.IndexBuilder("0" * 32)
  if not fast:
    builder._plain.add = lambda *a: None
  try:
    for r, record in enumerate(records):
      builder.add(r, record)
  except jr.ReshardError as e:
    return str(e), builder
  return None, builder


@pytest.mark.parametrize("dim", [10.0, np.float64(10), np.int64(10)])
def test_a_later_plain_record_with_a_placement_shape_of_other_numbers_goes_leaf_by_leaf(dim):
  # ParamPlacement keeps a shape it cannot make ints of as it is: (10.0,) == (10,).
  def record(rank, shape):
    p = jr.ParamPlacement("a", (10,), rank, 4, F32, True)
    object.__setattr__(p, "shape", shape)
    g = jr.FlatShard((10,), rank, 4)
    buf = np.zeros(g.slots, F32)
    buf[: g.owned] = 1.0
    return jr.ShardRecord(1, (p,), {"count": np.int32(1), "mu": {"a": buf}}, (None, "a"))

  records = [record(0, (10,)), record(1, (10,)), record(2, (dim,))]
  fast_error, fast = _added(records, fast=True)
  slow_error, slow = _added(records, fast=False)
  assert fast_error == slow_error
  if type(dim) is not np.int64:
    assert "not a sequence of integers" in slow_error
  else:
    assert fast.index() == slow.index() and fast.describes == slow.describes


def test_a_later_plain_record_with_a_dtype_equal_but_not_a_numpy_dtype_goes_leaf_by_leaf():
  # "float32" == np.dtype("float32"), but an index keys its param entries by hash.
  records = _plain(adam_records(3, {"a": ((10,), F32)}))
  p = records[2].placements[0]
  q = jr.ParamPlacement(p.param, p.shape, p.rank, p.world_size, p.dtype, p.trainable)
  object.__setattr__(q, "dtype", "float32")
  records[2] = jr.ShardRecord(1, (q,), records[2].state, records[2].roles)
  fast_error, fast = _added(records, fast=True)
  slow_error, slow = _added(records, fast=False)
  assert fast_error == slow_error
  if slow_error is None:
    assert fast.index() == slow.index() and fast.describes == slow.describes

"""``IndexBuilder.add_ranks``: every rank of one layout registered from the first.

A global flat-sharded state gives every rank the same state structure, clock and
params; only the placements' rank differs. ``add_ranks`` registers the first rank
leaf by leaf and the others from it. Its index and each archive's ``describes``
must be those of registering every rank leaf by leaf, whatever the world size
(trailing ranks all padding included), the dtypes and the index encoding.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import writer as _writer
from tests._core_util import adam_records, random_params, random_state
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
  if kind == "masked":
    records = _plain(_masked_records(world))
  else:
    records = _plain(adam_records(world, STORAGE_SHAPES if kind == "storage" else TRAILING))
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

"""Deferred records are written from their packed buffers: the same files, bit for bit.

A save of deferred records (the host executor's) registers the first rank of a
layout leaf by leaf and every later rank from its rank and buffers alone. The
checkpoint it writes must be byte-identical, file by file, to the one written
from the same records built eagerly (every leaf its own copied array), and must
load back to the source's state.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.cli.commands import app
from jaxreshard._src.core.record import deferred_parts
from jaxreshard._src.engine import pipeline as _pipeline
from tests._archive_util import assert_same_files, padding_unchecked, spy_leaf_by_leaf
from tests._core_util import (
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  random_params,
  random_state,
  replace_history,
)
from tests._shapes import STORAGE_SHAPES

# Uneven splits, trailing all-padding ranks (7 and 9 elements over 8 and 12
# ranks), a scalar, a size-1 and an empty param, bf16 and f16 buffers.
SHAPES = dict(STORAGE_SHAPES, tiny=((1,), jnp.float32))


def _records(shapes: dict, world: int) -> list:
  """Adam records with injected hyper-parameters and a float64 clock scalar."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))
  params = random_params(shapes)
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=world)
  scalar = np.asarray(np.pi, np.float64)  # kept with its bits, whatever x64 says
  return [
    jr.ShardRecord(r.version, r.placements, (r.state, scalar), r.roles + (None,)) for r in records
  ]


def _eager(record: jr.ShardRecord) -> jr.ShardRecord:
  """The record built with its fields, each history buffer a copy of its own."""
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  leaves = [x if role is None else np.array(x) for x, role in zip(leaves, record.roles)]
  return jr.ShardRecord(
    record.version, record.placements, jax.tree_util.tree_unflatten(treedef, leaves), record.roles
  )


@pytest.mark.parametrize("world", [1, 2, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("n_extra", [0, 140], ids=["json", "table"])
def test_deferred_and_eager_records_write_the_samefiles_of(
  tmp_path, monkeypatch, fixed_id, world, n_extra
):
  # 140 more params with 2 Adam buffers each: >= TABLE_MIN_BUFFERS, a binary table.
  shapes = dict(SHAPES, **{f"extra/{i:03d}": ((i % 11,), jnp.float32) for i in range(n_extra)})
  records = _records(shapes, 3)
  targets = jr.reshard_ranks(
    records, [jr.plan(records, world_size=world, rank=r) for r in range(world)]
  )
  assert all(deferred_parts(t) is not None for t in targets)
  with monkeypatch.context() as m:
    calls = spy_leaf_by_leaf(m)
    jr.save_records(tmp_path / "deferred", targets)
  # Only the first rank of the layout was registered leaf by leaf; no other rank's
  # state or placements were made.
  assert calls == [0]
  for t in targets[1:]:
    assert "state" not in vars(t) and "placements" not in vars(t)
  eager = [_eager(t) for t in targets]
  assert all(deferred_parts(t) is None for t in eager)
  jr.save_records(tmp_path / "eager", eager)
  assert os.path.exists(tmp_path / "deferred" / _table.TABLE_FILE) == bool(n_extra)
  assert_same_files(tmp_path / "deferred", tmp_path / "eager")
  back = jr.load_records(tmp_path / "deferred")
  for got, want in zip(back, eager):
    assert_records_equal(got, want)
  assert_trees_bit_equal(jr.unshard_state(back), jr.unshard_state(records))
  scalar = back[-1].state[1]
  assert scalar.dtype == np.float64 and bits(scalar) == bits(np.float64(np.pi))


def test_a_deferred_record_of_another_rank_after_a_changed_buffer_is_written_leaf_by_leaf(
  tmp_path, fixed_id
):
  """A rank whose buffers are not its layout's sizes takes the checks of any record."""
  records = _records(SHAPES, 3)
  targets = jr.reshard_ranks(records, [jr.plan(records, world_size=4, rank=r) for r in range(4)])
  parts = deferred_parts(targets[2])
  d = next(iter(parts.buffers))
  parts.buffers[d] = parts.buffers[d][:-1]
  with pytest.raises(jr.ShapeError, match="archive 2"):
    jr.save_records(tmp_path / "out", targets)
  assert not os.path.exists(tmp_path / "out")


def test_cli_reshard_writes_what_the_eager_records_write(tmp_path, monkeypatch, fixed_id):
  records = _records(SHAPES, 8)
  jr.save_records(tmp_path / "src", records)
  with monkeypatch.context() as m:
    calls = spy_leaf_by_leaf(m)
    result = CliRunner().invoke(
      app, ["reshard", str(tmp_path / "src"), str(tmp_path / "cli"), "-w", "6"]
    )
  assert result.exit_code == 0, result.output
  assert calls == [0]  # every later target rank was written from its packed buffers
  # The same target ranks made in memory (no checkpoint read), built eagerly.
  want = jr.reshard_ranks(records, [jr.plan(records, world_size=6, rank=r) for r in range(6)])
  ckpt = _reader.open_checkpoint(str(tmp_path / "src"))
  eager = _reader.SourcedRecords([_eager(t) for t in want], _reader.Source(ckpt.id, 6))
  jr.save_records(tmp_path / "eager", eager)
  assert_same_files(tmp_path / "cli", tmp_path / "eager")
  assert_trees_bit_equal(
    jr.unshard_state(jr.load_records(tmp_path / "cli")), jr.unshard_state(records)
  )


@pytest.mark.parametrize("batch_bytes", [1, 100, 1 << 30])
@pytest.mark.parametrize("world", [1, 5, 8, 12])
def test_restore_ranks_in_batches_gives_the_in_memory_reshard(
  tmp_path, monkeypatch, batch_bytes, world
):
  """Ranks fetched together (every source buffer read once per batch) or one at a
  time: the bits of an in-memory reshard, and the same progress reports."""
  records = _records(SHAPES, 3)
  jr.save_records(tmp_path / "src", records)
  want = jr.reshard_ranks(
    records, [jr.plan(records, world_size=world, rank=r) for r in range(world)]
  )
  built = []
  batch = _pipeline.build_batch
  monkeypatch.setattr(_pipeline, "build_batch", lambda *a: built.append(len(a[1])) or batch(*a))
  monkeypatch.setattr(_restore, "BATCH_BYTES", batch_bytes)
  seen = []
  got = jr.restore_ranks(tmp_path / "src", range(world), world_size=world, progress=seen.append)
  for g, w in zip(got, want):
    assert_records_equal(_eager(g), _eager(w))
  assert [(p.rank, p.done_bytes, p.total_bytes) for p in seen] == [
    (r, sum(_restore_bytes(want[: r + 1])), sum(_restore_bytes(want))) for r in range(world)
  ]
  if batch_bytes == 1 << 30 and world > 1:
    assert built == [world]  # one fetch for every rank
  if batch_bytes == 1:
    assert built == []  # a batch of one rank is built on its own


def _restore_bytes(targets) -> list[int]:
  """Each target's copied bytes: the owned elements of its history buffers."""
  out = []
  for t in targets:
    n = 0
    for p in t.placements:
      f = jr.FlatShard(p.shape, p.rank, p.world_size)
      n += (f.stop - f.start) * sum(
        np.dtype(x.dtype).itemsize
        for x, role in zip(jax.tree.leaves(t.state), t.roles)
        if role == p.param
      )
    out.append(n)
  return out


def test_batches_hold_at_most_their_bytes_or_one_rank():
  assert _restore.batches([5, 5, 5, 5], 10) == [range(0, 2), range(2, 4)]
  assert _restore.batches([5, 20, 5], 10) == [range(0, 1), range(1, 2), range(2, 3)]
  assert _restore.batches([3, 3, 3], 10) == [range(0, 3)]
  assert _restore.batches([], 10) == []


@pytest.mark.parametrize("batch_bytes", [1, 1 << 30])
def test_a_batch_refuses_non_zero_padding_of_an_all_padding_rank(
  tmp_path, monkeypatch, batch_bytes
):
  """A trailing all-padding source rank whose bits are not zero: refused with the
  message a rank restored on its own gives."""
  records = _records(SHAPES, 8)  # "dense/bias": 7 elements, rank 7 all padding

  def pad(a):
    a.view(np.uint32)[-1] = 0x80000000  # -0.0: bits that are not zero
    return a

  records[7] = replace_history(records[7], "dense/bias", 0, pad)
  with pytest.raises(jr.PlacementError, match="padding is not zero"):
    jr.save_records(tmp_path / "refused", records)  # a save never writes it
  assert os.listdir(tmp_path) == []  # nothing half-written, no temporary left
  with padding_unchecked():
    jr.save_records(tmp_path / "bad", records)
  monkeypatch.setattr(_restore, "BATCH_BYTES", batch_bytes)
  with pytest.raises(jr.ArchiveError) as e:
    jr.restore_ranks(tmp_path / "bad", range(6), world_size=6)
  assert "padding is not zero" in str(e.value) and "dense/bias" in str(e.value)
  alone = []  # what each target rank restored on its own refuses with
  for r in range(6):
    try:
      jr.restore(tmp_path / "bad", world_size=6, rank=r)
    except jr.ArchiveError as one:
      alone.append(str(one))
  assert alone and str(e.value) == alone[0]

"""Deferred records are written from their packed buffers: the same files, bit for bit.

A save of deferred records (the host executor's) registers the first rank of a
layout leaf by leaf and every later rank from its rank and buffers alone. The
checkpoint it writes must be byte-identical, file by file, to the one written
from the same records built eagerly (every leaf its own copied array), and must
load back to the source's state.
"""

from __future__ import annotations

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import writer as _writer
from jaxreshard._src.cli.commands import app
from jaxreshard._src.core.record import deferred_parts
from tests._core_util import (
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  random_params,
  random_state,
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


@pytest.fixture
def fixed_id(monkeypatch):
  """Every save of the test gets one identity (a checkpoint's files name it)."""
  monkeypatch.setattr(
    _writer, "uuid", types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex="0" * 32))
  )


def _files(root) -> dict[str, bytes]:
  out = {}
  for dirpath, _, names in os.walk(root):
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def _assert_same_files(a, b) -> None:
  fa, fb = _files(a), _files(b)
  assert sorted(fa) == sorted(fb)
  for rel in fa:
    assert fa[rel] == fb[rel], rel


def _spy_leaf_by_leaf(monkeypatch) -> list:
  calls = []
  add = _writer.IndexBuilder._add_record
  monkeypatch.setattr(
    _writer.IndexBuilder, "_add_record", lambda self, *a: calls.append(a[0]) or add(self, *a)
  )
  return calls


@pytest.mark.parametrize("world", [1, 2, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("n_extra", [0, 140], ids=["json", "table"])
def test_deferred_and_eager_records_write_the_same_files(
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
    calls = _spy_leaf_by_leaf(m)
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
  _assert_same_files(tmp_path / "deferred", tmp_path / "eager")
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
  result = CliRunner().invoke(
    app, ["reshard", str(tmp_path / "src"), str(tmp_path / "cli"), "-w", "6"]
  )
  assert result.exit_code == 0, result.output
  ckpt = _reader.open_checkpoint(str(tmp_path / "src"))
  targets = jr.restore_ranks(tmp_path / "src", range(6), world_size=6)
  eager = _reader.SourcedRecords([_eager(t) for t in targets], _reader.Source(ckpt.id, 6))
  jr.save_records(tmp_path / "eager", eager)
  _assert_same_files(tmp_path / "cli", tmp_path / "eager")
  assert_trees_bit_equal(
    jr.unshard_state(jr.load_records(tmp_path / "cli")), jr.unshard_state(records)
  )

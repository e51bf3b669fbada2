"""restore / restore_ranks: the core's answer, reading only the bytes a rank needs."""

import jax
import numpy as np
import optax
import pytest
import jax.numpy as jnp

import jaxreshard as jr
from jaxreshard import _archive_io, _restore
from tests._archive_util import adam_records, dir_bytes, file_hashes, params, random_state, rchar
from tests._core_util import assert_records_equal


@pytest.mark.parametrize("src,dst", [(5, 7), (8, 3), (4, 1), (3, 16)])
def test_restore_equals_reshard_of_loaded_records(tmp_path, src, dst):
  opt = optax.chain(optax.masked(optax.adamw(1e-3, mu_dtype=jnp.bfloat16),
                                 {"dense": {"kernel": True, "bias": False}, "emb": True,
                                  "half": False, "scale": True, "empty": True}),
                    optax.scale_by_schedule(lambda c: c))
  prm = params()
  records = jr.shard_state(opt, prm, random_state(opt, prm), src,
                           trainable={"dense/bias": False, "half": False})
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  before = file_hashes(tmp_path / "ckpt")
  targets = _restore.restore_ranks(tmp_path / "ckpt", range(dst), dst)
  for rank, target in enumerate(targets):
    assert_records_equal(target, jr.reshard(records, jr.plan(records, dst, rank)))
  assert_records_equal(jr.restore(tmp_path / "ckpt", rank=dst - 1, world_size=dst), targets[-1])
  assert file_hashes(tmp_path / "ckpt") == before  # inputs never modified


def test_restore_round_trip_through_disk(tmp_path):
  records = adam_records(6)
  jr.save_records(tmp_path / "a", records, chunk_bytes=12)
  jr.save_records(tmp_path / "b", (jr.restore(tmp_path / "a", r, 4) for r in range(4)),
                  chunk_bytes=20)
  back = _restore.restore_ranks(tmp_path / "b", range(6), 6)
  for a, b in zip(back, records, strict=True):
    assert_records_equal(a, b)


def _big_checkpoint(path, world):
  """Two 1M-element f32 parameters under Adam: 16 MiB of history over ``world`` ranks."""
  shapes = {"a": ((1024, 1024), jnp.float32), "b": ((1 << 20,), jnp.float32)}
  records = adam_records(world, shapes)
  jr.save_records(path, records, chunk_bytes=64 << 10)
  return records


def test_16_to_12_reads_only_the_overlapping_ranges(tmp_path):
  records = _big_checkpoint(tmp_path / "ckpt", 16)
  # Target rank 1 of 12 owns [87382, 174764): sources 1 and 2 of 16 only.
  jr.restore(tmp_path / "ckpt", 1, 12)  # warm up: compile, imports
  start = rchar()
  target = jr.restore(tmp_path / "ckpt", 1, 12)
  read = rchar() - start
  assert_records_equal(target, jr.reshard(records, jr.plan(records, 12, 1)))
  total = dir_bytes(tmp_path / "ckpt")
  own = sum(np.asarray(x).nbytes for x, r in zip(
      jax.tree.leaves(target.state), target.roles) if r is not None)
  two_sources = 2 * total // 16
  print(f"16->12 rank 1: read {read} B, checkpoint {total} B, the rank's own {own} B")
  assert read < 1.2 * own  # the rank's bytes plus chunk rounding and metadata
  assert read < two_sources  # less than the two overlapping archives in full
  assert read < total / 10


def test_restore_ranks_opens_each_source_array_once(tmp_path):
  records = adam_records(4)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  reader = _archive_io.Reader()
  targets = _restore.restore_ranks(tmp_path / "ckpt", [2, 0, 1], 3, reader=reader)
  for rank, t in zip([2, 0, 1], targets):
    assert_records_equal(t, jr.reshard(records, jr.plan(records, 3, rank)))
  n_buffers = sum(1 for r in records for role, x in zip(r.roles, jax.tree.leaves(r.state))
                  if role is not None and np.size(x))
  # Every array is opened once for all three ranks; all-padding slices of a
  # parameter smaller than the world (``scale``) are never opened at all.
  assert reader.opened == len(reader._open) < n_buffers
  _restore.restore_ranks(tmp_path / "ckpt", [1], 3, reader=reader)
  assert reader.opened == len(reader._open)

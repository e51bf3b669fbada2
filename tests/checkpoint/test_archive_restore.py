"""restore / restore_ranks: the core's answer, reading only the bytes a rank needs."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import restore as _restore
from tests._archive_util import dir_bytes, file_hashes
from tests._core_util import (
  STORAGE_SHAPES,
  adam_records,
  assert_records_equal,
  random_params,
  random_state,
  rchar,
)


@pytest.mark.parametrize("src,dst", [(5, 7), (8, 3), (4, 1), (3, 16)])
def test_restore_equals_reshard_of_loaded_records(tmp_path, src, dst):
  opt = optax.chain(
    optax.masked(
      optax.adamw(1e-3, mu_dtype=jnp.bfloat16),
      {
        "dense": {"kernel": True, "bias": False},
        "emb": True,
        "half": False,
        "scale": True,
        "empty": True,
      },
    ),
    optax.scale_by_schedule(lambda c: c),
  )
  prm = random_params(STORAGE_SHAPES)
  records = jr.shard_state(
    opt, prm, random_state(opt, prm), src, trainable={"dense/bias": False, "half": False}
  )
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  before = file_hashes(tmp_path / "ckpt")
  targets = _restore.restore_ranks(tmp_path / "ckpt", range(dst), world_size=dst)
  for rank, target in enumerate(targets):
    assert_records_equal(target, jr.reshard(records, jr.plan(records, world_size=dst, rank=rank)))
  assert_records_equal(jr.restore(tmp_path / "ckpt", world_size=dst, rank=dst - 1), targets[-1])
  assert file_hashes(tmp_path / "ckpt") == before  # inputs never modified


def test_restore_round_trip_through_disk(tmp_path):
  records = adam_records(6)
  jr.save_records(tmp_path / "a", records, chunk_bytes=12)
  jr.save_records(
    tmp_path / "b",
    (jr.restore(tmp_path / "a", world_size=4, rank=r) for r in range(4)),
    chunk_bytes=20,
  )
  back = _restore.restore_ranks(tmp_path / "b", range(6), world_size=6)
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
  jr.restore(tmp_path / "ckpt", world_size=12, rank=1)  # warm up: compile, imports
  start = rchar()
  target = jr.restore(tmp_path / "ckpt", world_size=12, rank=1)
  read = rchar() - start
  assert_records_equal(target, jr.reshard(records, jr.plan(records, world_size=12, rank=1)))
  total = dir_bytes(tmp_path / "ckpt")
  own = sum(
    np.asarray(x).nbytes
    for x, r in zip(jax.tree.leaves(target.state), target.roles)
    if r is not None
  )
  two_sources = 2 * total // 16
  print(f"16->12 rank 1: read {read} B, checkpoint {total} B, the rank's own {own} B")
  assert read < 1.2 * own  # the rank's bytes plus chunk rounding and metadata
  assert read < two_sources  # less than the two overlapping archives in full
  assert read < total / 10


def test_restore_reads_only_the_overlapping_archives(tmp_path):
  """Planning needs only the index: archives that do not overlap the target may be
  gone, but for the first of the group, whose archive.json vouches for the skeleton
  and clock scalars the target takes from the index."""
  records = adam_records(16, {"a": ((160,), jnp.float32), "b": ((32, 5), jnp.bfloat16)})
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=16)
  expected = jr.reshard(records, jr.plan(records, world_size=12, rank=1))
  # Target rank 1 of 12 owns [14, 28) of "a" (slots 10 at 16 ranks: sources 1 and 2)
  # and [14, 28) of "b" (160 elements too): nothing of sources 0 or 3..15.
  for r in range(3, 16):
    shutil.rmtree(tmp_path / "ckpt" / f"archive_{r:05d}")
  assert_records_equal(jr.restore(tmp_path / "ckpt", world_size=12, rank=1), expected)
  with pytest.raises(jr.ArchiveError, match="archive_00003"):
    jr.restore(tmp_path / "ckpt", world_size=12, rank=2)
  os.remove(tmp_path / "ckpt" / "archive_00000" / "archive.json")
  with pytest.raises(jr.ArchiveError, match=r"archive 0: .*archive_00000/archive.json is missing"):
    jr.restore(tmp_path / "ckpt", world_size=12, rank=1)


def test_restore_ranks_shares_one_index(tmp_path):
  records = adam_records(4)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  ckpt = jr.open_checkpoint(tmp_path / "ckpt")
  targets = _restore.restore_ranks(tmp_path / "ckpt", [2, 0, 1], world_size=3, checkpoint=ckpt)
  for rank, t in zip([2, 0, 1], targets):
    assert_records_equal(t, jr.reshard(records, jr.plan(records, world_size=3, rank=rank)))

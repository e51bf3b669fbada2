"""A regular checkpoint is planned from its index's arrays (``regular``): the same read
plans, records and refusals as the general path (validation of each migration)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint import writer as _writer
from tests._archive_util import read_json, shard_file, write_consistent_index
from tests._core_util import F32, adam_records, assert_records_equal
from tests._v3_recipe import records as v3_records

SHAPES = {
  "a/w": ((7, 3), F32),
  "a/b": ((5,), F32),
  "s": ((), F32),
  "z": ((0,), F32),
  "one": ((1,), F32),
}


@pytest.fixture(params=["json", "table"])
def encoding(request, monkeypatch):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0 if request.param == "table" else 1 << 30)
  return request.param


def _general(monkeypatch):
  monkeypatch.setattr(_regular, "regular", lambda ckpt: None)


@pytest.mark.parametrize("records", [lambda: adam_records(4, SHAPES), v3_records])
def test_plans_and_records_equal_the_general_paths(tmp_path, monkeypatch, encoding, records):
  path = tmp_path / "c"
  jr.save_records(path, records())
  assert _regular.regular(jr.open_checkpoint(path)) is not None
  for world in (1, 2, 3, 5, 9):
    ranks = list(range(world))
    fast = jr.restore_ranks(path, ranks, world_size=world)
    plans = [
      _read_plan.read_plan(jr.open_checkpoint(path), world_size=world, rank=r) for r in ranks
    ]
    with monkeypatch.context() as m:
      _general(m)
      slow = jr.restore_ranks(path, ranks, world_size=world)
      want = [
        _read_plan.read_plan(jr.open_checkpoint(path), world_size=world, rank=r) for r in ranks
      ]
    for a, b in zip(fast, slow):
      assert_records_equal(a, b)
    for p, q in zip(plans, want):
      assert (p.reads, p.target_bytes, p.per_archive) == (q.reads, q.target_bytes, q.per_archive)


@pytest.mark.parametrize("target", [(3, 3), (3, -1), (0, 0), (True, 4), (2**21, 1), (1.0, 2)])
def test_an_invalid_target_is_refused_in_the_same_words(tmp_path, monkeypatch, target):
  path = tmp_path / "c"
  jr.save_records(path, adam_records(2, SHAPES))
  world, rank = target

  def words(fn):
    with pytest.raises(jr.ReshardError) as info:
      fn()
    return type(info.value), str(info.value)

  fast = [
    words(lambda: jr.restore(path, world_size=world, rank=rank)),
    words(lambda: _read_plan.read_plan(jr.open_checkpoint(path), world_size=world, rank=rank)),
  ]
  _general(monkeypatch)
  slow = [
    words(lambda: jr.restore(path, world_size=world, rank=rank)),
    words(lambda: _read_plan.read_plan(jr.open_checkpoint(path), world_size=world, rank=rank)),
  ]
  assert fast == slow


def test_a_checkpoint_that_is_not_regular_takes_the_general_path(tmp_path):
  path = tmp_path / "c"
  jr.save_records(path, adam_records(4, SHAPES))
  index = read_json(path / "jaxreshard.json")
  index["groups"][0]["ranks"].pop()  # archive 3 leaves the group: incomplete
  write_consistent_index(path, index)
  ckpt = jr.open_checkpoint(path)
  assert _regular.regular(ckpt) is None
  for fn in (
    lambda: jr.restore(path, world_size=2, rank=0),
    lambda: _read_plan.read_plan(ckpt, world_size=2, rank=0),
  ):
    with pytest.raises(jr.PlacementError, match="missing ranks"):
      fn()


def test_records_of_two_groups_are_regular_and_exact(tmp_path):
  # Two parameter groups over different archives (say, two expert-parallel halves).
  left = adam_records(2, {"x": ((6,), F32)})
  right = adam_records(3, {"y": ((5,), F32)})
  records = left + right
  path = tmp_path / "c"
  jr.save_records(path, records)
  assert _regular.regular(jr.open_checkpoint(path)) is not None  # two layouts, one clock
  for r in range(2):
    assert_records_equal(
      jr.restore(path, world_size=2, rank=r),
      jr.reshard(records, jr.plan(records, world_size=2, rank=r)),
    )


def test_target_ranks_through_one_opened_checkpoint_share_a_family_per_world_size(tmp_path):
  """What every target rank of one world size shares (layout, record structure) and each
  rank's table are kept by the opened checkpoint (``memo.families``): restores through it
  again give the same bits as a fresh open and as ``reshard``."""
  records = adam_records(4, SHAPES)
  path = tmp_path / "c"
  jr.save_records(path, records)
  ckpt = jr.open_checkpoint(path)
  for _ in range(2):
    for world in (3, 5):
      got = jr.restore_ranks(path, list(range(world)), world_size=world, checkpoint=ckpt)
      for rank, rec in enumerate(got):
        want = jr.reshard(records, jr.plan(records, world_size=world, rank=rank))
        assert_records_equal(rec, want)
        assert_records_equal(jr.restore(path, world_size=world, rank=rank), want)
  assert sorted(ckpt.memo.families) == [3, 5]
  reg = _regular.regular(ckpt)
  one = _regular.rank_groups(reg, 3, 1, ckpt.memo.families)
  assert one is _regular.rank_groups(reg, 3, 1, ckpt.memo.families)
  assert one.family is ckpt.memo.families[3]
  assert jr.open_checkpoint(path).memo.families == {}  # another open learns it again


def _scaled_records(scale: float) -> list:
  """Adam records over 4 ranks whose moments are ``scale`` x the params (and its square)."""
  import optax  # pylint: disable=g-import-not-at-top

  params = {"a": {"w": jnp.arange(1, 22, dtype=jnp.float32).reshape(7, 3)}}
  params["b"] = jnp.arange(1, 6, dtype=jnp.float32)
  opt = optax.adam(1e-3)
  adam, *rest = opt.init(params)
  s = jnp.float32(scale)
  adam = adam._replace(
    mu=jax.tree.map(lambda p: p * s, params), nu=jax.tree.map(lambda p: p * p * s, params)
  )
  return jr.shard_state(opt, params, (adam, *rest), world_size=4)


@pytest.mark.parametrize("change", ["flipped_byte", "archive_of_another_save"])
def test_a_buffer_changed_between_two_restores_through_one_opened_checkpoint_is_refused(
  tmp_path, change
):
  """An opened checkpoint keeps what it read of the index and each archive.json for its
  life; the buffer bytes are read and checked against them on every restore."""
  path = tmp_path / "c"
  jr.save_records(path, _scaled_records(1.0))
  ckpt = jr.open_checkpoint(path)
  jr.restore_ranks(path, [0], world_size=3, checkpoint=ckpt)
  if change == "flipped_byte":
    with open(shard_file(path, 0), "r+b") as f:
      byte = f.read(1)[0]
      f.seek(0)
      f.write(bytes([byte ^ 0x40]))
  else:
    # The same layout with other buffer bytes, saved as a checkpoint of its own.
    jr.save_records(tmp_path / "o", _scaled_records(2.0))
    assert _bytes(shard_file(tmp_path / "o", 0)) != _bytes(shard_file(path, 0))
    shutil.rmtree(path / "archive_00000")
    shutil.copytree(tmp_path / "o" / "archive_00000", path / "archive_00000")
  with pytest.raises(jr.ArchiveError, match="crc32c"):
    jr.restore_ranks(path, [0], world_size=3, checkpoint=ckpt)
  with pytest.raises(jr.ArchiveError):
    jr.restore(path, world_size=3, rank=0)


def _bytes(path) -> bytes:
  with open(path, "rb") as f:
    return f.read()

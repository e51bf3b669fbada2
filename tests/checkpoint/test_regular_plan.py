"""A regular checkpoint is planned from its index's arrays (``regular``): the same read
plans, records and refusals as the general path (validation of each migration)."""

from __future__ import annotations

import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint import writer as _writer
from tests._archive_util import read_json, write_consistent_index
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

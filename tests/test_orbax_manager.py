"""A real orbax CheckpointManager saving jaxreshard archives and restoring on a new world size."""

import os

import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from tests._archive_util import adam_records
from tests._core_util import assert_records_equal


def _steps():
  # A different state per step (different random bits), 4 ranks each.
  return {step: adam_records(4, seed=step) for step in (10, 20, 30)}


def test_manager_keeps_steps_and_restores_the_latest_on_a_new_world_size(tmp_path):
  steps = _steps()
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    for step, records in steps.items():
      manager.save(step, args=jr.ReshardSave(iter(records), chunk_bytes=16))
    manager.wait_until_finished()
    assert manager.all_steps() == [20, 30]

  # A restart on 3 ranks: a new manager, each rank restores its own slice.
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    latest = manager.latest_step()
    assert latest == 30
    records = steps[latest]
    for rank in range(3):
      target = manager.restore(latest, args=jr.ReshardRestore(rank=rank, world_size=3))
      assert_records_equal(target, jr.reshard(records, jr.plan(records, world_size=3, rank=rank)))
    # Without a rank: every archive, exactly as saved.
    for a, b in zip(manager.restore(20, args=jr.ReshardRestore()), steps[20], strict=True):
      assert_records_equal(a, b)
  # Orbax owns the step directories; the item directory holds the jaxreshard layout.
  item = tmp_path / "run" / "30" / "default"
  assert sorted(os.listdir(item))[:2] == ["archive_00000", "archive_00001"]
  assert (item / "jaxreshard.json").is_file()


def test_one_item_of_a_composite_checkpoint(tmp_path):
  records = adam_records(5)
  with ocp.CheckpointManager(tmp_path / "run", item_names=("opt", "meta")) as manager:
    manager.save(7, args=ocp.args.Composite(
        opt=jr.ReshardSave(records), meta=ocp.args.JsonSave({"lr": 0.1})))
    manager.wait_until_finished()
    out = manager.restore(7, args=ocp.args.Composite(
        opt=jr.ReshardRestore(rank=1, world_size=2), meta=ocp.args.JsonRestore()))
  assert out.meta == {"lr": 0.1}
  assert_records_equal(out.opt, jr.reshard(records, jr.plan(records, world_size=2, rank=1)))


def test_handler_refusals_reach_the_caller(tmp_path):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(2)))
    manager.wait_until_finished()
    with pytest.raises(jr.PlacementError):
      manager.restore(1, args=jr.ReshardRestore(rank=3, world_size=3))

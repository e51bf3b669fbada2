"""A save commits only archives that restore: one complete set of ranks of one
optimizer state. What every target rank's reshard of the records refuses, the save
refuses with the same class and words, and leaves nothing; the same archives put on
a disk by another writer are refused by every reader with those words too."""

import os
from unittest import mock

import jax.numpy as jnp
import optax
import pytest

import jaxreshard as jr
from tests._archive_util import set_unchecked


def _records(opt=None, world=4, dtype=jnp.float32, shape=(3, 4), **kw):
  opt = opt or optax.adam(1e-3)
  params = {"a": jnp.ones(shape, dtype), "b": jnp.ones((5,), jnp.float32)}
  return jr.shard_state(opt, params, opt.init(params), world_size=world, **kw)


def _at_step(records, count):
  import dataclasses

  import numpy as np

  out = []
  for r in records:
    adam = r.state[0]._replace(count=np.asarray(count, np.int32))
    out.append(dataclasses.replace(r, state=(adam, *r.state[1:])))
  return out


SETS = {
  "world sizes": lambda: _records()[:2] + _records(world=8)[2:],
  "storage dtypes": lambda: _records()[:2] + _records(dtype=jnp.bfloat16)[2:],
  "shapes": lambda: _records()[:2] + _records(shape=(4, 3))[2:],
  "trainability": lambda: _records()[:2] + _records(trainable={"a": False, "b": True})[2:],
  "optimizers": lambda: _records()[:2] + _records(optax.adamw(1e-3))[2:],
  "steps": lambda: _records()[:2] + _at_step(_records(), 7)[2:],
  "a missing rank": lambda: _records()[:3],
  "a rank twice": lambda: _records() + _records()[1:2],
}


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_save_refuses_what_a_reshard_refuses_and_leaves_nothing(tmp_path, name):
  records = SETS[name]()
  with pytest.raises(jr.ReshardError) as memory:
    jr.reshard(records, [m for m in jr.plan(records, world_size=3, rank=0)])
  path = tmp_path / "ckpt"
  with pytest.raises(jr.ReshardError) as saved:
    jr.save_records(path, records)
  assert type(saved.value) is type(memory.value), (saved.value, memory.value)
  assert str(saved.value) == (
    f"{path}: this save would not restore, so nothing is committed: {memory.value}"
  )
  assert os.listdir(tmp_path) == []
  # Put on a disk by another writer: every reader refuses it with the memory path's words.
  with set_unchecked():
    jr.save_records(path, records)
  for read in (
    lambda: jr.restore(path, world_size=3, rank=0),
    lambda: jr.restore_ranks(path, range(3), world_size=3),
    lambda: jr.reshard(jr.load_records(path), jr.plan(jr.load_records(path), world_size=3, rank=0)),
  ):
    with pytest.raises(jr.ReshardError) as got:
      read()
    assert type(got.value) is type(memory.value) and str(got.value) == str(memory.value)


def test_a_save_of_one_complete_set_commits():
  import tempfile

  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  jr.save_records(path, _records())
  assert len(jr.load_records(path)) == 4


@pytest.mark.parametrize("name", ["steps", "a missing rank", "storage dtypes"])
def test_an_orbax_save_of_records_refuses_them_when_made(tmp_path, name):
  """``ReshardSave(records)`` checks its save's refusals when it is made: a set that
  would not restore is refused there, with the reshard's class and words, before a
  manager makes a step."""
  import orbax.checkpoint as ocp

  records = SETS[name]()
  with pytest.raises(jr.ReshardError) as memory:
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  with pytest.raises(jr.ReshardError) as made:
    jr.ReshardSave(records)
  assert type(made.value) is type(memory.value) and str(made.value) == str(memory.value)
  # Past that check (patched out here), the handler refuses to commit the step.
  from jaxreshard._src.orbax import args as args_module

  with mock.patch.object(args_module, "check", lambda args: args_module.Checked(None, None)):
    save = jr.ReshardSave(records)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(jr.ArchiveError, match="does not load"):
      manager.save(1, args=save)
      manager.wait_until_finished()
    assert manager.all_steps() == []

"""Arrays whose buffers were freed (a step donated them) are named by every public call
that takes them: the argument and the leaf's key path, a ReshardError (it was jax's
bare "Array has been deleted", or, for flat_sharded's update outside jit, a crash)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from tests._core_util import device_mesh


def _records():
  opt = optax.adam(1e-3)
  params = {"w": jnp.arange(5.0), "b": jnp.ones(3)}
  with jax.numpy_dtype_promotion("standard"):
    state = opt.init(params)
  return opt, params, jr.shard_state(opt, params, state, world_size=2)


def _fresh_leaf(tree, path):
  """``tree`` with the leaf at ``path`` replaced by a fresh copy (so that deleting it
  deletes nothing another value shares), and that copy."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out, chosen = [], None
  for p, leaf in leaves:
    if jax.tree_util.keystr(p) == path:
      leaf = chosen = jnp.array(leaf, copy=True)
    out.append(leaf)
  assert chosen is not None, path
  return jax.tree_util.tree_unflatten(treedef, out), chosen


@pytest.mark.parametrize(
  "call",
  [
    "reshard-host",
    "reshard-device",
    "reshard_ranks",
    "unshard_state",
    "save_records",
    "save_records-generator",
    "digest",
  ],
)
def test_records_holding_a_freed_buffer_are_named(tmp_path, call):
  _, _, records = _records()
  state, leaf = _fresh_leaf(records[1].state, "[0].mu['w']")
  records[1] = jr.ShardRecord(records[1].version, records[1].placements, state, records[1].roles)
  plan = jr.plan(records, world_size=3, rank=2)
  leaf.delete()
  run = {
    "reshard-host": lambda: jr.reshard(records, plan, executor="host"),
    "reshard-device": lambda: jr.reshard(records, plan, executor="device"),
    "reshard_ranks": lambda: jr.reshard_ranks(records, [plan]),
    "unshard_state": lambda: jr.unshard_state(records),
    "save_records": lambda: jr.save_records(tmp_path / "ck", records),
    # Consumed as it is written: the record being written is still named.
    "save_records-generator": lambda: jr.save_records(tmp_path / "ck", (r for r in records)),
    "digest": lambda: jr.digest(records),
  }[call]
  with pytest.raises(
    jr.ReshardError, match=r"^records(_or_directory)?\[1\]\.state\[0\]\.mu\['w'\] is a deleted"
  ):
    run()
  assert not (tmp_path / "ck").exists()


def test_a_generator_that_reshards_inside_a_save_names_what_the_reshard_was_given(tmp_path):
  """save_records of a generator of reshard's targets, one source leaf freed: the leaf is
  in none of save_records' arguments (the generator yields nothing before it fails),
  so the call inside names it among its own arguments. (It was jax's bare error.)"""
  _, _, records = _records()
  state, leaf = _fresh_leaf(records[1].state, "[0].mu['w']")
  records[1] = jr.ShardRecord(records[1].version, records[1].placements, state, records[1].roles)
  plans = [jr.plan(records, world_size=3, rank=r) for r in range(3)]
  leaf.delete()
  with pytest.raises(jr.ReshardError) as info:
    jr.save_records(tmp_path / "ck", (jr.reshard(records, p) for p in plans))
  assert str(info.value).startswith(
    "records[1].state[0].mu['w'] (given to reshard inside the call) is a deleted jax array"
  ), info.value
  assert not (tmp_path / "ck").exists()
  # The outer call's own arguments are named first, as before.
  with pytest.raises(jr.ReshardError, match=r"^records\[1\]\.state\[0\]\.mu\['w'\] is a"):
    jr.reshard_ranks(records, plans)


def test_a_state_holding_a_freed_clock_is_named_by_shard_state():
  opt, params, _ = _records()
  with jax.numpy_dtype_promotion("standard"):
    state, count = _fresh_leaf(opt.init(params), "[0].count")
  count.delete()
  with pytest.raises(jr.ReshardError, match=r"^state\[0\]\.count is a deleted jax array"):
    jr.shard_state(opt, params, state, world_size=2)


@pytest.mark.parametrize("records_as", [list, iter])
def test_a_reshard_save_of_records_holding_a_freed_buffer_is_named(records_as):
  _, _, records = _records()
  state, leaf = _fresh_leaf(records[1].state, "[0].mu['w']")
  records[1] = jr.ShardRecord(records[1].version, records[1].placements, state, records[1].roles)
  leaf.delete()
  with pytest.raises(jr.ReshardError, match=r"^records\[1\]\.state\[0\]\.mu\['w'\] is a deleted"):
    jr.ReshardSave(records_as(records))


def test_a_manager_save_of_records_freed_after_their_args_were_made_is_named(tmp_path):
  _, _, records = _records()
  state, leaf = _fresh_leaf(records[0].state, "[0].nu['b']")
  records[0] = jr.ShardRecord(records[0].version, records[0].placements, state, records[0].roles)
  args = jr.ReshardSave(records)
  leaf.delete()  # a donating step, after the save's arguments were checked
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(jr.ReshardError, match=r"^records\[0\]\.state\[0\]\.nu\['b'\] is a deleted"):
      manager.save(1, args=args)
    manager.wait_until_finished()
    assert manager.all_steps() == []


def test_a_reshard_save_of_a_mesh_state_holding_a_freed_buffer_is_named():
  mesh = device_mesh((4,), ("fsdp",))
  opt = optax.adam(1e-3)
  params = {"w": jnp.arange(5.0)}
  with jax.numpy_dtype_promotion("standard"):
    sharded = jr.shard_to_mesh(opt, params, opt.init(params), mesh)
  state, count = _fresh_leaf(sharded.state, "[0].count")
  count.delete()
  with pytest.raises(jr.ReshardError, match=r"^state\[0\]\.count is a deleted jax array"):
    jr.ReshardSave(state=state, optimizer=opt, shapes={"w": (5,)}, mesh=mesh)


@pytest.mark.parametrize("call", ["gather_from_mesh", "save_sharded", "update"])
def test_mesh_states_and_params_holding_a_freed_buffer_are_named(tmp_path, call):
  mesh = device_mesh((4,), ("fsdp",))
  opt = jr.flat_sharded(optax.adam(1e-3), mesh)
  params = {"w": jnp.arange(5.0)}
  with jax.numpy_dtype_promotion("standard"):
    state = opt.init(params)
    # A donating step frees the state it was given.
    _, _ = jax.jit(opt.update, donate_argnums=1)(params, state, params)
  assert jax.tree.leaves(state)[0].is_deleted()
  run = {
    "gather_from_mesh": lambda: jr.gather_from_mesh(optax.adam(1e-3), state, {"w": (5,)}, mesh),
    "save_sharded": lambda: jr.save_sharded(
      tmp_path / "ck", optax.adam(1e-3), state, {"w": (5,)}, mesh
    ),
    "update": lambda: opt.update(params, state, params),
  }[call]
  with pytest.raises(jr.ReshardError, match=r"^state\[0\]\.count is a deleted jax array"):
    with jax.numpy_dtype_promotion("standard"):
      run()
  assert not (tmp_path / "ck").exists()


def test_other_runtime_errors_pass_through_as_they_are():
  """Only jax's error for a deleted array is renamed; the wrapper keeps the rest."""
  from jaxreshard._src.core import deleted

  @deleted.names_deleted
  def fails(records):
    raise RuntimeError("something else")

  _, _, records = _records()
  with pytest.raises(RuntimeError, match="^something else$"):
    fails(records)

  @deleted.names_deleted
  def says_deleted(records):
    raise RuntimeError("Array has been deleted with shape=float32[3].")

  # Nothing among the arguments is deleted: jax's own error, unchanged.
  with pytest.raises(RuntimeError, match="^Array has been deleted"):
    says_deleted(records)

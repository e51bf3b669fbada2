"""A save of a state on a mesh makes its index once, when it is checked.

``ReshardSave(state=...)`` checks the index of every rank (under a placeholder
identity and clock) when it is made; the save then stamps it with its own
identity and the state's clock (``sharded.stamped_index``). The index written
must be the one of registering every rank's host record leaf by leaf, whatever
the clock holds (weak and strong jax scalars, typed PRNG keys, numpy and Python
scalars jax cannot hold), the storage dtypes and the index encoding.
"""

from __future__ import annotations

import base64
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import deferredindex as _deferredindex
from jaxreshard._src.checkpoint import writer as _writer
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.distributed import mesh as _mesh
from jaxreshard._src.distributed import sharded as _sharded
from jaxreshard._src.orbax import handler as _handler
from tests._core_util import device_mesh, random_params, random_state
from tests._shapes import STORAGE_SHAPES

_NAN_PAYLOAD = np.frombuffer(bytes.fromhex("0100000000f8ff7f"), np.float64)[0]


def _with_clock(leaf):
  """An sgd with momentum whose count and learning rate are both ``leaf``."""
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  params = random_params({"w": ((10,), np.float32), "b": ((3,), np.float32)}, 1)
  state = opt.init(params)
  state = state._replace(count=leaf, hyperparams={**state.hyperparams, "learning_rate": leaf})
  return opt, params, state


def _example(kind):
  if kind == "adam_storage":
    opt = optax.adam(1e-3)
    params = random_params(STORAGE_SHAPES, 3)
    return opt, params, random_state(opt, params, 4)
  if kind == "masked_chain":
    opt = optax.chain(
      optax.masked(optax.scale_by_adam(), lambda p: {k: k != "emb" for k in p}),
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    )
    params = random_params(STORAGE_SHAPES, 5)
    return opt, params, random_state(opt, params, 6)
  if kind == "noisy_sgd_key":
    opt = optax.noisy_sgd(0.1, key=jax.random.key(7))
    params = random_params({"w": ((10,), np.float32)}, 2)
    return opt, params, opt.init(params)
  leaf = {
    "weak_int": jnp.asarray(3),  # weakly typed
    "strong_int32": jnp.asarray(7, jnp.int32),
    "float32_negative_zero": jnp.asarray(-0.0, jnp.float32),
    "float64_nan_payload": _NAN_PAYLOAD,  # a numpy scalar jax would cut
    "int64_past_int32": np.int64(2**40 + 3),
    "python_float": 0.1,
    "python_int": 7,
  }[kind]
  return _with_clock(leaf)


KINDS = [
  "adam_storage",
  "masked_chain",
  "noisy_sgd_key",
  "weak_int",
  "strong_int32",
  "float32_negative_zero",
  "float64_nan_payload",
  "int64_past_int32",
  "python_float",
  "python_int",
]


def _leaf_by_leaf(checkpoint_id, opt, state, params, mesh):
  """The index of every rank's host record registered leaf by leaf (no ``add_ranks``)."""
  shapes = _shapes(params)
  views = _mesh.records_from_mesh(opt, state, shapes, mesh, "fsdp")
  builder = _writer.IndexBuilder(checkpoint_id)
  for r in sorted(views):
    snap = _sharded.host_record(views[r])
    builder.add(
      r, jr.ShardRecord(snap.version, snap.placements, snap.state, snap.roles), pack=False
    )
  return builder.index()


def _shapes(params):
  """Param id -> its shape and dtype, as ``save_sharded`` takes them."""
  ids, leaves, _ = _structure.param_ids(params)
  return {pid: jax.ShapeDtypeStruct(np.shape(x), x.dtype) for pid, x in zip(ids, leaves)}


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_a_saves_index_is_that_of_every_rank_registered_leaf_by_leaf(
  monkeypatch, table, world, kind
):
  monkeypatch.setattr(_writer, "TABLE_MIN_BUFFERS", 0 if table else 1 << 30)
  opt, params, state = _example(kind)
  mesh = device_mesh((world,), ("fsdp",), jax.devices()[:world])
  on_mesh = jr.shard_to_mesh(opt, params, state, mesh).state
  args = jr.ReshardSave(state=on_mesh, optimizer=opt, params=params, mesh=mesh)
  prepared = _handler.prepare_save(args)
  want = _leaf_by_leaf(prepared.checkpoint_id, opt, on_mesh, params, mesh)
  assert prepared.index == want
  assert ("structures" in prepared.index) == table


def test_a_save_makes_the_index_of_its_ranks_once(monkeypatch, tmp_path):
  opt, params, state = _example("adam_storage")
  mesh = device_mesh((8,), ("fsdp",))
  on_mesh = jr.shard_to_mesh(opt, params, state, mesh).state
  calls = []
  add_ranks = _deferredindex.add_ranks
  monkeypatch.setattr(
    _deferredindex, "add_ranks", lambda *a: calls.append(list(a[1])) or add_ranks(*a)
  )
  jr.save_sharded(tmp_path / "c", opt, on_mesh, _shapes(params), mesh)
  assert calls == [list(range(8))]
  restored = jr.restore_sharded(tmp_path / "c", mesh).state
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(on_mesh)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_two_saves_of_one_checked_state_each_carry_their_own_identity_and_clock(tmp_path):
  opt, params, state = _example("weak_int")
  mesh = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  on_mesh = jr.shard_to_mesh(opt, params, state, mesh).state
  args = jr.ReshardSave(state=on_mesh, optimizer=opt, params=params, mesh=mesh)
  first = _handler.prepare_save(args)
  second = _handler.prepare_save(args)
  assert first.checkpoint_id != second.checkpoint_id
  assert first.index["checkpoint"] == first.checkpoint_id
  assert second.index["checkpoint"] == second.checkpoint_id
  # The clock is the state's, not the check's zeros: count 3, weakly typed.
  (scalar, *_), *_ = first.index["clocks"]
  assert scalar["weak"] is True and scalar["dtype"] == "int32"
  assert np.frombuffer(base64.b64decode(scalar["bytes"]), np.int32)[0] == 3


def _adam_on_mesh():
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  params = random_params({"w": ((20,), np.float32), "b": ((3,), np.float32)}, 8)
  mesh = device_mesh((8,), ("fsdp",))
  return opt, params, mesh, jr.shard_to_mesh(opt, params, random_state(opt, params, 9), mesh).state


def _saved_leaves(tmp_path, args, mesh):
  import orbax.checkpoint as ocp

  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(opt=args))
    manager.wait_until_finished()
  return jax.tree.leaves(jr.restore_sharded(tmp_path / "run" / "1" / "opt", mesh).state)


def test_a_history_leaf_replaced_in_place_after_the_check_is_what_is_saved(tmp_path):
  opt, params, mesh, state = _adam_on_mesh()
  args = jr.ReshardSave(state=state, optimizer=opt, params=params, mesh=mesh)
  mu = state.inner_state[0].mu
  # 20 elements over 8 ranks of 3 slots: the global buffer is the 20 values, then zeros.
  new = np.concatenate([np.full(20, 7.0, np.float32), np.zeros(4, np.float32)])
  mu["w"] = jax.device_put(new, mu["w"].sharding)
  got = _saved_leaves(tmp_path, args, mesh)
  want = jax.tree.leaves(state)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_clock_leaf_taken_out_in_place_after_the_check_is_refused_before_any_directory(tmp_path):
  opt, params, mesh, state = _adam_on_mesh()
  args = jr.ReshardSave(state=state, optimizer=opt, params=params, mesh=mesh)
  del state.hyperparams["learning_rate"]
  with pytest.raises(jr.ReshardError):
    _handler.prepare_save(args)


def test_a_history_leaf_of_another_shape_put_in_place_after_the_check_is_refused(tmp_path):
  opt, params, mesh, state = _adam_on_mesh()
  args = jr.ReshardSave(state=state, optimizer=opt, params=params, mesh=mesh)
  state.inner_state[0].mu["w"] = jax.device_put(
    np.zeros(32, np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  )
  with pytest.raises(jr.ShapeError, match=r"param 'w': global history buffer of shape \(32,\)"):
    _handler.prepare_save(args)


class _ManyClocks(NamedTuple):
  per_layer_lr: Any
  trace: Any


def _past_the_reader_s_bounds(kind):
  """An optimizer and params whose save a reader would refuse: a param id of 4,097
  characters, or 1,100 clock scalars for one param (a reader takes 1,024 + 8 per param)."""
  if kind == "long id":
    return optax.sgd(1e-3, momentum=0.9), {"k" * 4097: jnp.ones((3,))}
  opt = optax.GradientTransformation(
    lambda p: _ManyClocks([jnp.float32(1e-3)] * 1100, jax.tree.map(jnp.zeros_like, p)),
    lambda g, s, p=None: (g, s),
  )
  return opt, {"a": jnp.ones((3,))}


@pytest.mark.parametrize("kind", ["long id", "many clocks"])
@pytest.mark.parametrize("form", ["records", "state"])
def test_a_save_no_reader_would_load_is_refused_when_its_arguments_are_made(tmp_path, kind, form):
  """``ReshardSave`` refuses what the reader would, when made: the refusal came from
  orbax's finalize, after every file was written, and left its temporary directory.
  A param id past the bound is refused earlier still, when the state is sharded."""
  import orbax.checkpoint as ocp

  opt, params = _past_the_reader_s_bounds(kind)
  mesh = device_mesh((4,), ("fsdp",))
  refused = (
    (jr.PlacementError, "4097 characters.*a checkpoint holds")
    if kind == "long id"
    else (jr.ArchiveError, "this save would not load")
  )
  with pytest.raises(refused[0], match=refused[1]):
    if form == "records":
      jr.ReshardSave(jr.shard_state(opt, params, opt.init(params), world_size=4))
    else:
      state = jr.shard_to_mesh(opt, params, opt.init(params), mesh, "fsdp").state
      jr.ReshardSave(state=state, optimizer=opt, params=params, mesh=mesh, axis="fsdp")
  # The same save through a manager: refused before any directory is made.
  with pytest.raises(refused[0], match=refused[1]):
    with ocp.CheckpointManager(tmp_path / "run") as manager:
      manager.save(1, args=jr.ReshardSave(jr.shard_state(opt, params, opt.init(params), 4)))
  assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == []

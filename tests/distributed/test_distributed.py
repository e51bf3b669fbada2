"""Global flat-sharded state on a mesh of 8 simulated devices, in one process.

Every shard is compared bit for bit with the single-process core
(``shard_state`` / ``reshard`` / ``unshard_state``).
"""

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import jaxreshard as jr
from jaxreshard._src.distributed import mesh as _mesh
from tests import _mp_util as U
from tests._core_util import (
  adam_records,
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  device_mesh,
  oracle_shard,
  replace_history,
  standard,
)


@pytest.fixture(scope="module")
def ex():
  return U.example(seed=1)


def _plain_numpy(records) -> dict:
  """Rank -> the record with every history buffer a numpy array of its own."""
  return {
    r: jr.ShardRecord(
      rec.version,
      rec.placements,
      jax.tree.map(lambda x: np.array(x) if np.ndim(x) == 1 else x, rec.state),
      rec.roles,
    )
    for r, rec in enumerate(records)
  }


def _check_against(state, mesh, axis, expected):
  """Every addressable shard of ``state`` equals the core record of its rank."""
  roles = expected[0].roles
  a = mesh.axis_names.index(axis)
  rank_of = {d: int(i[a]) for i, d in np.ndenumerate(mesh.devices)}
  for leaf, role, *per_rank in zip(
    jax.tree.leaves(state), roles, *[jax.tree.leaves(r.state) for r in expected]
  ):
    if role is None:
      assert leaf.sharding.spec == PartitionSpec()
      for shard in leaf.addressable_shards:
        got = bits(shard.data)
        assert np.array_equal(got, bits(per_rank[0])), role
      continue
    assert leaf.sharding.spec == PartitionSpec(axis), role
    assert leaf.shape == (len(expected) * per_rank[0].shape[0],), role
    seen = set()
    for shard in leaf.addressable_shards:
      r = rank_of[shard.device]
      seen.add(shard.device)
      assert shard.data.devices() == {shard.device}
      assert np.array_equal(bits(shard.data), bits(per_rank[r])), (role, r)
      assert shard.data.dtype == per_rank[r].dtype
  return True


@pytest.mark.parametrize(
  "shape,names,axis",
  [
    ((8,), ("fsdp",), "fsdp"),
    ((2, 3), ("data", "fsdp"), "fsdp"),  # 3 ranks, each replicated on 2 devices
    ((5, 1), ("fsdp", "model"), "fsdp"),  # 5: uneven split, trailing padding
  ],
)
def test_shard_to_mesh_equals_shard_state(ex, shape, names, axis):
  opt, params, state, shapes = ex
  mesh = device_mesh(shape, names)
  world = mesh.shape[axis]
  out = jr.shard_to_mesh(opt, params, state, mesh, axis, trainable=U.trainable())
  expected = jr.shard_state(opt, params, state, world, trainable=U.trainable())
  _check_against(out.state, mesh, axis, expected)
  assert out.placements == {r: expected[r].placements for r in range(world)}
  # Back to the records, from the device buffers, and to the full state.
  got = jr.gather_from_mesh(opt, out.state, {p.param: p for p in out.placements[0]}, mesh, axis)
  assert_trees_bit_equal(got, jr.unshard_state(expected))


def test_mesh_round_trip_is_the_original_state(ex):
  opt, params, state, shapes = ex
  mesh = device_mesh((3,), ("fsdp",))
  out = jr.shard_to_mesh(opt, params, state, mesh, trainable=U.trainable())
  assert_trees_bit_equal(jr.gather_from_mesh(opt, out.state, shapes, mesh), state)
  # Against the numpy oracle, independent of the core.
  mu = out.state[1].inner_states["train"].inner_state[0].mu["dense"]["kernel"]
  full = state[1].inner_states["train"].inner_state[0].mu["dense"]["kernel"]
  for shard in mu.addressable_shards:
    r = shard.index[0].start // shard.data.shape[0]
    assert np.array_equal(bits(shard.data), bits(oracle_shard(full, 3, r)))


def test_bf16_padded_output_from_2d_source_is_bit_exact():
  """Signalling NaNs and subnormals of a 2-D bf16 source survive a padded gather.

  XLA:CPU once rewrote the bitcast into bfloat16 through float32 here.
  """
  x = jnp.asarray(
    np.array([0x7FA8, 0x807E, 0x0068, 0x3F80] * 500, np.uint16).view(jnp.bfloat16).reshape(4, 500)
  )
  from jaxreshard._src.exec import device as _device_exec

  flat = _device_exec.pack([x])
  out = _device_exec.gather(
    [flat], np.array([0]), np.array([500]), np.array([0]), np.array([1000]), 1002
  )
  expected = np.zeros(1002, np.uint16)
  expected[:1000] = bits(x).reshape(-1)[500:1500]
  assert np.array_equal(bits(out), expected)


def test_records_from_mesh_equal_core_records(ex):
  from jaxreshard._src.distributed import mesh as _mesh

  opt, params, state, _ = ex
  mesh = device_mesh((2, 4), ("data", "fsdp"))
  out = jr.shard_to_mesh(opt, params, state, mesh, "fsdp", trainable=U.trainable())
  expected = jr.shard_state(opt, params, state, 4, trainable=U.trainable())
  shapes = {p.param: p for p in out.placements[0]}
  records = _mesh.records_from_mesh(opt, out.state, shapes, mesh, "fsdp")
  assert sorted(records) == [0, 1, 2, 3]
  for r, rec in records.items():
    assert_records_equal(rec, expected[r])


@pytest.mark.parametrize("source,target", [(8, 6), (3, 8), (8, 5)])
def test_reshard_to_mesh_equals_core(ex, source, target):
  opt, params, state, _ = ex
  records = jr.shard_state(opt, params, state, source, trainable=U.trainable())
  mesh = device_mesh((target,), ("fsdp",))
  out = jr.reshard_to_mesh(records, mesh)
  expected = [
    jr.reshard(records, jr.plan(records, world_size=target, rank=r)) for r in range(target)
  ]
  _check_against(out.state, mesh, "fsdp", expected)
  assert out.placements == {r: expected[r].placements for r in range(target)}


def test_save_sharded_then_restore_sharded(ex, tmp_path):
  """8 ranks on a (2 x 4) mesh saved, restored onto 6, then onto 5 x 1: all exact."""
  opt, params, state, _ = ex
  mesh8 = device_mesh((2, 4), ("data", "fsdp"))
  src = jr.shard_to_mesh(opt, params, state, mesh8, "fsdp", trainable=U.trainable())
  path = os.path.join(tmp_path, "step_1")
  jr.save_sharded(path, opt, src.state, {p.param: p for p in src.placements[0]}, mesh8, "fsdp")
  records = jr.load_records(path)
  for got, want in zip(records, jr.shard_state(opt, params, state, 4, trainable=U.trainable())):
    assert_records_equal(got, want)
  with pytest.raises(jr.ArchiveExistsError):
    jr.save_sharded(path, opt, src.state, {p.param: p for p in src.placements[0]}, mesh8, "fsdp")

  for shape, names in [((6,), ("fsdp",)), ((1, 5), ("data", "fsdp"))]:
    mesh = device_mesh(shape, names)
    world = mesh.shape["fsdp"]
    out = jr.restore_sharded(path, mesh, "fsdp")
    expected = [
      jr.reshard(records, jr.plan(records, world_size=world, rank=r)) for r in range(world)
    ]
    _check_against(out.state, mesh, "fsdp", expected)
    assert out.placements == {r: expected[r].placements for r in range(world)}
  # Full state back, from the restored 5-way layout.
  got = jr.gather_from_mesh(opt, out.state, {p.param: p for p in out.placements[0]}, mesh, "fsdp")
  assert_trees_bit_equal(got, jr.unshard_state(records))


def test_one_process_s_save_of_a_deleted_state_names_the_deleted_leaf(ex, tmp_path):
  """One process: an error the state's own arrays raise while the save's arguments are
  checked (a buffer deleted) names the leaf, as every call taking a state does; not
  an ArchiveError of a save that "was not started" (as before the processes of a save
  agreed to start it, jax's own error was raised unchanged then)."""
  opt, params, state, _ = ex
  mesh = device_mesh((8,), ("fsdp",))
  src = jr.shard_to_mesh(opt, params, state, mesh, "fsdp", trainable=U.trainable())
  next(x for x in jax.tree_util.tree_leaves(src.state) if x.size > 1).delete()
  path = os.path.join(tmp_path, "ck")
  with pytest.raises(jr.ReshardError, match=r"^state\[.*\] is a deleted jax array") as e:
    jr.save_sharded(path, opt, src.state, {p.param: p for p in src.placements[0]}, mesh)
  assert "not started" not in str(e.value) and type(e.value) is jr.ReshardError
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "shape,names", [((2, 3), ("data", "fsdp")), ((4, 2), ("fsdp", "model")), ((8,), ("fsdp",))]
)
def test_restore_sharded_puts_each_history_leaf_on_all_its_devices_in_one_call(
  ex, tmp_path, monkeypatch, shape, names
):
  """A history leaf read from disk goes onto the mesh in one call for all its devices
  (not a ``device_put`` per device): the same shards, copies along other axes included."""
  opt, params, state, _ = ex
  mesh = device_mesh(shape, names)
  world = mesh.shape["fsdp"]
  records = jr.shard_state(opt, params, state, 5, trainable=U.trainable())
  jr.save_records(tmp_path / "c", records)
  puts = []
  put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a[0]) or put(*a, **k))
  out = jr.restore_sharded(tmp_path / "c", mesh, "fsdp")
  monkeypatch.undo()
  expected = [jr.reshard(records, jr.plan(records, world_size=world, rank=r)) for r in range(world)]
  _check_against(out.state, mesh, "fsdp", expected)
  roles = expected[0].roles
  assert sum(r is not None for r in roles) > sum(r is None for r in roles)
  # Clock scalars only: each read onto a device, copied into the checkpoint's template
  # and into each rank's state (a state built owns its clock), then put on every device.
  assert len(puts) <= sum(r is None for r in roles) * (mesh.size + world + 2)
  assert all(np.ndim(x) == 0 for x in puts)


def test_a_mesh_state_owns_its_bits_whatever_the_records_it_came_from_do_later():
  """``records_to_mesh`` copies each host piece: writing into the records' numpy
  buffers afterwards changes nothing on the mesh."""
  mesh = device_mesh((8,), ("fsdp",))
  records = _plain_numpy(adam_records(8, {"a": ((8 * 64,), np.float32), "b": ((5,), np.float32)}))
  want = {r: [bits(x).copy() for x in jax.tree.leaves(rec.state)] for r, rec in records.items()}
  state = _mesh.records_to_mesh(records, mesh, "fsdp")
  for rec in records.values():
    for x in jax.tree.leaves(rec.state):
      if isinstance(x, np.ndarray) and x.ndim == 1:
        x[...] = 7.0
  roles = records[0].roles
  for leaf, role, *per_rank in zip(jax.tree.leaves(state), roles, *want.values()):
    if role is None:
      continue
    for shard in leaf.addressable_shards:
      r = shard.index[0].start // shard.data.shape[0] if shard.data.shape[0] else 0
      assert np.array_equal(bits(shard.data), per_rank[r]), (role, r)


@pytest.mark.parametrize(
  "rank, words",
  [
    (8, "outside world_size 8"),
    (-1, "outside world_size 8"),
    (1.0, "must be an integer"),
    (True, "must be an integer"),
  ],
)
@pytest.mark.parametrize("shapes", [{"w": ((20,), np.float32)}, {"e": ((0,), np.float32)}])
def test_records_from_mesh_refuses_a_rank_that_is_not_one_of_the_axis(ex, rank, words, shapes):
  mesh = device_mesh((8,), ("fsdp",))
  opt = optax.adam(1e-3)
  params = {k: np.zeros(s, d) for k, (s, d) in shapes.items()}
  out = jr.shard_to_mesh(opt, params, opt.init(params), mesh)
  placements = {p.param: p for p in out.placements[0]}
  with pytest.raises(jr.ReshardError, match=words):
    _mesh.records_from_mesh(opt, out.state, placements, mesh, "fsdp", ranks=[0, rank])


def test_kernels_run_on_each_ranks_device(ex):
  """Each rank's buffers are built on (not copied to) its first device."""
  opt, params, state, _ = ex
  mesh = device_mesh((4,), ("fsdp",), devices=jax.devices()[4:])
  out = jr.shard_to_mesh(opt, params, state, mesh)
  leaf = out.state[1].inner_states["train"].inner_state[0].mu["dense"]["kernel"]
  assert {s.device for s in leaf.addressable_shards} == set(jax.devices()[4:])
  assert jax.devices()[0] not in leaf.sharding.device_set


def test_refusals(ex, tmp_path):
  opt, params, state, shapes = ex
  mesh = device_mesh((4,), ("fsdp",))
  with pytest.raises(jr.PlacementError, match="mesh axis 'dp'"):
    jr.shard_to_mesh(opt, params, state, mesh, "dp")
  out = jr.shard_to_mesh(opt, params, state, mesh)
  wrong = dict(shapes, **{"dense/kernel": (256, 300)})
  with pytest.raises(jr.ShapeError, match="dense/kernel"):
    jr.gather_from_mesh(opt, out.state, wrong, mesh)
  path = os.path.join(tmp_path, "bad")
  # A save records dtypes, which bare shapes do not give: the placements do.
  typed = {p.param: p for p in out.placements[0]}
  typed_wrong = dict(
    typed, **{"dense/kernel": dataclasses.replace(typed["dense/kernel"], shape=(256, 300))}
  )
  with pytest.raises(jr.ShapeError, match="dense/kernel"):
    jr.save_sharded(path, opt, out.state, typed_wrong, mesh)
  assert not os.path.exists(path)
  assert [p for p in os.listdir(tmp_path)] == []  # the temporary directory is gone too
  with pytest.raises(FileNotFoundError):
    jr.restore_sharded(os.path.join(tmp_path, "missing"), mesh)
  # A history buffer replicated instead of sharded over the axis.
  replicated = jax.tree.map(
    lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, PartitionSpec())), out.state
  )
  with pytest.raises(jr.PlacementError, match="sharded over mesh axis 'fsdp'"):
    jr.save_sharded(path, opt, replicated, typed, mesh)
  assert not os.path.exists(path)


def test_second_restore_compiles_nothing(ex, tmp_path):
  opt, params, state, _ = ex
  records = jr.shard_state(opt, params, state, 8, trainable=U.trainable())
  path = os.path.join(tmp_path, "ckpt")
  jr.save_records(path, records)
  mesh = device_mesh((6,), ("fsdp",))
  jr.restore_sharded(path, mesh)
  before = jr.kernel_cache_info().traces
  jr.restore_sharded(path, mesh)
  assert jr.kernel_cache_info().traces == before


# --- clock scalars: restore's rule on every mesh path ----------------------------

# (name, value) of a clock leaf whose dtype jax cannot hold while x64 is off, or a
# Python number. Bits are written out here, never computed by jaxreshard.
_NAN_PAYLOAD = np.frombuffer(bytes.fromhex("0100000000f8ff7f"), np.float64)[0]
CLOCK_LEAVES = {
  "float64_negative_zero": np.float64(-0.0),
  "float64_nan_payload": _NAN_PAYLOAD,
  "int64_past_int32": np.int64(2**40 + 3),
  "python_float": 0.1,
  "python_int": 7,
  "python_int_past_int32": 2**40 + 3,
}


def _leaf_kind(x):
  """What must survive a restore: Python type and value, or dtype and bits."""
  if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
    return (type(x).__name__, x.hex() if isinstance(x, float) else x)
  return (type(x).__module__.split(".")[0], np.asarray(x).dtype.name, np.asarray(x).tobytes())


def _clock_example(leaf):
  import optax

  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  params = {"w": jnp.arange(10.0, dtype=jnp.float32)}
  state = opt.init(params)
  # The count and a hyper-parameter both carry the leaf under test.
  state = state._replace(count=leaf, hyperparams={**state.hyperparams, "learning_rate": leaf})
  return opt, params, state


@pytest.mark.slow
@pytest.mark.parametrize("path", ["restore_sharded", "target", "checkpoint_manager"])
@pytest.mark.parametrize("name", sorted(CLOCK_LEAVES))
def test_clock_scalars_keep_dtype_and_bits_on_every_mesh_path(tmp_path, name, path):
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding

  assert not jax.config.jax_enable_x64  # the suite's default: where jax would cut them
  leaf = CLOCK_LEAVES[name]
  want = _leaf_kind(leaf)
  if not isinstance(leaf, (int, float)) or isinstance(leaf, np.generic):
    want = ("numpy",) + want[1:]  # a numpy scalar comes back as a numpy value
  opt, params, state = _clock_example(leaf)
  mesh = device_mesh((8,), ("fsdp",))
  ckpt = tmp_path / "ckpt"
  jr.save_records(ckpt, jr.shard_state(opt, params, state, world_size=3))
  host = jr.restore(ckpt, world_size=8, rank=0).state
  assert _leaf_kind(host.count) == want  # restore's rule, the reference
  if path == "restore_sharded":
    out = jr.restore_sharded(ckpt, mesh).state
  elif path == "target":
    everywhere = NamedSharding(mesh, PartitionSpec())
    # The target as jax.eval_shape describes the state (64-bit cut to 32 bits).
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype), sharding=everywhere
      ),
      state,
    )
    out = jr.restore_sharded(ckpt, mesh, target=abstract).state
  else:
    run = tmp_path / "run"
    src = jr.shard_to_mesh(opt, params, state, mesh)
    with ocp.CheckpointManager(run) as manager:
      manager.save(
        1,
        args=ocp.args.Composite(
          opt_state=jr.ReshardSave(state=src.state, optimizer=opt, params=params, mesh=mesh)
        ),
      )
    assert _leaf_kind(jr.restore(run / "1" / "opt_state", world_size=8, rank=0).state.count) == want
    with ocp.CheckpointManager(run) as manager:
      out = manager.restore(
        1,
        args=ocp.args.Composite(
          opt_state=jr.ReshardRestore(mesh=device_mesh((5,), ("fsdp",), jax.devices()[:5]))
        ),
      )
    out = out["opt_state"]
  assert _leaf_kind(out.count) == want
  assert _leaf_kind(out.hyperparams["learning_rate"]) == want
  # The other clock scalar, an ordinary float32, is still a replicated jax array.
  assert isinstance(out.hyperparams["momentum"], jax.Array)
  assert int(bits(out.hyperparams["momentum"])) == 0x3F666666


def test_a_typed_prng_key_in_the_clock_goes_onto_the_mesh(tmp_path):
  import optax

  opt = optax.noisy_sgd(0.1)
  params = {"w": jnp.arange(10.0, dtype=jnp.float32)}
  state = opt.init(params)
  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, state, world_size=3))
  out = jr.restore_sharded(tmp_path / "c", device_mesh((8,), ("fsdp",))).state
  key = out[0].rng_key
  assert key.dtype == state[0].rng_key.dtype and key.sharding.spec == PartitionSpec()
  assert np.array_equal(
    np.asarray(jax.random.key_data(key)), np.asarray(jax.random.key_data(state[0].rng_key))
  )


@pytest.mark.parametrize(
  "change",
  [
    lambda b: b[:-1],  # one element short
    lambda b: np.concatenate([b, b[:1] * 0]),  # one element more
    lambda b: b.reshape(1, -1),  # the right size, not flat
  ],
)
def test_records_to_mesh_refuses_ranks_whose_history_buffers_differ_in_shape(change):
  mesh = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  opt = optax.adam(1e-3)
  params = {"w": np.arange(10, dtype=np.float32), "b": np.ones(3, np.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=4)
  records[2] = replace_history(records[2], "w", 1, change)
  with pytest.raises(jr.ShapeError, match=r"param 'w': history buffers of ranks \[0, 1, 2, 3\]"):
    _mesh.records_to_mesh(dict(enumerate(records)), mesh, "fsdp")


class _WindowState(NamedTuple):
  window: jax.Array  # a (4,) clock leaf: no param's history


def _window_optimizer():
  """An optax chain whose first state is a (4,) array that mirrors no param."""
  stats = optax.GradientTransformation(
    lambda p: _WindowState(jnp.zeros(4)),
    lambda u, s, p=None: (u, _WindowState(jnp.roll(s.window, 1))),
  )
  return optax.chain(stats, optax.sgd(0.1, momentum=0.9))


_WINDOW_BITS = np.array([0x7FC12345, 0x80000000, 0x3F800000, 0x00000001], np.uint32)


@pytest.mark.parametrize("path", ["save_sharded", "gather_from_mesh", "checkpoint_manager"])
def test_a_clock_leaf_laid_out_over_the_mesh_axis_is_kept_whole(tmp_path, path):
  # A step's out_shardings may lay every 1-D leaf over the axis: an archive must
  # still hold the whole leaf (a NaN payload, -0.0, 1.0 and a subnormal), not the
  # part on the first device.
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding

  opt = _window_optimizer()
  params = {"w": jnp.arange(5.0)}
  mesh = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  on_mesh = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  window = jax.device_put(_WINDOW_BITS.view(np.float32), NamedSharding(mesh, PartitionSpec("fsdp")))
  assert not window.is_fully_replicated
  state = (_WindowState(window),) + tuple(on_mesh[1:])
  if path == "gather_from_mesh":
    outs = [jr.gather_from_mesh(opt, state, {"w": (5,)}, mesh)[0].window]
  else:
    if path == "save_sharded":
      ckpt = tmp_path / "ckpt"
      jr.save_sharded(ckpt, opt, state, {"w": (5,)}, mesh)
    else:
      with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(
          1,
          args=ocp.args.Composite(
            opt_state=jr.ReshardSave(state=state, optimizer=opt, params=params, mesh=mesh)
          ),
        )
      ckpt = tmp_path / "run" / "1" / "opt_state"
    outs = [r.state[0].window for r in jr.load_records(ckpt)]
    outs.append(jr.restore(ckpt, world_size=3, rank=2).state[0].window)
    outs.append(jr.restore_sharded(ckpt, mesh).state[0].window)
  for out in outs:
    assert np.asarray(out).dtype == np.float32
    assert np.array_equal(np.asarray(out).view(np.uint32), _WINDOW_BITS), out


# Params, and their ids as a user writes them (key paths joined with "/").
_NO_CLOCK_PARAMS = {
  "int_keys": (
    lambda: {"layers": {0: {"w": jnp.arange(5.0)}, 1: {"w": jnp.ones(2)}}},
    {"layers/0/w": (5,), "layers/1/w": (2,)},
  ),
  "a_list": (
    lambda: {"layers": [jnp.arange(5.0), jnp.ones(2)]},
    {"layers/0": (5,), "layers/1": (2,)},
  ),
  "one_param_in_a_list": (lambda: [jnp.arange(5.0)], {"0": (5,)}),
}


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adagrad"])
@pytest.mark.parametrize("kind", sorted(_NO_CLOCK_PARAMS))
def test_a_state_of_only_histories_is_saved_from_the_mesh_whatever_its_keys(
  tmp_path, kind, opt_name
):
  # A state with no clock leaf has exactly as many leaves as there are params:
  # the subtree that mirrors them is found below the root all the same.
  opt = optax.sgd(0.1, momentum=0.9) if opt_name == "sgd_momentum" else optax.adagrad(0.1)
  make, shapes = _NO_CLOCK_PARAMS[kind]
  params = make()
  mesh = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  state = jr.flat_sharded(opt, mesh).init(params)
  want = jr.shard_state(opt, params, opt.init(params), world_size=4)
  jr.save_sharded(tmp_path / "ckpt", opt, state, shapes, mesh)
  for got, expected in zip(jr.load_records(tmp_path / "ckpt"), want, strict=True):
    assert_records_equal(got, expected)
  assert_trees_bit_equal(jr.gather_from_mesh(opt, state, shapes, mesh), opt.init(params))


class _NoPath:
  """An ``os.PathLike`` whose ``__fspath__`` gives an int, not a path."""

  def __fspath__(self):
    return 5


def _mesh_calls(tmp_path):
  """Each mesh path given one argument of the wrong kind, and the words it is refused in."""
  opt, params = optax.adam(0.1), {"w": jnp.arange(5.0)}
  m4 = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  m8 = jax.make_mesh((8,), ("fsdp",))  # the same global length for w as on 4 devices
  state = jr.flat_sharded(opt, m4).init(params)
  ckpt = tmp_path / "c"
  jr.save_records(ckpt, jr.shard_state(opt, params, opt.init(params), world_size=2))
  out = tmp_path / "new"
  not_called = (
    "optimizer must be an optax GradientTransformation (with init and update), got function"
  )
  two = {"w": jnp.arange(5.0), "b": jnp.ones(3)}

  def update_what_it_built(wrapped):
    return wrapped.update(two, wrapped.init(params))

  return {
    "update of grads of another tree than init saw": (
      lambda: update_what_it_built(jr.flat_sharded(opt, m4)),
      "the grads' tree is not the params tree the state was built for (at init): grads have"
      " params ['b'] that those params do not",
    ),
    "update of a state not built for the grads' tree": (
      lambda: jr.flat_sharded(opt, m4).update(two, state),
      "the state was not built for grads with param ids ['b', 'w']: it lacks leaves",
    ),
    "update of a state built for another shape": (
      lambda: jr.flat_sharded(opt, m4).update({"w": jnp.ones(9)}, state),
      "param 'w': history buffer of shape (8,) is not the (4 * slots,) = (12,) of its shape"
      " (9,) over mesh axis 'fsdp'",
    ),
    "update of a state on another mesh": (
      lambda: jr.flat_sharded(opt, m8).update(params, state, params),
      "param 'w': history buffer laid out on a mesh of shape {'fsdp': 4} over devices"
      " [0, 1, 2, 3], not this optimizer's {'fsdp': 8}",
    ),
    "update of no state": (
      lambda: jr.flat_sharded(opt, m4).update(params, None, params),
      "update needs the state that init returned, got None",
    ),
    "restore_sharded of an optimizer not called": (
      lambda: jr.restore_sharded(ckpt, m4, optimizer=optax.adam, params=params),
      not_called,
    ),
    "flat_sharded of an optimizer not called": (
      lambda: jr.flat_sharded(optax.adam, m4),
      not_called + "; the arguments are (optimizer, mesh, axis)",
    ),
    "save_sharded of an optimizer not called": (
      lambda: jr.save_sharded(out, optax.adam, state, {"w": (5,)}, m4),
      not_called,
    ),
    "gather_from_mesh of an optimizer not called": (
      lambda: jr.gather_from_mesh(optax.adam, state, {"w": (5,)}, m4),
      not_called,
    ),
    "save_sharded to no path": (
      lambda: jr.save_sharded(None, opt, state, {"w": (5,)}, m4),
      "directory must be a path (str or os.PathLike), got NoneType",
    ),
    "save_sharded to a PathLike that gives no path": (
      lambda: jr.save_sharded(_NoPath(), opt, state, {"w": (5,)}, m4),
      "directory is not a usable path (expected _NoPath.__fspath__() to return str or bytes,"
      " not int)",
    ),
    "save_sharded with no timeout": (
      lambda: jr.save_sharded(out, opt, state, {"w": (5,)}, m4, timeout_s=None),
      "timeout_s must be a positive number of seconds, got None",
    ),
    "save_sharded with a NaN timeout": (
      lambda: jr.save_sharded(out, opt, state, {"w": (5,)}, m4, timeout_s=float("nan")),
      "timeout_s must be a positive number of seconds, got nan",
    ),
    "save_sharded of shapes as a list": (
      lambda: jr.save_sharded(out, opt, state, [("w", (5,))], m4),
      "shapes must map each param id (a str) to its shape, got list",
    ),
    "ReshardSave of params holding a float": (
      lambda: jr.ReshardSave(state=state, optimizer=opt, params={"w": 1.0}, mesh=m4),
      "params['w'] is a float, not an array",
    ),
    "ReshardSave of a number for records": (
      lambda: jr.ReshardSave(5),
      "ReshardSave: records must be an iterable of ShardRecords",
    ),
    "save_sharded of shapes keyed by int": (
      lambda: jr.save_sharded(out, opt, state, {0: (5,)}, m4),
      "shapes must map each param id (a str) to its shape, got dict with keys that are not all str",
    ),
  }


_MESH_CALLS = [
  "update of grads of another tree than init saw",
  "update of a state not built for the grads' tree",
  "update of a state built for another shape",
  "update of a state on another mesh",
  "update of no state",
  "restore_sharded of an optimizer not called",
  "flat_sharded of an optimizer not called",
  "save_sharded of an optimizer not called",
  "gather_from_mesh of an optimizer not called",
  "save_sharded to no path",
  "save_sharded to a PathLike that gives no path",
  "save_sharded with no timeout",
  "save_sharded with a NaN timeout",
  "save_sharded of shapes as a list",
  "save_sharded of shapes keyed by int",
  "ReshardSave of params holding a float",
  "ReshardSave of a number for records",
]


@pytest.mark.parametrize("case", _MESH_CALLS)
def test_mesh_paths_refuse_arguments_of_the_wrong_kind_by_name(tmp_path, case):
  calls = _mesh_calls(tmp_path)
  assert sorted(calls) == sorted(_MESH_CALLS)
  call, words = calls[case]
  with pytest.raises(jr.ReshardError) as info:
    call()
  assert words in str(info.value), str(info.value)
  assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing written


@pytest.mark.parametrize("timeout_s", [1e14, 1e300])
def test_save_sharded_with_a_timeout_longer_than_orbax_takes_commits(tmp_path, timeout_s):
  """A timeout past what orbax and the runtime can hold (a ``timedelta`` of at most
  999,999,999 days; 32-bit milliseconds) waits the longest they can: the save
  commits. (Before: it failed inside orbax with an ``OverflowError``.)"""
  opt, params = optax.adam(0.1), {"w": jnp.arange(5.0)}
  m4 = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  state = jr.flat_sharded(opt, m4).init(params)
  jr.save_sharded(tmp_path / "c", opt, state, {"w": (5,)}, m4, timeout_s=timeout_s)
  want = jr.shard_state(opt, params, opt.init(params), world_size=4)
  for a, b in zip(jr.load_records(tmp_path / "c"), want, strict=True):
    assert_records_equal(a, b)


class _Layer(NamedTuple):
  w: jax.Array
  b: jax.Array


def test_namedtuple_params_come_back_as_the_users_classes_with_like_or_target(tmp_path):
  # An archive records a NamedTuple's name and fields only: a plain restore gives a
  # plain namedtuple; like= and target= name the user's tree, and get its classes.
  from jax.sharding import NamedSharding

  opt = optax.adam(0.1)
  params = {"layer": _Layer(jnp.arange(5.0), jnp.ones(2))}
  m4 = device_mesh((4,), ("fsdp",), jax.devices()[:4])
  m3 = device_mesh((3,), ("fsdp",), jax.devices()[:3])
  grads = jax.tree.map(lambda x: x * 0.5 - 1.0, params)
  state = jr.flat_sharded(opt, m4).init(params)
  _, state = standard(jr.flat_sharded(opt, m4).update, grads, state, params)
  jr.save_sharded(tmp_path / "c", opt, state, {"layer/w": (5,), "layer/b": (2,)}, m4)
  new = jr.flat_sharded(opt, m3)
  plain = jr.restore_sharded(tmp_path / "c", m3).state
  assert type(plain[0].mu["layer"]) is not _Layer
  with pytest.raises(jr.PlacementError, match="restore it with like=opt.init"):
    standard(new.update, grads, plain, params)
  everywhere = NamedSharding(m3, PartitionSpec())
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere),
    jax.eval_shape(opt.init, params),
  )
  shapes = {"layer/w": (5,), "layer/b": (2,)}
  saved = jr.gather_from_mesh(opt, state, shapes, m4)  # the saved state, logical and whole
  # like=: the flat-sharded state in the user's classes, which the wrapper updates.
  restored = jr.restore_sharded(tmp_path / "c", m3, like=new.init(params)).state
  assert type(restored[0].mu["layer"]) is _Layer and type(restored[0].nu["layer"]) is _Layer
  assert_trees_bit_equal(jr.gather_from_mesh(opt, restored, shapes, m3), saved)
  updates, _ = standard(new.update, grads, restored, params)
  assert type(updates["layer"]) is _Layer
  # target=: the logical state, as the target's tree and shardings say.
  restored = jr.restore_sharded(tmp_path / "c", m3, target=abstract).state
  assert type(restored[0].mu["layer"]) is _Layer and type(restored[0].nu["layer"]) is _Layer
  assert_trees_bit_equal(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, saved))


def test_gather_from_mesh_takes_an_nnx_optimizer_s_state_as_shard_to_mesh_does():
  """An ``nnx.Optimizer``'s ``opt_state`` (``nnx.State`` nodes, Variable leaves) is
  gathered in its plain form, as ``shard_to_mesh`` takes it; it was refused with
  jax's raw pytree error. The gathered state after a step is the unwrapped
  optimizer's after the same step, bit for bit (elementwise from zero histories)."""
  from flax import nnx

  mesh = device_mesh((4,), ("fsdp",))
  tx = optax.adam(1e-2)
  grads = {"bias": jnp.linspace(-1, 2, 5), "kernel": jnp.linspace(3, -4, 15).reshape(3, 5)}
  rep = jax.sharding.NamedSharding(mesh, PartitionSpec())
  grads = jax.device_put(grads, rep)

  def stepped(opt):
    model = nnx.Linear(3, 5, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), rep))
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
    g = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(g, grads)
    optimizer.update(model, g)
    return optimizer

  with jax.numpy_dtype_promotion("standard"):  # optax's and flax's own math needs it
    sharded = stepped(jr.flat_sharded(tx, mesh, "fsdp"))
    whole = stepped(tx)
  got = jr.gather_from_mesh(tx, sharded.opt_state, {"bias": (5,), "kernel": (3, 5)}, mesh)
  assert type(got[0].mu) is dict and int(got[0].count) == 1
  for kind in ("mu", "nu"):
    for pid in ("bias", "kernel"):
      want = np.asarray(getattr(whole.opt_state[0], kind)[pid][...])
      have = np.asarray(getattr(got[0], kind)[pid])
      assert (
        have.shape == want.shape and have.view(np.uint32).tolist() == want.view(np.uint32).tolist()
      ), (kind, pid)


def test_gather_from_mesh_s_clock_outlives_a_step_that_donates_the_state():
  """The gathered state's clock leaves are copies: deleting (donating) the sharded
  state's buffers leaves them readable (they were that state's own buffers)."""
  mesh = device_mesh((4,), ("fsdp",))
  opt = optax.adam(1e-2)
  params = {"w": jnp.arange(6.0)}
  state = opt.init(params)
  state = (state[0]._replace(count=jnp.asarray(7, jnp.int32)),) + state[1:]
  sharded = jr.shard_to_mesh(opt, params, state, mesh).state
  got = jr.gather_from_mesh(opt, sharded, {"w": (6,)}, mesh)
  for leaf in jax.tree.leaves(sharded):
    leaf.delete()
  assert int(got[0].count) == 7 and got[0].count.dtype == jnp.int32
  assert np.asarray(got[0].mu["w"]).tolist() == [0.0] * 6


def test_shard_to_mesh_s_clock_is_not_the_caller_s_buffer():
  """The state ``shard_to_mesh`` makes holds copies of the caller's clock leaves: a
  step donating it (here: deleting its leaves) left the caller's count deleted."""
  mesh = device_mesh((4,), ("fsdp",))
  opt = optax.adam(1e-2)
  params = {"w": jnp.arange(6.0)}
  state = opt.init(params)
  count = jax.device_put(jnp.asarray(3, jnp.int32), jax.devices()[0])
  state = (state[0]._replace(count=count),) + state[1:]
  sharded = jr.shard_to_mesh(opt, params, state, mesh).state
  for leaf in jax.tree.leaves(sharded):
    leaf.delete()
  assert not count.is_deleted() and int(count) == 3

"""The mesh paths against the host paths on the same inputs: the same bits, the same refusals.

Each test feeds one input (a checkpoint, records, a mesh state) through the host
paths (``restore``, ``reshard``, ``unshard_state``) and the mesh paths
(``restore_sharded`` with and without ``target=``, ``reshard_to_mesh``, the orbax
handler, ``save_sharded``) on Explicit (``jax.make_mesh``'s default) and Auto
meshes, and compares bits as unsigned integers and refusals by type and words.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from tests._archive_util import padding_unchecked
from tests._core_util import (
  assert_records_equal,
  assert_trees_bit_equal,
  random_grads,
  random_state,
  standard,
)
from tests.distributed.test_distributed import _check_against


def _auto(shape, names, devices=None):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def _everywhere(tree, mesh, spec=P()):
  """Abstract ``tree`` with ``spec`` on each leaf whose first dimension it divides, else P()."""

  def f(x):
    fits = len(spec) and np.ndim(x) and np.shape(x)[0] % mesh.shape[spec[0]] == 0
    return jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=NamedSharding(mesh, spec if fits else P())
    )

  return jax.tree.map(f, tree)


# --- non-zero padding in a source rank: every read path refuses it alike ------------

_PAD_PARAMS = {
  "big": ((5, 7), jnp.float32),  # 35 over 7: no padding
  "tiny": ((2,), jnp.float32),  # 2 over 7: ranks 2..6 are all padding
  "h": ((9,), jnp.bfloat16),  # 9 over 7: rank 4 owns one element and one pad
}


@pytest.mark.parametrize(
  "pid, archive, index",
  [("tiny", 5, 0), ("h", 4, 1)],
  ids=["all_padding_rank", "partly_owned_rank_bf16"],
)
def test_nonzero_padding_is_refused_alike_by_every_read_path(tmp_path, pid, archive, index):
  """-0.0 planted in a padding slot: ``restore``, ``restore_sharded`` on an Explicit 1-D
  and an Auto 2-D mesh, with and without ``target=``, and the orbax handler all refuse
  it as one ``ArchiveError`` naming the param and the archive; and target rank by
  target rank, ``restore`` refuses exactly where ``reshard`` of the same records in
  memory does (the rank that checks that padding), where it is a ``PlacementError``."""
  opt = optax.adam(1e-3)
  params = {k: jnp.zeros(s, d) for k, (s, d) in _PAD_PARAMS.items()}
  state = random_state(opt, params, seed=5)
  records = jax.tree.map(np.array, jr.shard_state(opt, params, state, world_size=7))
  mu = records[archive].state[0].mu[pid]
  mu.view(np.uint16 if mu.dtype.itemsize == 2 else np.uint32)[index] = (
    0x8000 if mu.dtype.itemsize == 2 else 0x80000000
  )
  path = tmp_path / "ckpt"
  with padding_unchecked():
    jr.save_records(path, records)
  words = (f"param {pid!r}", f"history buffer 0 of archive {archive}", "padding is not zero")

  explicit = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  auto = _auto((2, 4), ("dp", "fsdp"))
  paths = {
    "restore": lambda: [jr.restore(path, world_size=4, rank=r) for r in range(4)],
    "restore_sharded explicit": lambda: jr.restore_sharded(path, explicit),
    "restore_sharded auto 2d": lambda: jr.restore_sharded(path, auto),
    "target replicated": lambda: jr.restore_sharded(
      path, explicit, target=_everywhere(state, explicit)
    ),
    "target rows auto 2d": lambda: jr.restore_sharded(
      path, auto, target=_everywhere(state, auto, P("fsdp"))
    ),
    "handler": lambda: jr.ReshardCheckpointHandler().restore(
      epath.Path(path), jr.ReshardRestore(mesh=explicit)
    ),
  }
  for name, call in paths.items():
    with pytest.raises(jr.ArchiveError) as e:
      call()
    assert all(w in str(e.value) for w in words), (name, str(e.value))

  for m in (2, 3, 8):
    for r in range(m):
      try:
        jr.reshard(records, jr.plan(records, world_size=m, rank=r))
        in_memory = None
      except jr.PlacementError as err:
        in_memory = err
      try:
        jr.restore(path, world_size=m, rank=r)
        on_disk = None
      except jr.ArchiveError as err:
        on_disk = err
      assert (in_memory is None) == (on_disk is None), (m, r, in_memory, on_disk)
      for err in (in_memory, on_disk):
        assert err is None or all(w in str(err) for w in words), (m, r, str(err))


# --- one checkpoint, parameter groups from different source world sizes -------------


def test_param_groups_of_different_source_world_sizes_restore_alike_on_every_path(tmp_path):
  """Archives 0-2 hold one group over 3 ranks, archives 3-7 another over 5 (scalar,
  f16, bf16 params): the flat mesh restores (Explicit 1-D, Auto 2-D), ``reshard_to_mesh``
  and a ``target=`` restore give ``reshard``'s and ``unshard_state``'s bits."""
  opt = optax.adam(1e-3)
  pa = {"a": jnp.zeros((11,), jnp.float32), "c": jnp.zeros((), jnp.bfloat16)}
  pb = {"b": jnp.zeros((3, 3), jnp.float16)}
  records = jr.shard_state(opt, pa, random_state(opt, pa, seed=1), world_size=3)
  records += jr.shard_state(opt, pb, random_state(opt, pb, seed=2), world_size=5)
  path = tmp_path / "ckpt"
  jr.save_records(path, records)
  full = jr.unshard_state(records)
  for mesh in (
    jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4]),
    _auto((2, 4), ("dp", "fsdp")),
  ):
    expected = [jr.reshard(records, jr.plan(records, world_size=4, rank=r)) for r in range(4)]
    for r in range(4):
      assert_records_equal(jr.restore(path, world_size=4, rank=r), expected[r])
    assert _check_against(jr.restore_sharded(path, mesh).state, mesh, "fsdp", expected)
    assert _check_against(jr.reshard_to_mesh(records, mesh).state, mesh, "fsdp", expected)
    target = _everywhere(full, mesh, P("fsdp"))
    assert_trees_bit_equal(jr.restore_sharded(path, mesh, target=target).state, full)


# --- a flat_sharded state through a CheckpointManager, devices in another order -----


def test_flat_sharded_state_on_permuted_devices_through_a_manager_restores_as_the_host(tmp_path):
  """A trained ``flat_sharded`` state on an Explicit (2 x 3) mesh of devices in no
  order, saved with ``ReshardSave(state=...)``: its archives are ``shard_state``'s of
  the state ``gather_from_mesh`` gives; restored onto an Auto mesh of 5 devices in
  reverse order it is ``restore``'s bits, with ``target=`` the gathered state, and
  ``(world_size, rank)`` ``restore``'s record."""
  devices = jax.devices()
  src = jax.make_mesh((2, 3), ("dp", "fsdp"), devices=[devices[i] for i in (6, 1, 4, 3, 0, 2)])
  inner = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.1)
  params = {
    "lin/w": jnp.ones((5, 7), jnp.float32),
    "": jnp.ones((), jnp.float32),
    "one": jnp.ones((1,), jnp.bfloat16),
  }
  wrapped = jr.flat_sharded(inner, src)
  state = standard(wrapped.init, params)
  _, state = standard(jax.jit(wrapped.update), random_grads(params, 0), state, params)
  # ids from the archives' own placements ("lin/w" is the id "lin%2Fw")
  shapes = {
    p.param: p for p in jr.shard_state(inner, params, standard(inner.init, params), 3)[0].placements
  }
  full = jr.gather_from_mesh(inner, state, shapes, src)
  with ocp.CheckpointManager(tmp_path / "run", item_names=("opt",)) as manager:
    manager.save(
      1,
      args=ocp.args.Composite(
        opt=jr.ReshardSave(state=state, optimizer=inner, params=params, mesh=src)
      ),
    )
    manager.wait_until_finished()
  item = tmp_path / "run" / "1" / "opt"
  for got, want in zip(
    jr.load_records(item), jr.shard_state(inner, params, full, world_size=3), strict=True
  ):
    assert_trees_bit_equal(got.state, want.state)

  dst = _auto((5,), ("fsdp",), devices=devices[7:2:-1])
  expected = [jr.restore(item, world_size=5, rank=r) for r in range(5)]
  target = _everywhere(full, dst, P("fsdp"))
  with ocp.CheckpointManager(tmp_path / "run", item_names=("opt",)) as manager:

    def restore(**kwargs):
      return manager.restore(1, args=ocp.args.Composite(opt=jr.ReshardRestore(**kwargs))).opt

    assert _check_against(restore(mesh=dst), dst, "fsdp", expected)
    restored = restore(mesh=dst, target=target)
    assert_trees_bit_equal(restored, full)
    assert [x.sharding for x in jax.tree.leaves(restored)] == [
      t.sharding for t in jax.tree.leaves(target)
    ]
    assert_records_equal(restore(world_size=5, rank=4), expected[4])


# --- a history leaf laid out over more than the flat-shard axis ---------------------


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("spec", [P(("fsdp", "tp")), P(("tp", "fsdp")), P("tp")])
def test_saves_refuse_histories_not_sharded_over_the_axis_alone(tmp_path, spec, axis_types):
  """A history sharded over both mesh axes (or the other one) is not the flat layout:
  ``save_sharded`` and ``ReshardSave(state=...)`` refuse it alike, before anything is
  committed, while ``gather_from_mesh`` reads its values exactly."""
  if axis_types == "explicit":
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
  else:
    mesh = _auto((4, 2), ("fsdp", "tp"))
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.zeros((13,), jnp.float32), "v": jnp.zeros((16,), jnp.float32)}
  state = random_state(opt, params, seed=4)
  laid = jr.shard_to_mesh(opt, params, state, mesh)
  shapes = {p.param: p for p in laid.placements[0]}
  other = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, spec)) if x.ndim else x, laid.state
  )
  words = "must be a global array sharded over mesh axis 'fsdp'"
  with pytest.raises(jr.PlacementError, match=words):
    jr.save_sharded(tmp_path / "a", opt, other, shapes, mesh)
  with pytest.raises(jr.PlacementError, match=words):
    jr.ReshardSave(state=other, optimizer=opt, shapes=shapes, mesh=mesh)
  assert not list(tmp_path.iterdir())
  assert_trees_bit_equal(jr.gather_from_mesh(opt, other, shapes, mesh), state)


# --- the storage dtype a save records: the params' own, never a history's --------------

_DTYPE_CASES = {
  # name: (optimizer, params, what a bare shape is refused for, or None)
  "adam_f32": (optax.adam(1e-3), {"w": jnp.arange(5.0)}, None),
  "adam_bf16_params": (optax.adam(1e-3), {"w": jnp.arange(5.0).astype(jnp.bfloat16)}, None),
  "adam_mu_bf16": (
    optax.adam(1e-3, mu_dtype=jnp.bfloat16),
    {"w": jnp.arange(5.0)},
    "its history buffers have several (bfloat16, float32)",
  ),
  "set_to_zero_bf16": (
    optax.set_to_zero(),
    {"w": jnp.ones(3, jnp.bfloat16)},
    "it has no history buffer to take it from",
  ),
  "masked_f16": (
    optax.masked(optax.sgd(0.1, momentum=0.9), {"w": True, "f": False}),
    {"w": jnp.arange(5.0), "f": jnp.ones(3, jnp.float16)},
    "it has no history buffer to take it from",
  ),
}


@pytest.mark.parametrize("case", sorted(_DTYPE_CASES))
def test_save_sharded_records_the_params_dtype_or_refuses_a_bare_shape(tmp_path, case):
  """A bare shape says nothing of a param's dtype: where the param's history buffers
  do not share one, the save refuses it rather than record a history's dtype (or
  float32) as the param's. With the dtype given, every save path records what
  ``shard_state`` records from the params themselves."""
  opt, params, refused = _DTYPE_CASES[case]
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  state = opt.init(params)
  sharded = jr.shard_to_mesh(opt, params, state, mesh)
  expected = {
    p.param: p.dtype for p in jr.shard_state(opt, params, state, world_size=4)[0].placements
  }
  bare = {k: v.shape for k, v in params.items()}
  if refused is None:
    jr.save_sharded(tmp_path / "bare", opt, sharded.state, bare, mesh)
    assert {p.param: p.dtype for p in jr.load_records(tmp_path / "bare")[0].placements} == expected
  else:
    pid = "w" if case != "masked_f16" else "f"
    for call in (
      lambda: jr.save_sharded(tmp_path / "bare", opt, sharded.state, bare, mesh),
      # A manager's save: its args check every refusal of the save when made.
      lambda: jr.ReshardSave(state=sharded.state, optimizer=opt, shapes=bare, mesh=mesh),
    ):
      with pytest.raises(jr.DtypeError) as info:
        call()
      assert f"param {pid!r}: shapes gives it only a shape" in str(info.value), info.value
      assert refused in str(info.value) and "give its dtype too" in str(info.value)
    assert not (tmp_path / "bare").exists()
  # A gather records nothing: a bare shape is enough, whatever the histories hold.
  assert_trees_bit_equal(jr.gather_from_mesh(opt, sharded.state, bare, mesh), state)
  for name, shapes in (
    ("structs", {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}),
    ("placements", {p.param: p for p in sharded.placements[0]}),
  ):
    jr.save_sharded(tmp_path / name, opt, sharded.state, shapes, mesh)
    assert {p.param: p.dtype for p in jr.load_records(tmp_path / name)[0].placements} == expected


# --- replicas of a history that disagree: every mesh path reads the same one -------


@pytest.mark.parametrize("axis_types", [None, (AxisType.Auto,) * 2], ids=["explicit", "auto"])
def test_replicas_that_disagree_are_read_alike_by_gather_and_save(tmp_path, axis_types):
  # A history sharded over "fsdp" and replicated over "data", whose "data" = 1
  # copies hold other bits (nonzero padding included): not made by any jax
  # computation, but a jax.Array may hold it. gather_from_mesh and save_sharded
  # read the first copy listed for each part, so they give the same bits and
  # neither refuses the other copy's padding.
  kw = {} if axis_types is None else {"axis_types": axis_types}
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), **kw)
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.zeros((5,), jnp.float32)}
  values = np.array([1, -0.0, np.nan, 4, 5, 0, 0, 0], np.float32)
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh, "fsdp").state
  trace = state[0].trace["w"]  # (8,) over "fsdp", replicated over "data"
  data_of = {d: int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}
  pieces = [
    jax.device_put(values[idx] + (100 if data_of[d] else 0), d)
    for d, idx in trace.sharding.addressable_devices_indices_map(trace.shape).items()
  ]
  odd = jax.make_array_from_single_device_arrays(trace.shape, trace.sharding, pieces)
  first = {}
  for shard in odd.addressable_shards:  # the first copy listed for each part
    first.setdefault(shard.index[0].start or 0, np.asarray(shard.data))
  expected = np.concatenate([first[k] for k in sorted(first)])[:5]
  state = (state[0]._replace(trace={"w": odd}),) + tuple(state[1:])
  gathered = jr.gather_from_mesh(opt, state, params, mesh, "fsdp")[0].trace["w"]
  jr.save_sharded(tmp_path / "ck", opt, state, params, mesh, axis="fsdp")
  loaded = jr.unshard_state(jr.load_records(tmp_path / "ck"))[0].trace["w"]
  assert_trees_bit_equal(np.asarray(gathered), expected)
  assert_trees_bit_equal(np.asarray(loaded), expected)


# --- replicas of a clock that disagree: refused on every mesh path --------------------


def _replicas_of(x, differ):
  """``x`` (replicated) rebuilt from per-device copies, ``differ(device index, copy)`` each."""
  devices = list(x.sharding.addressable_devices_indices_map(x.shape))
  pieces = [jax.device_put(differ(i, np.asarray(x)), d) for i, d in enumerate(devices)]
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, pieces)


def _with_clock(state, leaf, differ):
  """``state`` whose clock ``leaf`` ("count" or "learning_rate") is rebuilt by ``differ``."""
  if leaf == "count":
    return state._replace(count=_replicas_of(state.count, differ))
  lr = _replicas_of(state.hyperparams["learning_rate"], differ)
  return state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})


@pytest.mark.parametrize("axis_types", [None, (AxisType.Auto,) * 2], ids=["explicit", "auto"])
@pytest.mark.parametrize(
  "leaf, where, differ",
  [  # a step count one ahead on one device; 0.0 against -0.0 on another
    ("count", "state.count", lambda i, a: a + (i == 3)),
    (
      "learning_rate",
      "state.hyperparams['learning_rate']",
      lambda i, a: (a.view(np.uint32) ^ np.uint32((i == 1) << 31)).view(a.dtype),
    ),
  ],
  ids=["count", "sign_bit"],
)
def test_a_clock_whose_replicas_disagree_is_refused_by_every_mesh_path(
  tmp_path, axis_types, leaf, where, differ
):
  # Every archive holds one copy of the clock: copies that disagree would make the
  # saved step count depend on the device read, so gathers and saves refuse it.
  kw = {} if axis_types is None else {"axis_types": axis_types}
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), **kw)
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.0)
  params = {"w": jnp.zeros((5,), jnp.float32)}
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh, "fsdp").state
  odd = _with_clock(state, leaf, differ)
  calls = {
    "gather_from_mesh": lambda s: jr.gather_from_mesh(opt, s, params, mesh, "fsdp"),
    "save_sharded": lambda s: jr.save_sharded(tmp_path / "s", opt, s, params, mesh, "fsdp"),
    "ReshardSave": lambda s: jr.ReshardSave(
      state=s, optimizer=opt, params=params, mesh=mesh, axis="fsdp"
    ),
  }
  for name, call in calls.items():
    with pytest.raises(jr.PlacementError) as info:
      call(odd)
    message = f"{where}: the copies of this clock on two devices hold different bits"
    assert message in str(info.value), (name, info.value)
  assert not (tmp_path / "s").exists()
  # Copies that agree (each device holding device 0's bits) are gathered and saved.
  same = _with_clock(state, leaf, lambda i, a: differ(0, a))
  for call in calls.values():
    call(same)
  assert (tmp_path / "s").exists()


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.adam(1e-3, mu_dtype=jnp.float64),
    lambda: optax.sgd(0.1, momentum=0.9, accumulator_dtype=jnp.float64),
  ],
  ids=["float64_mu", "float64_only_history"],
)
def test_gather_from_mesh_takes_a_bare_shape_whose_histories_are_float64(make):
  # With x64 on, a float64 history of a float32 param is a history like any other:
  # gather_from_mesh given bare shapes gives what unshard_state gives of the same
  # state sharded on the host (the param's dtype, which a bare shape does not say,
  # is never one a placement could not hold).
  with jax.enable_x64(True):
    opt = make()  # optax fixes a history dtype when the optimizer is made
    params = {"w": jnp.zeros((5,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state = jax.tree.map(
      lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x, opt.init(params)
    )
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    on_mesh = jr.shard_to_mesh(opt, params, state, mesh, "fsdp").state
    assert {x.dtype for x in jax.tree.leaves(on_mesh)} >= {jnp.dtype(jnp.float64)}
    gathered = jr.gather_from_mesh(opt, on_mesh, {"w": (5,), "b": ()}, mesh, "fsdp")
    expected = jr.unshard_state(jr.shard_state(opt, params, state, world_size=4))
    assert_trees_bit_equal(gathered, expected)

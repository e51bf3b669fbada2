"""restore_sharded(target=...): the saved optax state, param-shaped, in any target sharding.

Every restored device piece is compared bit for bit (as unsigned integers) with
the same index of the original optax state the checkpoint was made from.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader as _checkpoint
from jaxreshard._src.distributed import target_restore as _target_restore
from tests import _target_util as T
from tests._core_util import nest, rchar


@pytest.fixture(scope="module", params=[3, 5])
def saved(request, tmp_path_factory):
  """(opt, params, original state, checkpoint path) saved from an uneven world size."""
  opt, params, state = T.example(seed=request.param)
  records = jr.shard_state(opt, params, state, world_size=request.param, trainable=T.trainable())
  path = tmp_path_factory.mktemp(f"w{request.param}") / "ckpt"
  jr.save_records(path, records, chunk_bytes=64)  # small chunks: runs span several
  return opt, params, state, path


def _mesh(kind: str):
  if kind == "explicit":
    return jax.make_mesh((2, 4), ("a", "b"))  # Explicit axes, jax's default
  return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


LAYOUTS = {
  "replicated": P(),
  "rows": P("b"),
  "columns": P(None, "a"),
  "2d": P("a", "b"),
  "rows_over_both": P(("a", "b")),
  "columns_over_both_transposed": P(None, ("b", "a")),
}


@pytest.mark.slow
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_restore_into_target_sharding(saved, layout, axis_types):
  opt, params, state, path = saved
  mesh = _mesh(axis_types)
  target = T.abstract(opt, params, T.spec_or_replicated(mesh, LAYOUTS[layout]))
  out = jr.restore_sharded(path, mesh, target=target)
  assert T.shard_mismatches(out.state, state, target) == []
  hyper = out.state[1].inner_states["train"].inner_state.hyperparams  # scalars placed too
  assert hyper["learning_rate"].sharding == NamedSharding(mesh, P())
  assert out.placements[0][1] == jr.ParamPlacement("dense/kernel", (16, 24), 0, 1, np.float32, True)
  assert [p.trainable for p in out.placements[0]] == [
    p.param not in T.FROZEN for p in out.placements[0]
  ]


def _per_leaf(path, x):
  """A different layout per leaf: meshes of different devices and axis types."""
  devices = jax.devices()
  name = jax.tree_util.keystr(path)
  explicit = jax.make_mesh((2, 4), ("a", "b"))
  auto = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  three = Mesh(np.array(devices[5:8]), ("t",))  # a mesh of only some devices
  if x.shape == ():
    return SingleDeviceSharding(devices[6])
  if "kernel" in name and ".mu" in name:
    return NamedSharding(three, P(None, "t"))  # 24 columns over 3 devices
  if ".mu" in name and T.fits(P("b"), x.shape, explicit):
    return NamedSharding(explicit, P("b"))
  if ".nu" in name and T.fits(P("y", "x"), x.shape, auto):
    return NamedSharding(auto, P("y", "x"))
  return NamedSharding(auto, P())


def test_different_sharding_per_leaf(saved):
  opt, params, state, path = saved
  target = T.abstract(opt, params, _per_leaf)
  out = jr.restore_sharded(path, jax.make_mesh((8,), ("fsdp",)), target=target)
  assert T.shard_mismatches(out.state, state, target) == []
  count = out.state[1].inner_states["train"].inner_state.inner_state[0].count
  assert count.sharding == SingleDeviceSharding(jax.devices()[6])


@pytest.mark.slow
def test_target_from_arrays_and_then_an_update(saved):
  """Arrays work as targets, and the result is an ordinary state for a jitted update."""
  opt, params, state, path = saved
  mesh = _mesh("auto")
  target = T.abstract(opt, params, T.spec_or_replicated(mesh, P("a", "b")))
  first = jr.restore_sharded(path, mesh, target=target).state
  again = jr.restore_sharded(path, mesh, target=first).state
  assert T.shard_mismatches(again, state, target) == []
  params = jax.device_put(params, NamedSharding(mesh, P()))
  grads = jax.tree.map(jnp.ones_like, params)
  with jax.numpy_dtype_promotion("standard"):
    _, new = jax.jit(opt.update)(grads, again, params)
  assert jax.tree.structure(new) == jax.tree.structure(state)


def test_flat_layout_is_unchanged_without_target(saved):
  opt, params, state, path = saved
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  out = jr.restore_sharded(path, mesh)
  adam = out.state[1].inner_states["train"].inner_state.inner_state[0]
  assert adam.mu["dense"]["kernel"].shape == (4 * 96,)
  assert sorted(out.placements) == [0, 1, 2, 3]


# --- refusals: each names the leaf -----------------------------------------------


def _replicated_target(opt, params, mesh=None):
  mesh = mesh or _mesh("explicit")
  return T.abstract(opt, params, lambda path, x: NamedSharding(mesh, P()))


def _replace(target, key: str, fn):
  """``target`` with every leaf whose key path contains ``key`` replaced by ``fn(leaf)``."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: fn(x) if key in jax.tree_util.keystr(path) else x, target
  )


def _with(shape=None, dtype=None):
  """A leaf replacement: the same leaf but for ``shape`` and/or ``dtype``."""
  return lambda x: jax.ShapeDtypeStruct(
    x.shape if shape is None else shape, x.dtype if dtype is None else dtype, sharding=x.sharding
  )


MU_KERNEL = "[1].inner_states['train'].inner_state.inner_state[0].mu['dense']['kernel']"


def test_refuses_a_leaf_of_another_shape(saved):
  opt, params, _, path = saved
  bad = _replace(_replicated_target(opt, params), MU_KERNEL, _with(shape=(24, 16)))
  with pytest.raises(
    jr.ShapeError,
    match=r"leaf .*mu\['dense'\]\['kernel'\] \(param"
    r" 'dense/kernel'\): the target has shape \(24, 16\)",
  ):
    jr.restore_sharded(path, _mesh("explicit"), target=bad)


@pytest.mark.parametrize(
  "key, message",
  [
    (
      "nu['embed']['table']",
      r"nu\['embed'\]\['table'\].*float32 but the checkpoint holds bfloat16",
    ),
    (
      "inner_state[0].count",
      r"inner_state\[0\]\.count \(clock scalar\): the target has dtype"
      r" float32 but the checkpoint holds int32",
    ),
  ],
  ids=["history_buffer", "clock_scalar"],
)
def test_refuses_a_leaf_of_another_dtype(saved, key, message):
  opt, params, _, path = saved
  bad = _replace(_replicated_target(opt, params), key, _with(dtype=jnp.float32))
  with pytest.raises(jr.DtypeError, match=message):
    jr.restore_sharded(path, _mesh("explicit"), target=bad)


def test_a_shape_and_a_dtype_refusal_together_are_a_shape_error(saved):
  opt, params, _, path = saved
  bad = _replace(_replicated_target(opt, params), MU_KERNEL, _with(shape=(24, 16)))
  bad = _replace(bad, "nu['head']['w']", _with(dtype=jnp.bfloat16))
  with pytest.raises(jr.ShapeError) as e:
    jr.restore_sharded(path, _mesh("explicit"), target=bad)
  assert "mu['dense']['kernel'] (param 'dense/kernel'): the target has shape" in str(e.value)
  assert "nu['head']['w'] (param 'head/w'): the target has dtype bfloat16" in str(e.value)


def _params_and_optimizer(pids):
  params = nest({pid: jnp.zeros(*(T.SPECS.get(pid) or ((2,), np.float32))) for pid in pids})
  return T.optimizer(pids), params


def test_refuses_a_missing_param(saved):
  path = saved[3]
  opt, fewer = _params_and_optimizer([p for p in T.SPECS if p != "head/w"])
  with pytest.raises(
    jr.PlacementError,
    match=r"lacks the checkpoint's leaf .*mu\['head'\]\['w'\] \(history"
    r" buffer 0 of param 'head/w'\)",
  ):
    jr.restore_sharded(path, _mesh("explicit"), target=_replicated_target(opt, fewer))


def test_refuses_a_missing_masked_param(saved):
  """A param the optimizer masks has no buffers, but its MaskedNode positions count."""
  path = saved[3]
  opt, fewer = _params_and_optimizer([p for p in T.SPECS if p not in T.FROZEN])
  with pytest.raises(
    jr.PlacementError, match=r"lacks the checkpoint's leaf .*\['frozen'\]\['w'\] \(a masked"
  ):
    jr.restore_sharded(path, _mesh("explicit"), target=_replicated_target(opt, fewer))


def test_refuses_an_extra_param(saved):
  path = saved[3]
  opt, more = _params_and_optimizer([*T.SPECS, "extra"])
  with pytest.raises(
    jr.PlacementError,
    match=r"extra leaf .*mu\['extra'\].* \(not in the"
    r" checkpoint\)",
  ):
    jr.restore_sharded(path, _mesh("explicit"), target=_replicated_target(opt, more))


def test_refuses_another_optimizer(saved):
  _, params, _, path = saved
  with pytest.raises(jr.PlacementError, match=r"target's tree does not match .*leaf"):
    jr.restore_sharded(
      path, _mesh("explicit"), target=_replicated_target(optax.sgd(0.1, momentum=0.9), params)
    )


def _with_sharding(sharding):
  return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def test_refuses_shardings_jax_cannot_use(saved):
  opt, params, _, path = saved
  mesh = _mesh("explicit")
  bad = _replace(
    _replicated_target(opt, params),
    "mu['embed']['table']",
    _with_sharding(NamedSharding(mesh, P(None, ("a", "b")))),
  )  # 12 over 8
  bad = _replace(
    bad, "nu['head']['w']", _with_sharding(NamedSharding(mesh, P(("a", "b"))))
  )  # 4 rows over 8
  with pytest.raises(jr.PlacementError) as e:
    jr.restore_sharded(path, mesh, target=bad)
  # Every bad leaf in one message.
  assert (
    "mu['embed']['table'] (param 'embed/table'): its sharding cannot lay out shape (8, 12)"
  ) in str(e.value)
  assert ("nu['head']['w'] (param 'head/w'): its sharding cannot lay out shape (4, 8)") in str(
    e.value
  )


def test_refuses_a_leaf_without_sharding_and_reports_every_bad_leaf(saved):
  opt, params, _, path = saved
  bad = _replace(
    _replicated_target(opt, params),
    "mu['dense']['bias']",
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
  )
  bad = _replace(bad, "nu['scalar']", lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
  with pytest.raises(jr.PlacementError) as e:
    jr.restore_sharded(path, _mesh("explicit"), target=bad)
  assert "mu['dense']['bias'] (param 'dense/bias'): the target leaf has no sharding" in str(e.value)
  assert "nu['scalar'] (param 'scalar'): the target leaf has no sharding" in str(e.value)


# --- bytes read -------------------------------------------------------------------


def _big(tmp_path, world=5):
  opt, params, state = T.big_example()
  jr.save_records(
    tmp_path / "big",
    jr.shard_state(opt, params, state, world_size=world),
    chunk_bytes=T.BIG_CHUNK_BYTES,
  )
  ckpt = jr.open_checkpoint(tmp_path / "big")
  # Every chunk of every buffer file, with its crc32c: what a whole restore reads.
  whole = 0
  for a in range(len(ckpt)):
    for d, _n in ckpt.layout(a).sizes.items():
      f = ckpt.open_buffer(a, d)
      whole += f.n * f.stride
      f.close()
  return opt, params, state, tmp_path / "big", whole


def _restore_counted(path, target):
  stats = _checkpoint.ReadStats()
  before = rchar()
  out = _target_restore.restore_to_target(path, target, stats=stats)
  return out, stats, rchar() - before


def test_replicas_share_one_read(tmp_path):
  """Eight devices holding the whole state read each chunk once, no more."""
  opt, params, state, path, whole = _big(tmp_path)
  mesh = _mesh("explicit")
  target = T.abstract(opt, params, lambda p, x: NamedSharding(mesh, P()))
  _restore_counted(path, target)  # warm-up: imports, first-call work
  out, stats, read = _restore_counted(path, target)
  assert T.shard_mismatches(out.state, state, target) == []
  assert stats.bytes == whole
  # The system's own count: the chunk data plus metadata and shard indexes.
  assert whole <= read <= whole + 64 * 1024, (whole, read)


# --- two processes: each reads only what its own devices hold ----------------------


@pytest.mark.slow
def test_each_process_reads_only_its_devices_share(tmp_path):
  from tests import _mp_util as U  # pylint: disable=g-import-not-at-top

  opt, params, state = T.big_example()
  path = tmp_path / "big"
  jr.save_records(
    path, jr.shard_state(opt, params, state, world_size=5), chunk_bytes=T.BIG_CHUNK_BYTES
  )
  whole, stride = 0, 0
  ckpt = jr.open_checkpoint(path)
  for a in range(len(ckpt)):
    for d in ckpt.layout(a).sizes:
      f = ckpt.open_buffer(a, d)
      whole, stride = whole + f.n * f.stride, f.stride
      f.close()
  with U.ProcessGroup(
    2, 4, "restore_target", str(tmp_path / "out"), {"path": str(path)}, timeout=240
  ) as g:
    results = g.check()
  # Slack: per history buffer and process, the chunks at the two ends of each
  # source archive's part of the share (source shards do not start on rows).
  slack = 2 * 5 * 2 * stride
  for p, res in enumerate(results):
    for name, k in (("one_of_4", 4), ("half", 8)):  # k: devices in the mesh
      r = res[name]
      assert r["mismatches"] == [], (p, name, r["mismatches"][:3])
      share = whole * r["devices_in_mesh"] / k  # what the process's devices hold
      assert share <= r["bytes_read"] <= share + slack, (p, name, r, whole)
      assert r["bytes_read"] <= r["rchar"] <= r["bytes_read"] + 64 * 1024, (p, name, r)
  one = results[0]["one_of_4"]
  print(
    f"\nbytes read: one device's share (1/4 rows) {one['bytes_read']} of {whole}"
    f" ({one['bytes_read'] / whole:.3f}); rchar {one['rchar']}; half"
    f" {results[0]['half']['bytes_read']} / {results[1]['half']['bytes_read']}"
  )


@pytest.mark.slow
def test_processes_share_the_all_padding_source_ranks_of_a_replicated_param(tmp_path):
  """Two processes restore a param held whole on every device (replicated): each
  copies from the source rank holding its last element, and the source ranks
  after it hold only padding. Each process checks its share of those ranks (the
  first three of five, the last two), so nonzero bits planted in one of them are
  refused by exactly one process, and neither opens every archive."""
  from tests import _mp_util as U  # pylint: disable=g-import-not-at-top
  from tests._archive_util import padding_unchecked  # pylint: disable=g-import-not-at-top

  counts = {"b": 3, "w": 40}  # over 8 source ranks: b's ranks 3..7 are all padding
  opt = optax.adam(1e-3)
  params = {k: np.zeros(n, np.float32) for k, n in counts.items()}
  state = jax.tree.map(np.asarray, opt.init(params))
  paths = []
  for k in range(3, 8):
    records = jr.shard_state(opt, params, state, world_size=8)
    records[k].state[0].nu["b"].view(np.uint32)[0] = 0x80000000  # -0.0
    paths.append(str(tmp_path / f"pad{k}"))
    with padding_unchecked():  # a save refuses it; another writer may not
      jr.save_records(paths[-1], records)
  with U.ProcessGroup(
    2, 4, "padding_share", str(tmp_path / "out"), {"paths": paths, "counts": counts}, timeout=240
  ) as g:
    results = g.check()
  for i, k in enumerate(range(3, 8)):
    who = [p for p, res in enumerate(results) if res["refused"][i] is not None]
    assert who == [0 if k < 6 else 1], (k, [res["refused"][i] for res in results])
    msg = results[who[0]]["refused"][i]
    assert f"of archive {k}" in msg and "padding is not zero" in msg, msg


def test_restore_sharded_refuses_a_like_of_another_tree_before_reading(tmp_path):
  """A ``like=`` whose plain form is not the restored state's tree is refused before
  any history buffer is read: with every buffer's data gone, it is still the
  ``like=`` refusal that comes back, on the flat layout and with ``target=``; a
  ``like=`` of the right tree goes on to the read, which refuses the missing data."""
  opt = optax.adam(1e-3)
  params = {"w": np.arange(10.0, dtype=np.float32), "b": np.ones(3, np.float32)}
  path = tmp_path / "ck"
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
  for chunk in path.glob("archive_*/*/c/*"):
    chunk.unlink()
  mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  everywhere = NamedSharding(mesh, P())
  target = T.abstract(opt, params, lambda path, x: everywhere)
  other = opt.init({"w": np.zeros(10, np.float32)})
  for kwargs in ({}, {"target": target}):
    with pytest.raises(jr.PlacementError, match="not the plain form of the template"):
      jr.restore_sharded(path, mesh, like=other, **kwargs)
    with pytest.raises(jr.ReshardError) as e:
      jr.restore_sharded(path, mesh, like=opt.init(params), **kwargs)
    assert "not the plain form" not in str(e.value), str(e.value)


@pytest.mark.parametrize("with_target", [False, True])
def test_weak_typed_clock_scalars_stay_weak_on_the_mesh(tmp_path, with_target):
  """A clock scalar saved weakly typed (``jnp.asarray(1e-3)``) comes back weak from
  the mesh paths too, as ``restore`` gives it: a bfloat16 gradient times the
  learning rate stays bfloat16 after the restart. Strong scalars stay strong."""
  params = {"w": jnp.ones((10,), jnp.bfloat16)}
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3)
  state = opt.init(params)
  state.hyperparams["learning_rate"] = jnp.asarray(1e-3)  # weak float32
  assert state.hyperparams["learning_rate"].weak_type
  path = tmp_path / "ckpt"
  jr.save_records(path, jr.shard_state(opt, params, state, world_size=4))
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
  if with_target:
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), state
    )
    out = jr.restore_sharded(path, mesh, target=target).state
  else:
    out = jr.restore_sharded(path, mesh, axis="fsdp").state
  lr = out.hyperparams["learning_rate"]
  assert lr.weak_type and lr.dtype == jnp.float32
  assert np.asarray(lr).view(np.uint32) == np.asarray(jnp.float32(1e-3)).view(np.uint32)
  assert (lr * jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16
  assert not out.count.weak_type and out.count.dtype == state.count.dtype  # strong stays strong
  one = jr.restore(path, world_size=2, rank=0).state.hyperparams["learning_rate"]
  assert one.weak_type


@pytest.mark.parametrize("with_target", [False, True])
def test_a_typed_prng_key_clock_restores_onto_the_mesh(tmp_path, with_target):
  """``noisy_sgd`` keeps a typed PRNG key among its scalars: it comes back with its
  key type and key data bits, placed as the target says; a target that names the
  key's data (uint32) or another key type is refused, not converted."""
  params = {"w": jnp.arange(6.0), "b": jnp.arange(2.0)}
  opt = optax.noisy_sgd(1e-3, key=jax.random.key(7))
  state = opt.init(params)
  path = tmp_path / "ckpt"
  jr.save_records(path, jr.shard_state(opt, params, state, world_size=2))
  mesh = jax.make_mesh((3,), ("fsdp",), devices=jax.devices()[:3])
  replicated = NamedSharding(mesh, P())

  def abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

  target = jax.tree.map(abstract, state) if with_target else None
  out = jr.restore_sharded(path, mesh, axis="fsdp", target=target).state
  (key,) = [x for x in jax.tree.leaves(out) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  assert key.dtype == state[0].rng_key.dtype
  want = np.asarray(jax.random.key_data(state[0].rng_key))
  assert np.array_equal(np.asarray(jax.random.key_data(key)), want)
  if with_target:
    assert key.sharding == replicated
    as_data = dict(enumerate(jax.tree.leaves(target)))
    for i, t in as_data.items():
      if jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key):
        as_data[i] = jax.ShapeDtypeStruct(t.shape, jnp.uint32, sharding=replicated)
    bad = jax.tree.unflatten(jax.tree.structure(target), list(as_data.values()))
    with pytest.raises(jr.ReshardError, match="key<fry>"):
      jr.restore_sharded(path, mesh, axis="fsdp", target=bad)


@pytest.mark.parametrize("saved_masks_b", [True, False])
def test_a_changed_mask_is_refused_naming_the_leaf(tmp_path, saved_masks_b):
  """A mask that differs from the saved optimizer's: the refusal names the leaf and
  which side masks it (it said only that node types differ)."""
  params = {"a": jnp.arange(6.0), "b": jnp.arange(4.0)}
  saved = optax.masked(optax.adam(1e-3), {"a": True, "b": not saved_masks_b})
  now = optax.masked(optax.adam(1e-3), {"a": True, "b": saved_masks_b})
  path = tmp_path / "ckpt"
  jr.save_records(path, jr.shard_state(saved, params, saved.init(params), world_size=2))
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
    now.init(params),
  )
  which = (
    "the checkpoint masks it, but the target's tree holds state there"
    if saved_masks_b
    else "the target's tree masks it, but the checkpoint holds state there"
  )
  with pytest.raises(jr.PlacementError, match=rf"leaf \.inner_state\[0\]\.mu\['b'\]: {which}"):
    jr.restore_sharded(path, mesh, target=target)


def test_a_target_with_a_list_where_the_checkpoint_has_a_tuple_is_refused(tmp_path):
  """The same leaf paths (a list and a tuple both index by [i]), other node types."""
  opt, params = optax.adam(0.1), {"w": jnp.arange(5.0)}
  path = tmp_path / "ckpt"
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=2))
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
  target = _replicated_target(opt, params, mesh)
  with pytest.raises(
    jr.PlacementError,
    match="the target's tree has the checkpoint's leaf paths but other node types",
  ):
    jr.restore_sharded(path, mesh, target=list(target))


def test_a_target_restore_of_a_checkpoint_without_parameters_is_refused(tmp_path):
  path = tmp_path / "ckpt"
  jr.save_records(path, [jr.ShardRecord(jr.RECORD_VERSION, (), {"count": np.int32(3)}, (None,))])
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
  target = {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
  with pytest.raises(jr.PlacementError, match="the checkpoint holds no parameters"):
    jr.restore_sharded(path, mesh, target=target)

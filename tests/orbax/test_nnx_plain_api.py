"""Flax NNX trees given to shard_state, shard_to_mesh and restore_sharded(like=), bit by bit.

Expected values come from the NNX containers themselves, matched by key path
(a Variable's path ends in ``.value``, which its plain form drops), and
sharded by the numpy oracle of ``tests._core_util``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxreshard as jr
from tests._core_util import assert_trees_bit_equal, bits, device_mesh, oracle_shard

LAYERS = 12  # '10' and '11' sort before '2' as strings


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax's and flax's own math is written for jax's standard promotion rules.
  with jax.numpy_dtype_promotion("standard"):
    yield


class _Stack(nnx.Module):
  def __init__(self, rngs, layers=LAYERS):
    self.layers = nnx.List([nnx.Linear(2, 2 + i % 3, rngs=rngs) for i in range(layers)])

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))[..., :2]
    return x


def _trained(tx, layers=LAYERS):
  """A model and its optimizer after one step (histories hold something other than zeros)."""
  model = _Stack(nnx.Rngs(0), layers)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
  optimizer.update(model, grads)
  return model, optimizer


def _by_path(tree):
  """``keystr`` of each leaf's key path (without a Variable's ``.value``) -> the leaf."""
  return {
    jax.tree_util.keystr(p).removesuffix(".value"): x
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _ids(model):
  return {
    f"layers/{i}/{name}": np.shape(getattr(layer, name).get_value())
    for i, layer in enumerate(model.layers)
    for name in ("kernel", "bias")
  }


def _assert_plain(state):
  """The plain form: dicts keyed by the layers' integers, arrays for Variables."""
  for mirror in (state[0].mu, state[0].nu):
    assert type(mirror) is dict and type(mirror["layers"]) is dict
    assert sorted(mirror["layers"]) == list(range(LAYERS))
  assert not any(isinstance(x, nnx.Variable) for x in jax.tree.leaves(state))


def test_shard_state_takes_an_nnx_optimizer_state_and_nnx_params():
  tx = optax.adam(1e-2)
  model, optimizer = _trained(tx)
  world = 5
  records = jr.shard_state(
    tx, nnx.state(model, nnx.Param), optimizer.opt_state, world, trainable={"layers/3/bias": False}
  )
  ids = _ids(model)
  want = _by_path(optimizer.opt_state)
  for rank, record in enumerate(records):
    assert {p.param: p.shape for p in record.placements} == ids
    assert [p.param for p in record.placements if not p.trainable] == ["layers/3/bias"]
    got = _by_path(record.state)
    assert sorted(got) == sorted(want)
    for path, leaf in got.items():
      expected = want[path] if np.ndim(want[path]) == 0 else oracle_shard(want[path], world, rank)
      np.testing.assert_array_equal(bits(leaf), bits(expected), err_msg=path)
  # unshard_state gives back the plain tree, every leaf the NNX one's bits.
  full = jr.unshard_state(records)
  _assert_plain(full)
  got = _by_path(full)
  assert sorted(got) == sorted(want)
  for path, leaf in got.items():
    np.testing.assert_array_equal(bits(leaf), bits(want[path]), err_msg=path)


def test_shard_to_mesh_takes_an_nnx_optimizer_state_and_nnx_params():
  tx = optax.adam(1e-2)
  model, optimizer = _trained(tx)
  mesh = device_mesh((3,), ("fsdp",))
  sharded = jr.shard_to_mesh(tx, nnx.state(model, nnx.Param), optimizer.opt_state, mesh)
  _assert_plain(sharded.state)
  assert {p.param for p in sharded.placements[0]} == set(_ids(model))
  want = _by_path(optimizer.opt_state)
  got = _by_path(sharded.state)
  assert sorted(got) == sorted(want)
  for path, leaf in got.items():
    if np.ndim(want[path]) == 0:
      np.testing.assert_array_equal(bits(leaf), bits(want[path]), err_msg=path)
      continue
    assert leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp"), path
    flat = np.concatenate([oracle_shard(want[path], 3, r) for r in range(3)])
    np.testing.assert_array_equal(bits(leaf), bits(flat), err_msg=path)


def _saved(tmp_path, tx):
  """An NNX optimizer's flat-sharded state saved from 4 devices; (model, its state, path)."""
  mesh4 = device_mesh((4,), ("fsdp",))
  model, optimizer = _trained(jr.flat_sharded(tx, mesh4, "fsdp"))
  path = tmp_path / "ckpt"
  jr.save_sharded(path, tx, optimizer.opt_state, _ids(model), mesh4)
  return model, optimizer.opt_state, path


def test_restore_sharded_like_puts_the_flat_state_in_an_nnx_optimizers_tree(tmp_path):
  tx = optax.adam(1e-2)
  _, saved, path = _saved(tmp_path, tx)
  mesh3 = device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  _, on3 = _trained(jr.flat_sharded(tx, mesh3, "fsdp"))
  plain = jr.restore_sharded(path, mesh3)
  out = jr.restore_sharded(path, mesh3, like=on3.opt_state)
  # The template's own tree: nnx.State nodes, integer keys, Variables.
  assert jax.tree_util.tree_structure(out.state) == jax.tree_util.tree_structure(on3.opt_state)
  assert isinstance(out.state[0].mu, nnx.State)
  assert out.placements == plain.placements
  want = _by_path(plain.state)
  got = _by_path(out.state)
  assert sorted(got) == sorted(want) == sorted(_by_path(saved))
  for key, leaf in got.items():
    assert leaf.sharding == want[key].sharding, key
    np.testing.assert_array_equal(bits(leaf), bits(want[key]), err_msg=key)
  nnx.update(on3.opt_state, nnx.state(out.state))
  np.testing.assert_array_equal(
    bits(on3.opt_state[0].nu["layers"][10]["kernel"].get_value()),
    bits(want["[0].nu['layers'][10]['kernel']"]),
  )


def test_restore_sharded_like_with_a_target_gives_the_logical_state_in_nnx_form(tmp_path):
  tx = optax.adam(1e-2)
  _, saved, path = _saved(tmp_path, tx)
  model, logical = _trained(tx)  # unsharded: histories in the params' shapes
  mesh3 = device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  everywhere = jax.sharding.NamedSharding(mesh3, jax.sharding.PartitionSpec())
  abstract = jax.eval_shape(tx.init, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), abstract
  )
  out = jr.restore_sharded(path, mesh3, target=target, like=logical.opt_state)
  assert jax.tree_util.tree_structure(out.state) == jax.tree_util.tree_structure(logical.opt_state)
  flat = _by_path(saved)
  got = _by_path(out.state)
  assert sorted(got) == sorted(flat)
  for key, leaf in got.items():
    count = int(np.prod(np.shape(leaf)))
    np.testing.assert_array_equal(
      bits(leaf).reshape(-1), bits(np.asarray(flat[key])).reshape(-1)[:count], err_msg=key
    )


def test_a_target_in_nnx_form_is_restored_in_its_own_tree(tmp_path):
  """An nnx.Optimizer's abstract opt_state as target=: the same bits as its plain form,
  handed back in the target's own tree (nnx.State nodes, Variables), by the function
  and by the orbax handler alike."""
  tx = optax.adam(1e-2)
  _, _, path = _saved(tmp_path, tx)
  _, logical = _trained(tx)
  mesh3 = device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  everywhere = jax.sharding.NamedSharding(mesh3, jax.sharding.PartitionSpec())
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere),
    nnx.eval_shape(lambda: logical.opt_state),
  )
  assert isinstance(target[0].mu, nnx.State)
  plain_target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere),
    jax.eval_shape(tx.init, nnx.to_pure_dict(nnx.state(_trained(tx)[0], nnx.Param))),
  )
  want = _by_path(jr.restore_sharded(path, mesh3, target=plain_target).state)
  handler = jr.ReshardCheckpointHandler()
  for out in (
    jr.restore_sharded(path, mesh3, target=target).state,
    handler.restore(path, jr.ReshardRestore(mesh=mesh3, target=target)),
  ):
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(logical.opt_state)
    assert isinstance(out[0].nu["layers"][10]["kernel"], nnx.Variable)
    got = _by_path(out)
    assert sorted(got) == sorted(want)
    for key, leaf in got.items():
      assert leaf.sharding == everywhere, key
      np.testing.assert_array_equal(bits(leaf), bits(want[key]), err_msg=key)


def test_restore_sharded_like_refuses_a_template_of_another_tree(tmp_path):
  tx = optax.adam(1e-2)
  _, _, path = _saved(tmp_path, tx)
  mesh3 = device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  _, fewer = _trained(jr.flat_sharded(tx, mesh3, "fsdp"), layers=LAYERS - 1)
  with pytest.raises(jr.PlacementError, match="not the plain form of the template"):
    jr.restore_sharded(path, mesh3, like=fewer.opt_state)
  by_name = tx.init({"layers": {str(i): {"kernel": 0.0, "bias": 0.0} for i in range(LAYERS)}})
  with pytest.raises(jr.PlacementError, match="not the plain form of the template"):
    jr.restore_sharded(path, mesh3, like=by_name)


def test_a_tree_without_nnx_nodes_is_its_own_plain_form_with_flax_loaded():
  from jaxreshard._src.core import plain as _plain

  tree = {"mu": {"w": np.zeros(3)}, "count": 0, "masked": optax.MaskedNode(), "n": None}
  assert _plain.plain(tree) is tree  # the caller's containers, not copies of them
  state = nnx.State({"w": nnx.Param(jnp.ones(2))})
  got = _plain.plain({"opt": state, "count": 1})
  assert type(got["opt"]) is dict and got["count"] == 1
  assert np.array_equal(got["opt"]["w"], np.ones(2))


def test_restore_sharded_checks_the_optimizer_against_nnx_params_in_plain_form(tmp_path):
  # The save takes nnx.state(model, nnx.Param) in its plain form (ids such as
  # layers/10/kernel): the restore's check of optimizer= and params= takes it the same.
  import orbax.checkpoint as ocp

  tx = optax.adam(1e-2)
  model, _, path = _saved(tmp_path, tx)
  mesh3 = device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  plain = jr.restore_sharded(path, mesh3)
  for params in (nnx.state(model, nnx.Param), nnx.to_pure_dict(nnx.state(model, nnx.Param))):
    for opt in (tx, jr.flat_sharded(tx, mesh3, "fsdp")):
      got = jr.restore_sharded(path, mesh3, optimizer=opt, params=params)
      assert_trees_bit_equal(got.state, plain.state)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    saver = jr.ReshardSave(records=jr.load_records(path))
    manager.save(1, args=ocp.args.Composite(opt_state=saver))
    manager.wait_until_finished()
    params = nnx.state(model, nnx.Param)
    restore = jr.ReshardRestore(mesh=mesh3, optimizer=tx, params=params)
    out = manager.restore(1, args=ocp.args.Composite(opt_state=restore))["opt_state"]
  assert_trees_bit_equal(out, plain.state)
  # A model of other shapes is still refused, by the ids the save stored.
  other = _Stack(nnx.Rngs(0), LAYERS - 1)
  with pytest.raises(jr.PlacementError, match="param 'layers/11/kernel' is in the checkpoint"):
    jr.restore_sharded(path, mesh3, optimizer=tx, params=nnx.state(other, nnx.Param))

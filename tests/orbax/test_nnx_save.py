"""Flax NNX, lists, tuples, integer and tuple keys on the orbax save path, checked bit by bit.

Expected values are the saved buffers themselves, read back through numpy:
a restored flat history holds the saved one's first ``count`` elements (the
parameter, row-major) and zeros after them, whatever the two world sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxreshard as jr
from tests._core_util import bits, device_mesh

LAYERS = 12  # '10' and '11' sort before '2' as strings


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax's and flax's own math is written for jax's standard promotion rules.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _random_like(tree, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(np.shape(x)).astype(np.float32)), tree
  )


def _list_params():
  # A list of 12 layers, a tuple, and a dict with integer keys.
  layers = [{"w": np.zeros((i + 1,), np.float32)} for i in range(LAYERS)]
  heads = {10: np.zeros((5,), np.float32), 2: np.zeros((2, 2), np.float32)}
  return {"layers": layers, "pair": (np.zeros((7,), np.float32), np.zeros((), np.float32))}, heads


def _logical(flat, shape):
  count = int(np.prod(shape))
  out = bits(flat)
  assert not out[count:].any(), "padding slots must be zero"
  return out[:count]


def _assert_same_histories(saved, restored, shapes):
  """Every history of ``restored`` holds ``saved``'s elements, by key path."""
  got = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
  seen = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]:
    if np.ndim(leaf) == 0:
      np.testing.assert_array_equal(bits(got[path]), bits(leaf))
      continue
    where = jax.tree_util.keystr(path).removesuffix(".value")
    shape = next(s for key, s in shapes.items() if where.endswith(key))
    np.testing.assert_array_equal(_logical(got[path], shape), _logical(leaf, shape))
    seen += 1
  assert seen >= 2 * len(shapes) - 2


def _keys(path):
  return [getattr(k, "key", getattr(k, "idx", None)) for k in path]


def _tuple_keyed_params():
  # flax.traverse_util.flatten_dict's form: one dict keyed by key-path tuples.
  out = {("layer", i, "w"): np.zeros((i + 1,), np.float32) for i in range(LAYERS)}
  return {**out, ("head",): np.zeros((2, 3), np.float32)}


@pytest.mark.parametrize("which", ["lists", "int_keys", "tuple_keys"])
def test_save_sharded_takes_lists_tuples_and_integer_keys(tmp_path, which):
  trunk, heads = _list_params()
  params = {"lists": trunk, "int_keys": heads, "tuple_keys": _tuple_keyed_params()}[which]
  opt = optax.adam(1e-3)
  adam, rest = opt.init(params)[0], opt.init(params)[1:]
  full = (adam._replace(mu=_random_like(adam.mu, 1), nu=_random_like(adam.nu, 2)),) + rest
  mesh4, mesh3 = device_mesh((4,), ("fsdp",)), device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  state = jr.shard_to_mesh(opt, params, full, mesh4).state
  ids = {
    "/".join(str(k) for k in _keys(p)): np.shape(x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  jr.save_sharded(tmp_path / "ckpt", opt, state, ids, mesh4)
  restored, _ = jr.restore_sharded(tmp_path / "ckpt", mesh3)
  # The saved tree comes back: lists as lists, tuples as tuples, int keys as ints.
  assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
  shapes = {
    "".join(f"[{k!r}]" for k in _keys(p)): np.shape(x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  _assert_same_histories(state, restored, shapes)
  # Layer 10's history is layer 10's: its shape says which layer it is.
  if which == "lists":
    assert restored[0].mu["layers"][10]["w"].shape == (3 * 4,)
    _assert_logical_equal(restored[0].mu["layers"][10]["w"], full[0].mu["layers"][10]["w"])
  elif which == "int_keys":
    _assert_logical_equal(restored[0].nu[10], full[0].nu[10])
    _assert_logical_equal(restored[0].nu[2], full[0].nu[2])
  else:
    assert restored[0].mu[("layer", 10, "w")].shape == (3 * 4,)
    _assert_logical_equal(restored[0].nu[("layer", 10, "w")], full[0].nu[("layer", 10, "w")])
    _assert_logical_equal(restored[0].mu[("head",)], full[0].mu[("head",)])


def _assert_logical_equal(flat, logical):
  logical = np.asarray(logical)
  np.testing.assert_array_equal(_logical(flat, logical.shape), bits(logical).reshape(-1))


class _Stack(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(2, 2 + i % 3, rngs=rngs) for i in range(LAYERS)])

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))[..., :2]
    return x


def _nnx_optimizer(mesh):
  model = _Stack(nnx.Rngs(0))
  tx = optax.adam(1e-2)
  optimizer = nnx.Optimizer(model, jr.flat_sharded(tx, mesh, "fsdp"), wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
  optimizer.update(model, grads)  # histories hold something other than zeros
  return model, tx, optimizer


def test_reshard_save_takes_an_nnx_optimizer_state_and_nnx_params(tmp_path):
  mesh4, mesh3 = device_mesh((4,), ("fsdp",)), device_mesh((3,), ("fsdp",), jax.devices()[4:7])
  model, tx, optimizer = _nnx_optimizer(mesh4)
  args = jr.ReshardSave(
    state=optimizer.opt_state,
    optimizer=tx,
    params=nnx.state(model, nnx.Param),
    mesh=mesh4,
    axis="fsdp",
  )
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(opt_state=args))
    manager.wait_until_finished()
  _, _, on3 = _nnx_optimizer(mesh3)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    out = manager.restore(
      1,
      args=ocp.args.Composite(
        opt_state=jr.ReshardRestore(mesh=mesh3, axis="fsdp", like=on3.opt_state)
      ),
    ).opt_state
  # The template's own tree: nnx.State nodes and Variables, integer keys.
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(on3.opt_state)
  assert isinstance(out[0].mu, nnx.State)
  shapes = {
    f"['layers'][{i}][{name!r}]": np.shape(getattr(layer, name).get_value())
    for i, layer in enumerate(model.layers)
    for name in ("kernel", "bias")
  }
  _assert_same_histories(optimizer.opt_state, out, shapes)
  for i in (2, 10, 11):
    kernel = out[0].mu["layers"][i]["kernel"].get_value()
    assert kernel.shape == (3 * -(-2 * (2 + i % 3) // 3),)
  nnx.update(on3.opt_state, nnx.state(out))
  np.testing.assert_array_equal(
    bits(on3.opt_state[0].nu["layers"][10]["kernel"].get_value()),
    bits(out[0].nu["layers"][10]["kernel"].get_value()),
  )


def test_a_state_that_does_not_mirror_the_params_is_refused():
  mesh = device_mesh((4,), ("fsdp",))
  opt = optax.adam(1e-3)
  params = {"layers": [np.zeros((3,), np.float32) for _ in range(3)]}
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  other = {"layers": [np.zeros((3,), np.float32) for _ in range(4)]}
  with pytest.raises(jr.PlacementError, match="does not mirror params with ids"):
    jr.ReshardSave(state=state, optimizer=opt, params=other, mesh=mesh, axis="fsdp")


def test_restore_like_refuses_a_template_of_another_tree(tmp_path):
  mesh = device_mesh((2,), ("fsdp",))
  opt = optax.adam(1e-3)
  params = {"layers": [np.zeros((3,), np.float32) for _ in range(3)]}
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  jr.save_sharded(tmp_path / "ckpt", opt, state, {f"layers/{i}": (3,) for i in range(3)}, mesh)
  template = opt.init({"layers": {str(i): np.zeros((3,), np.float32) for i in range(3)}})
  handler = jr.ReshardCheckpointHandler()
  with pytest.raises(jr.PlacementError, match="not the plain form of the template"):
    handler.restore(tmp_path / "ckpt", jr.ReshardRestore(mesh=mesh, like=template))

"""restore_sharded(optimizer=, params=): the flat layout, checked against the optimizer it feeds.

A restore that passes is compared bit for bit (as unsigned integers), device
piece by device piece, with the same restore unchecked. Each refusal names the
param or state leaf and what differs. The example is an uneven source world
(5) restored onto 4 devices: a chain with ``clip_by_global_norm``, an injected
AdamW on trainable params and ``set_to_zero`` on a frozen one (so masked
positions exist), params of float32, bfloat16 and float16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests import _target_util as T
from tests._core_util import bits, nest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(opt, params, checkpoint path) saved from world size 5."""
  opt, params, state = T.example(seed=5)
  records = jr.shard_state(opt, params, state, world_size=5, trainable=T.trainable())
  path = tmp_path_factory.mktemp("w5") / "ckpt"
  jr.save_records(path, records, chunk_bytes=64)
  return opt, params, path


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])


def _restore(path, mesh, **kw):
  # The example's inject_hyperparams init mixes int32 counts and Python floats,
  # which the suite's strict promotion refuses; jaxreshard itself runs under strict.
  with jax.numpy_dtype_promotion("standard"):
    return jr.restore_sharded(path, mesh, "fsdp", **kw)


def _assert_same_pieces(got, want):
  """Same tree, and every leaf the same sharding and the same bits on every device."""
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
  w_leaves, w_def = jax.tree_util.tree_flatten(want)
  assert g_def == w_def
  for (path, g), w in zip(g_leaves, w_leaves, strict=True):
    name = jax.tree_util.keystr(path)
    if not isinstance(g, jax.Array):  # a clock value kept on the host
      assert type(g) is type(w) and bits(g).tobytes() == bits(w).tobytes(), name
      continue
    assert g.sharding == w.sharding and g.dtype == w.dtype and g.shape == w.shape, name
    w_shards = {s.device: s for s in w.addressable_shards}
    for s in g.addressable_shards:
      assert s.index == w_shards[s.device].index, name
      assert bits(s.data).tobytes() == bits(w_shards[s.device].data).tobytes(), name


def test_a_matching_restore_is_bit_identical_to_the_unchecked_one(saved, mesh):
  opt, params, path = saved
  plain = _restore(path, mesh)
  checked = _restore(path, mesh, optimizer=opt, params=params)
  _assert_same_pieces(checked.state, plain.state)
  assert checked.placements == plain.placements
  # The flat_sharded wrapper stands for its optimizer; abstract params do as well.
  abstract = jax.eval_shape(lambda: params)
  wrapped = _restore(path, mesh, optimizer=jr.flat_sharded(opt, mesh), params=abstract)
  _assert_same_pieces(wrapped.state, plain.state)


def _params(pids, change=None):
  """Zero params with ids ``pids`` (the example's shapes and dtypes), ``change`` applied."""
  specs = {pid: T.SPECS.get(pid, ((2,), np.float32)) for pid in pids}
  specs.update(change or {})
  return nest({pid: jnp.zeros(*spec) for pid, spec in specs.items()})


RENAMED = [p.replace("dense/", "dense2/") for p in T.SPECS]

REFUSALS = {
  "another_optimizer": (
    lambda params: (optax.sgd(0.1, momentum=0.9), params),
    jr.PlacementError,
    r"optimizer\.init\(params\)'s tree does not match the checkpoint's state: it lacks the checkpoint's leaf"
    r" \[1\]\.inner_states\['train'\]\.inner_state\.count \(a clock scalar\), .*; extra leaf"
    r" \[0\]\.trace\['dense'\]\['bias'\], .* \(not in the checkpoint\)$",
  ),
  "renamed_layer": (
    lambda params: (T.optimizer(RENAMED), _params(RENAMED)),
    jr.PlacementError,
    r"param 'dense2/bias' is in the params but not in the checkpoint; param 'dense2/kernel'"
    r" is in the params but not in the checkpoint; param 'dense/bias' is in the checkpoint but"
    r" not in the params; param 'dense/kernel' is in the checkpoint but not in the params$",
  ),
  "missing_param": (
    lambda params: (
      T.optimizer([p for p in T.SPECS if p != "head/w"]),
      _params([p for p in T.SPECS if p != "head/w"]),
    ),
    jr.PlacementError,
    r"the checkpoint does not hold these params: param 'head/w' is in the checkpoint but not"
    r" in the params$",
  ),
  "extra_param": (
    lambda params: (T.optimizer([*T.SPECS, "extra/w"]), _params([*T.SPECS, "extra/w"])),
    jr.PlacementError,
    r"the checkpoint does not hold these params: param 'extra/w' is in the params but not"
    r" in the checkpoint$",
  ),
  "param_shape": (
    lambda params: (T.optimizer(), _params(T.SPECS, {"dense/kernel": ((24, 16), np.float32)})),
    jr.PlacementError,
    r"param 'dense/kernel': the params have shape \(24, 16\) but the checkpoint holds \(16, 24\)$",
  ),
  "param_dtype": (
    lambda params: (T.optimizer(), _params(T.SPECS, {"head/w": ((4, 8), jnp.bfloat16)})),
    jr.DtypeError,
    r"the checkpoint does not hold the state optimizer\.init\(params\) builds: leaf"
    r" \[1\]\.inner_states\['train'\]\.inner_state\.inner_state\[0\]\.mu\['head'\]\['w'\]"
    r" \(param 'head/w'\): optimizer\.init\(params\) has dtype bfloat16 but the checkpoint"
    r" holds float16; .*leaf .*nu\['head'\]\['w'\] \(param 'head/w'\)",
  ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_restore_for_another_optimizer_or_params_is_refused_naming_the_leaf(saved, mesh, case):
  _, params, path = saved
  make, kind, message = REFUSALS[case]
  opt, new_params = make(params)
  with pytest.raises(kind, match=message):
    _restore(path, mesh, optimizer=opt, params=new_params)


def test_optimizer_and_params_go_together_and_not_with_target(saved, mesh):
  opt, params, path = saved
  with pytest.raises(jr.PlacementError, match="optimizer= and params= go together"):
    _restore(path, mesh, optimizer=opt)
  with pytest.raises(jr.PlacementError, match="optimizer= and params= go together"):
    _restore(path, mesh, params=params)
  target = T.abstract(opt, params, lambda p, x: jax.sharding.NamedSharding(mesh, jax.P()))
  with pytest.raises(jr.PlacementError, match="without target="):
    _restore(path, mesh, target=target, optimizer=opt, params=params)


def test_a_state_its_first_update_retyped_is_one_the_optimizer_builds(tmp_path, mesh):
  # inject_hyperparams' float32 hyper-parameters make a bf16 param's moments
  # float32 at the first update, in optax itself: a saved state of a run is that.
  opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
  params = {"e": jnp.ones((4, 6), jnp.bfloat16), "g": jnp.ones((3,), jnp.float32)}
  with jax.numpy_dtype_promotion("standard"):
    state = opt.update(params, opt.init(params), params)[1]
  assert state.inner_state[0].mu["e"].dtype == jnp.float32
  records = jr.shard_state(opt, params, state, world_size=3)
  jr.save_records(tmp_path / "ckpt", records)
  plain = _restore(tmp_path / "ckpt", mesh)
  checked = _restore(tmp_path / "ckpt", mesh, optimizer=opt, params=params)
  _assert_same_pieces(checked.state, plain.state)
  # A dtype neither init nor that update gives is still refused, naming the leaf.
  f16 = {"e": jnp.ones((4, 6), jnp.float16), "g": jnp.ones((3,), jnp.float16)}
  with jax.numpy_dtype_promotion("standard"):
    state16 = opt.init(f16)  # float16 moments: float32 params build float32 ones
  jr.save_records(tmp_path / "f16", jr.shard_state(opt, f16, state16, world_size=3))
  with pytest.raises(jr.DtypeError, match=r"leaf .*\.mu\['g'\] \(param 'g'\): optimizer\.init"):
    _restore(tmp_path / "f16", mesh, optimizer=opt, params=params)


def test_a_frozen_param_of_another_storage_dtype_is_refused(saved, mesh):
  # The frozen param has no history: only its placement says which dtype was saved.
  _, params, path = saved
  new_params = _params(T.SPECS, {"frozen/w": (T.SPECS["frozen/w"][0], jnp.bfloat16)})
  message = (
    r"^the checkpoint does not hold these params: param 'frozen/w': the params have dtype"
    r" bfloat16 but the checkpoint holds float32$"
  )
  with pytest.raises(jr.DtypeError, match=message):
    _restore(path, mesh, optimizer=T.optimizer(), params=new_params)
  with pytest.raises(jr.DtypeError, match=message):
    _restore(path, mesh, optimizer=jr.flat_sharded(T.optimizer(), mesh), params=new_params)
  # Python numbers as params take jax's dtype for them: float32, the saved one.
  scalar = _params(T.SPECS)
  scalar["scalar"] = 0.0
  checked = _restore(path, mesh, optimizer=T.optimizer(), params=scalar)
  _assert_same_pieces(checked.state, _restore(path, mesh).state)


@pytest.mark.parametrize(
  "saved_dtype, new_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]
)
def test_a_param_whose_history_an_update_retypes_is_refused_in_another_dtype(
  tmp_path, mesh, saved_dtype, new_dtype
):
  # inject_hyperparams' float32 learning rate makes sgd's trace float32 at the first
  # update whatever the param's dtype: the saved trace fits both, the placement one.
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2, momentum=0.9)
  params = {"w": jnp.ones((5, 3), saved_dtype), "g": jnp.ones((3,), jnp.float32)}
  with jax.numpy_dtype_promotion("standard"):
    state = opt.update(params, opt.init(params), params)[1]
  assert state.inner_state[0].trace["w"].dtype == jnp.float32
  jr.save_records(tmp_path / "ckpt", jr.shard_state(opt, params, state, world_size=3))
  checked = _restore(tmp_path / "ckpt", mesh, optimizer=opt, params=params)
  _assert_same_pieces(checked.state, _restore(tmp_path / "ckpt", mesh).state)
  other = dict(params, w=params["w"].astype(new_dtype))
  with pytest.raises(
    jr.DtypeError,
    match=rf"param 'w': the params have dtype {jnp.dtype(new_dtype).name} but the checkpoint"
    rf" holds {jnp.dtype(saved_dtype).name}$",
  ):
    _restore(tmp_path / "ckpt", mesh, optimizer=opt, params=other)

"""Where flat_sharded's updates lie, and a training step that applies them.

By default every update is laid out like its grad. With ``shard_updates=True``,
under explicit mesh axes the update of a param of more than M elements whose
leading dimension M divides comes out with its rows sharded over the axis (its
flat shards are those rows); every other update is laid out like its grad. A
step that returns its params replicated (``out_shardings`` or
``jax.sharding.reshard``) trains exactly as the unwrapped optimizer; so do
``nnx.Optimizer`` and flax's ``TrainState`` once their new params are
constrained the same way.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from tests._core_util import assert_trees_bit_equal

SHAPES = {
  "rows": (16, 24),
  "vec": (40,),
  "cols": (5, 16),  # the axis divides only the trailing dimension
  "odd": (5, 3),  # padded
  "eight": (8,),
  "scalar": (),
}
# Per mesh: the params whose updates come out row-sharded under explicit axes.
# (8,) is updated whole on 8 devices (at most M elements), in flat shards on 4.
ROWS = {"explicit8": {"rows", "vec"}, "explicit2x4": {"rows", "vec", "eight"}}


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax's and flax's own math is written for jax's standard promotion rules.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _mesh(kind):
  if kind == "explicit8":
    return jax.make_mesh((8,), ("fsdp",))
  if kind == "explicit2x4":
    return jax.make_mesh((2, 4), ("data", "fsdp"))
  if kind == "auto8":
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  raise ValueError(kind)


def _params_and_grads(mesh):
  rep = NamedSharding(mesh, P())
  rng = np.random.default_rng(0)

  def draw():
    return {
      k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32), rep)
      for k, s in SHAPES.items()
    }

  return draw(), [draw() for _ in range(2)]


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("mesh_kind", ["explicit8", "explicit2x4"])
def test_updates_are_row_sharded_where_the_axis_divides_the_leading_dimension(mesh_kind, jit):
  mesh = _mesh(mesh_kind)
  params, grads = _params_and_grads(mesh)
  opt = jr.flat_sharded(optax.adamw(1e-2), mesh, shard_updates=True)
  update = jax.jit(opt.update) if jit else opt.update
  updates, _ = update(grads[0], opt.init(params), params)
  rows = NamedSharding(mesh, P("fsdp"))
  for k, u in updates.items():
    want = rows if k in ROWS[mesh_kind] else grads[0][k].sharding
    assert u.sharding.is_equivalent_to(want, u.ndim), (k, u.sharding)


def test_by_default_every_update_is_laid_out_like_its_grad():
  """The default: the same bits as ``shard_updates=True``, every update laid out like its grad."""
  mesh = _mesh("explicit8")
  params, grads = _params_and_grads(mesh)
  like = jr.flat_sharded(optax.adamw(1e-2), mesh)
  sharded = jr.flat_sharded(optax.adamw(1e-2), mesh, shard_updates=True)
  got, _ = like.update(grads[0], like.init(params), params)
  want, _ = sharded.update(grads[0], sharded.init(params), params)
  assert_trees_bit_equal(got, want)
  for k, u in got.items():
    assert u.sharding.is_equivalent_to(grads[0][k].sharding, u.ndim), (k, u.sharding)


def _replicated_step(opt, rep):
  def step(p, g, s):
    u, s = opt.update(g, s, p)
    return jax.sharding.reshard(optax.apply_updates(p, u), rep), s

  return step


# Run op by op, a step takes seconds: the other meshes run with the slow tests.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
  "mesh_kind",
  ["explicit8", pytest.param("explicit2x4", marks=SLOW), pytest.param("auto8", marks=SLOW)],
)
def test_a_step_returning_replicated_params_trains_as_the_unwrapped_optimizer(mesh_kind):
  """The user's step: ``apply_updates``, then the params constrained to replicated.

  Run op by op (``jax.sharding.reshard``), the params are the unwrapped optimizer's
  bits. Jitted (``out_shardings``) they are replicated and agree to the rounding
  by which jitted optax differs from itself (XLA contracts multiply-adds by fusion).
  """
  mesh = _mesh(mesh_kind)
  rep = NamedSharding(mesh, P())
  params, grads = _params_and_grads(mesh)
  inner = optax.adamw(1e-2, weight_decay=0.1)
  opt = jr.flat_sharded(inner, mesh, shard_updates=True)
  step, ref_step = _replicated_step(opt, rep), _replicated_step(inner, rep)
  out = (jax.tree.map(lambda _: rep, params), jax.tree.map(lambda x: x.sharding, opt.init(params)))
  jitted = jax.jit(step, out_shardings=out)
  ref_jitted = jax.jit(ref_step, out_shardings=(out[0], None))
  p, s, ref_p, ref_s = params, opt.init(params), params, inner.init(params)
  jp, js, ref_jp, ref_js = params, s, params, ref_s
  for g in grads:
    with jax.disable_jit():
      p, s = step(p, g, s)
      ref_p, ref_s = ref_step(ref_p, g, ref_s)
    with jax.set_mesh(mesh) if mesh_kind != "auto8" else contextlib.nullcontext():
      jp, js = jitted(jp, g, js)
      ref_jp, ref_js = ref_jitted(ref_jp, g, ref_js)
    assert_trees_bit_equal(p, ref_p)
    for k in SHAPES:
      assert p[k].sharding.is_equivalent_to(rep, p[k].ndim), (k, p[k].sharding)
      assert jp[k].sharding.is_equivalent_to(rep, jp[k].ndim), (k, jp[k].sharding)
      np.testing.assert_allclose(np.asarray(jp[k]), np.asarray(ref_jp[k]), rtol=1e-6, atol=1e-7)


class _Stack(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


@pytest.mark.parametrize("shard_updates", [True, False])
def test_nnx_optimizer_on_explicit_axes(shard_updates):
  """``nnx.Optimizer.update`` adds the updates itself: its new params lie where they do.

  With row-sharded updates (``shard_updates=True``) the params it writes back are
  row-sharded too, as with optax's own state sharded on the axis, and the next
  forward pass of a (4, 4) kernel is refused under explicit axes: the step
  reshards them back. By default they stay replicated. Either way the losses and
  params follow the unwrapped optimizer's.
  """
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  rep = NamedSharding(mesh, P())
  x = jax.device_put(jnp.linspace(-1, 1, 32).reshape(8, 4), rep)
  tx = optax.adamw(1e-2)

  def build(opt):
    model = _Stack(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), rep))
    return model, nnx.Optimizer(model, opt, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    kernel = model.layers[0].kernel[...]  # as nnx.Optimizer left it
    if shard_updates:
      params = nnx.state(model, nnx.Param)
      nnx.update(model, jax.tree.map(lambda p: jax.sharding.reshard(p, rep), params))
    return loss, kernel

  model, optimizer = build(jr.flat_sharded(tx, mesh, "fsdp", shard_updates=shard_updates))
  ref_model, ref_optimizer = build(tx)
  for _ in range(3):
    loss, kernel = train_step(model, optimizer, x)
    ref_loss, _ = train_step(ref_model, ref_optimizer, x)
    want = NamedSharding(mesh, P("fsdp") if shard_updates else P())
    assert kernel.sharding.is_equivalent_to(want, 2), kernel.sharding
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(ref_model, nnx.Param))
  ):
    assert a.sharding.is_equivalent_to(rep, a.ndim), a.sharding
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jnp.tanh(nn.Dense(16)(x)))


def test_linen_train_state_on_explicit_axes():
  """``TrainState.apply_gradients`` in a jitted step whose ``out_shardings`` keep params replicated."""
  mesh = _mesh("explicit8")
  rep = NamedSharding(mesh, P())
  model = _MLP()
  x = jax.device_put(jnp.linspace(-1, 1, 32).reshape(4, 8), rep)
  params = jax.device_put(model.init(jax.random.key(0), x)["params"], rep)
  tx = optax.adamw(1e-2)

  def step(state, x):
    def loss_fn(p):
      return jnp.mean(state.apply_fn({"params": p}, x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  states = [
    train_state.TrainState.create(apply_fn=model.apply, params=params, tx=opt)
    for opt in (jr.flat_sharded(tx, mesh, shard_updates=True), tx)
  ]

  def on_mesh(a):  # the step counter is a Python int, unwrapped optax's count on one device
    sharding = getattr(a, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else rep

  steps = [jax.jit(step, out_shardings=(jax.tree.map(on_mesh, s), rep)) for s in states]
  with jax.set_mesh(mesh):
    for _ in range(3):
      (state, loss), (ref_state, ref_loss) = (f(s, x) for f, s in zip(steps, states))
      states = [state, ref_state]
      np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    assert a.sharding.is_equivalent_to(rep, a.ndim), a.sharding
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_apply_if_finite_updates_outside_jit_on_any_axes(axis_types):
  """``optax.apply_if_finite`` keeps or zeroes the updates in a ``lax.cond``; outside
  ``jit`` on explicit axes its branches differ in layout type op by op, and the
  update runs on Auto axes instead: the same bits as the jitted update, a
  non-finite grad zeroed and counted."""
  kinds = (AxisType.Explicit,) if axis_types == "explicit" else (AxisType.Auto,)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=kinds)
  tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
  opt = jr.flat_sharded(tx, mesh, "fsdp")
  params = jax.device_put({"w": jnp.arange(37.0), "s": jnp.float32(2.0)}, NamedSharding(mesh, P()))
  context = jax.set_mesh(mesh) if axis_types == "explicit" else contextlib.nullcontext()
  with context:
    bad = {"w": params["w"].at[3].set(jnp.nan), "s": params["s"]}
    state = opt.init(params)
    eager, eager_state = opt.update(params, state, params)
    jitted, jitted_state = jax.jit(opt.update)(params, state, params)
    assert_trees_bit_equal(eager, jitted)
    assert_trees_bit_equal(eager_state, jitted_state)
    assert float(eager["w"][1]) != 0.0
    zeroed, after = opt.update(bad, eager_state, params)
  assert not np.asarray(zeroed["w"]).any() and not np.asarray(zeroed["s"]).any()
  assert int(after.notfinite_count) == 1 and int(after.total_notfinite) == 1

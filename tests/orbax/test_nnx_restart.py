"""An NNX model trained with ``nnx.Optimizer(model, flat_sharded(...))`` resumes on other meshes.

A run of a 12-layer ``nnx.List`` model (layer 10 sorts before layer 2 as a
string) saved with an orbax ``CheckpointManager`` and jaxreshard's handler,
stopped after step 3 and resumed on another number of devices, must see
exactly the losses and end with exactly the params of the run that never
stopped: AdamW is elementwise, so each slot's update does not depend on where
it lives, and the params are replicated, so the forward pass is the same
program on every mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxreshard as jr
from tests._core_util import bits

pytestmark = pytest.mark.slow
STEPS, STOP = 5, 3


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
  with jax.numpy_dtype_promotion("standard"):
    yield


class _Stack(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(12)])

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


def _batch(step):
  return np.random.default_rng(step).standard_normal((8, 4)).astype(np.float32)


def _run(n, ckpt, stop_after=None):
  mesh = jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])
  replicated = NamedSharding(mesh, PartitionSpec())
  model = _Stack(nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), replicated))
  tx = optax.adamw(1e-2)
  optimizer = nnx.Optimizer(model, jr.flat_sharded(tx, mesh, "fsdp"), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = {}
  with ocp.CheckpointManager(ckpt) as manager:
    start = manager.latest_step() or 0
    if start:
      like = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), like
      )
      out = manager.restore(
        start,
        args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract),
          opt_state=jr.ReshardRestore(mesh=mesh, axis="fsdp", like=optimizer.opt_state),
          step=ocp.args.JsonRestore(),
        ),
      )
      params = nnx.state(model, nnx.Param)
      nnx.replace_by_pure_dict(params, out.params)
      nnx.update(model, params)
      nnx.update(optimizer.opt_state, nnx.state(out.opt_state))
      optimizer.step[...] = out.step["step"]
    for step in range(start, STEPS):
      x = jax.device_put(_batch(step), replicated)
      losses[step] = int(bits(train_step(model, optimizer, x)))
      params = nnx.state(model, nnx.Param)
      manager.save(
        step + 1,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
          opt_state=jr.ReshardSave(
            state=optimizer.opt_state, optimizer=tx, params=params, mesh=mesh, axis="fsdp"
          ),
          step=ocp.args.JsonSave({"step": int(optimizer.step[...])}),
        ),
      )
      if step + 1 == stop_after:
        manager.wait_until_finished()
        return losses, None, None
    manager.wait_until_finished()
  final = {
    jax.tree_util.keystr(p): bits(x).tobytes()
    for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  }
  return losses, final, int(optimizer.step[...])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  return _run(4, str(tmp_path_factory.mktemp("ref") / "run"))


@pytest.mark.parametrize("resume_on", [6, 5])
def test_an_nnx_run_resumed_on_another_mesh_continues_bit_for_bit(
  uninterrupted, tmp_path, resume_on
):
  ref_losses, ref_params, ref_step = uninterrupted
  first, _, _ = _run(4, str(tmp_path / "run"), stop_after=STOP)
  assert sorted(first) == [0, 1, 2]
  second, params, step = _run(resume_on, str(tmp_path / "run"))
  assert sorted(second) == [3, 4]
  assert {**first, **second} == ref_losses
  assert len(params) == 24 and params == ref_params
  assert step == ref_step == STEPS


class _Two(nnx.Module):
  def __init__(self, n, kernel):
    self.b = nnx.Param(jnp.arange(n, dtype=jnp.float32))
    self.k = nnx.Param(jnp.ones(kernel, jnp.float32))


def test_a_changed_model_is_refused_when_like_comes_with_the_optimizer_and_params(tmp_path):
  """A model whose params changed but pad to the same flat sizes over 6 ranks (a (13,)
  bias grown to (14,), a (3, 4) kernel transposed): ``like=`` alone cannot tell (it
  checks flat sizes), which is why the README passes ``optimizer=`` and ``params=``
  with it; with them the restore refuses the checkpoint by name."""
  mesh = jax.make_mesh((6,), ("fsdp",), devices=jax.devices()[:6])
  tx = optax.adam(1e-2)
  saved = _Two(13, (3, 4))
  opt = nnx.Optimizer(saved, jr.flat_sharded(tx, mesh), wrt=nnx.Param)
  path = str(tmp_path / "ck")
  jr.save_sharded(path, tx, opt.opt_state, {"b": (13,), "k": (3, 4)}, mesh)
  changed = _Two(14, (4, 3))
  new_opt = nnx.Optimizer(changed, jr.flat_sharded(tx, mesh), wrt=nnx.Param)
  jr.restore_sharded(path, mesh, like=new_opt.opt_state)  # flat sizes agree: taken
  with pytest.raises(jr.PlacementError, match=r"param 'b'.*\(14,\).*\(13,\)"):
    jr.restore_sharded(
      path, mesh, like=new_opt.opt_state, optimizer=tx, params=nnx.state(changed, nnx.Param)
    )
  with pytest.raises(jr.PlacementError, match=r"param 'b'.*\(14,\).*\(13,\)"):
    with ocp.CheckpointManager(tmp_path / "run") as manager:
      manager.save(
        1,
        args=jr.ReshardSave(
          state=opt.opt_state, optimizer=tx, params=nnx.state(saved, nnx.Param), mesh=mesh
        ),
      )
      manager.wait_until_finished()
      manager.restore(
        1,
        args=jr.ReshardRestore(
          mesh=mesh, like=new_opt.opt_state, optimizer=tx, params=nnx.state(changed, nnx.Param)
        ),
      )

"""Edges of ``flat_sharded``: an optimizer that keeps no state at all, the
transformations that read a param's shape or average over its elements, and a mesh
that is not one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxreshard as jr


def _bits(tree):
  return [np.asarray(x).view(np.uint32).tolist() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize(
  "make",
  [lambda: optax.sgd(0.1), lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))],
)
def test_a_stateless_optimizer_updates_under_jit_as_optax_does(explicit, make):
  """Nothing of its state lies on the mesh, so nothing tells a jitted step which
  devices it runs on: with params not placed on an explicit mesh, the flat-shard
  layout made ``jax.jit(opt.update)`` fail. Its update is the optimizer's own."""
  axis_types = (AxisType.Explicit if explicit else AxisType.Auto,)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=axis_types)
  params = {"w": jnp.linspace(-1.0, 1.0, 15).reshape(3, 5), "b": jnp.asarray(0.5)}
  grads = jax.tree.map(lambda x: 3.0 * x + 0.25, params)
  opt = jr.flat_sharded(make(), mesh, axis="fsdp")
  state = opt.init(params)
  updates, _ = jax.jit(opt.update)(grads, state, params)
  want, _ = jax.jit(make().update)(grads, make().init(params), params)
  assert _bits(updates) == _bits(want)


@pytest.mark.parametrize(
  "tx",
  [
    optax.clip_by_block_rms(1.0),
    optax.scale_by_param_block_rms(),
    optax.scale_by_param_block_norm(),
    optax.centralize(),
    optax.adaptive_grad_clip(1.0),
    optax.chain(optax.centralize(), optax.adam(1e-3)),
    optax.MultiSteps(optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(0.1, momentum=0.9)), 2),
    optax.contrib.muon(1e-2),  # orthogonalizes each matrix: a flat shard is none
    # Its Hessian estimate calls the loss on the params: a loss of the model's
    # params fails inside the model on flat shards, with an error of jax's.
    optax.contrib.sophia(1e-2),
  ],
)
def test_transformations_that_read_a_param_s_shape_are_refused(tx):
  """On flat zero-padded shards a block RMS counts the padding (a 180-element param
  over 8 ranks updated sqrt(184 / 180) off) and ``centralize`` sees one row: refused
  by name, wherever they sit in the optimizer, at init and at an update of a state
  made elsewhere (a restored one needs no init)."""
  mesh = jax.make_mesh((8,), ("fsdp",))
  opt = jr.flat_sharded(tx, mesh, axis="fsdp")
  params = {"w": jnp.ones((12, 15))}
  with pytest.raises(jr.ShapeError, match=r"optax\.[\w.]+ reads each param's shape"):
    opt.init(params)
  state = jr.flat_sharded(optax.sgd(0.1, momentum=0.9), mesh, axis="fsdp").init(params)
  with pytest.raises(jr.ShapeError, match=r"optax\.[\w.]+ reads each param's shape"):
    opt.update(params, state, params)


@pytest.mark.parametrize("mesh", [None, "fsdp", jax.devices()])
def test_a_mesh_that_is_not_one_is_refused_plainly(mesh):
  """Not an AttributeError from inside: a refusal that says what a mesh is."""
  with pytest.raises(jr.PlacementError, match="mesh must be a jax.sharding.Mesh"):
    jr.flat_sharded(optax.adam(1e-3), mesh, axis="fsdp")

"""repr(open_checkpoint(path)): one short line naming what the checkpoint holds."""

import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
from tests._core_util import random_params, random_state


def _save(path, opt, specs, world_size):
  params = random_params(specs)
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=world_size)
  jr.save_records(path, records)
  return records


def test_repr_names_path_archives_world_size_params_and_step(tmp_path):
  specs = {"dense/kernel": ((5, 3), np.float32), "dense/bias": ((3,), jnp.bfloat16)}
  _save(tmp_path / "ckpt", optax.adam(1e-3), specs, 3)  # random_state sets the count to 1234
  with jr.open_checkpoint(tmp_path / "ckpt") as ckpt:
    assert repr(ckpt) == (
      f"Checkpoint('{tmp_path / 'ckpt'}', archives=3, world_sizes=[3],"
      " params=['dense/bias', 'dense/kernel'], step=1234)"
    )


def test_many_params_are_counted_and_a_clock_without_a_step_is_left_out(tmp_path):
  specs = {f"layer{i}/w": ((4,), np.float32) for i in range(5)}
  _save(tmp_path / "ckpt", optax.sgd(0.1, momentum=0.9), specs, 2)  # a trace, no count
  text = repr(jr.open_checkpoint(tmp_path / "ckpt"))
  assert text == (
    f"Checkpoint('{tmp_path / 'ckpt'}', archives=2, world_sizes=[2],"
    " params=['layer0/w', 'layer1/w', 'layer2/w', ... 2 more])"
  )


def test_archives_of_several_world_sizes(tmp_path):
  """Parameter groups saved from different world sizes (e.g. experts) are all listed."""
  opt = optax.adam(1e-3)
  a = jr.shard_state(opt, {"a": jnp.ones(6)}, opt.init({"a": jnp.ones(6)}), world_size=2)
  b = jr.shard_state(opt, {"b": jnp.ones(5)}, opt.init({"b": jnp.ones(5)}), world_size=3)
  jr.save_records(tmp_path / "ckpt", [*a, *b])
  text = repr(jr.open_checkpoint(tmp_path / "ckpt"))
  assert text == (
    f"Checkpoint('{tmp_path / 'ckpt'}', archives=5, world_sizes=[2, 3], params=['a', 'b'], step=0)"
  )

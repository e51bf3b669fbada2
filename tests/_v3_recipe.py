"""The records of ``tests/data/v3_checkpoint``, a checkpoint of format version 3 written
by the jaxreshard that wrote that version: masked and unmasked Adam moments, float32
and bfloat16 params, params in dicts and a list, special float bits, 3 ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import jaxreshard as jr


def _bits(shape, dtype, salt: int) -> np.ndarray:
  """Deterministic bit patterns, -0.0 and a NaN payload among them."""
  n = int(np.prod(shape))
  width = np.dtype(dtype).itemsize
  uint = {2: np.uint16, 4: np.uint32}[width]
  raw = (np.arange(n, dtype=np.uint64) * 2654435761 + salt * 97 + 1) % (1 << (8 * width - 2))
  a = raw.astype(uint)
  a[0] = 1 << (8 * width - 1)  # -0.0
  if n > 2:
    a[2] = {2: 0x7FC1, 4: 0x7FC00001}[width]  # a NaN with a payload
  return a.view(dtype).reshape(shape)


def records() -> list:
  params = {
    "dense": {"kernel": jnp.zeros((3, 5), jnp.float32), "bias": jnp.zeros((5,), jnp.float32)},
    "layers": [{"w": jnp.zeros((7,), jnp.bfloat16)}, {"w": jnp.zeros((2, 2), jnp.bfloat16)}],
    "frozen": jnp.zeros((4,), jnp.float32),
  }
  mask = jax.tree.map(lambda _: True, params)
  mask["frozen"] = False
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.adam(1e-3), mask))
  state = opt.init(params)
  salt = iter(range(1000))

  def fill(x):
    if isinstance(x, optax.MaskedNode) or np.ndim(x) == 0:
      return x
    return jnp.asarray(
      _bits(np.shape(x), ml_dtypes.bfloat16 if x.dtype == jnp.bfloat16 else np.float32, next(salt))
    )

  state = jax.tree.map(fill, state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return jr.shard_state(opt, params, state, world_size=3, trainable={"frozen": False})

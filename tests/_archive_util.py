"""Helpers of the archive tests: example checkpoints, file hashes, bytes read."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
from tests._core_util import nest, random_bits_array, rchar, special_values  # noqa: F401

# Small, odd sizes: nothing divides evenly, one parameter is a scalar, one is
# empty, one is bf16 and one f16 (storage dtypes), so padding and every dtype occur.
SHAPES = {
    "dense/kernel": ((5, 7), jnp.float32),
    "dense/bias": ((7,), jnp.float32),
    "emb": ((13, 3), jnp.bfloat16),
    "half": ((9,), jnp.float16),
    "scale": ((), jnp.float32),
    "empty": ((0,), jnp.float32),
}


def params(shapes=None, seed: int = 0) -> Any:
  rng = np.random.default_rng(seed)
  return nest({pid: jnp.asarray(rng.standard_normal(s).astype(np.float32), d)
               for pid, (s, d) in (shapes or SHAPES).items()})


def random_state(opt: Any, prm: Any, seed: int = 1) -> Any:
  """``opt.init(prm)`` with every non-scalar leaf replaced by random bits
  (NaN payloads, -0.0, subnormals) and the special values up front."""
  rng = np.random.default_rng(seed)

  def fill(x):
    if np.ndim(x) == 0 or np.size(x) == 0:
      return x
    a = random_bits_array(rng, np.shape(x), np.dtype(x.dtype)).reshape(-1)
    sv = special_values(x.dtype) if np.dtype(x.dtype).name != "float64" else a[:0]
    a[: min(a.size, sv.size)] = sv[: a.size]
    return jnp.asarray(a.reshape(np.shape(x)))

  # optax's schedules mix int32 counts with Python floats, which the strict
  # promotion of the test settings refuses; init is not what is under test.
  with jax.numpy_dtype_promotion("standard"):
    state = jax.tree.map(fill, opt.init(prm))
  # A clock that is not the initial one: the count is part of what must survive.
  return jax.tree.map(
      lambda x: jnp.asarray(1234, x.dtype) if np.ndim(x) == 0 and x.dtype == jnp.int32 else x,
      state)


def adam_records(world: int, shapes=None, seed: int = 0):
  opt = optax.adam(1e-3)
  prm = params(shapes, seed)
  return jr.shard_state(opt, prm, random_state(opt, prm, seed + 1), world)


def file_hashes(directory: str) -> dict[str, str]:
  """Every file (relative path -> sha256) and directory under ``directory``."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), directory) + "/"] = "dir"
    for f in files:
      path = os.path.join(root, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def dir_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)


def buffer_file(directory: str, archive: int = 0) -> str:
  """The shard file of the first history buffer of one archive."""
  adir = os.path.join(directory, f"archive_{archive:05d}")
  name = sorted(n for n in os.listdir(adir) if n.startswith("b"))[0]
  return os.path.join(adir, name, "c", "0")


def shard_file(directory: str, archive: int = 0, dtype: str = "float32") -> str:
  """The shard file (``c/0``) of one archive's packed buffer of ``dtype``."""
  return os.path.join(directory, f"archive_{archive:05d}", dtype, "c", "0")

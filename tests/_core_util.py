"""Shared helpers of the core tests: a plain-numpy oracle and bit comparisons.

The oracle is deliberately independent of jaxreshard: it flattens a full
buffer, pads it with zeros to ``W * slots`` and slices rank ``r``'s part, which
is the FSDP flat-shard definition in four lines of numpy.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "fsdp_flat_shards.npz")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x: Any) -> np.ndarray:
  """The raw bit patterns of an array (shape kept), as unsigned integers."""
  a = np.asarray(x)
  return a.view(_UINT[a.dtype.itemsize])


def oracle_slots(count: int, world_size: int) -> int:
  return -(-count // world_size)


def oracle_shard(full: Any, world_size: int, rank: int) -> np.ndarray:
  """Rank ``rank``'s zero-padded flat shard of ``full`` (numpy only)."""
  a = np.asarray(full)
  flat = a.reshape(-1)
  slots = oracle_slots(flat.size, world_size)
  padded = np.zeros(world_size * slots, dtype=a.dtype)
  padded[: flat.size] = flat
  return padded[rank * slots:(rank + 1) * slots]


def assert_bits_equal(actual: Any, expected: Any, what: str = "") -> None:
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  ba, be = bits(a), bits(e)
  if not np.array_equal(ba, be):
    bad = np.flatnonzero(ba.reshape(-1) != be.reshape(-1))
    raise AssertionError(f"{what}: {bad.size} elements differ, first at flat index {bad[0]}")


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def assert_trees_bit_equal(actual: Any, expected: Any) -> None:
  """Same tree structure (MaskedNode positions included) and bit-equal leaves."""
  la, ta = jax.tree_util.tree_flatten_with_path(actual)
  le, te = jax.tree_util.tree_flatten_with_path(expected)
  assert ta == te, f"tree structures differ:\n{ta}\n{te}"
  for (path, a), (_, e) in zip(la, le):
    assert_bits_equal(a, e, jax.tree_util.keystr(path))


def assert_records_equal(a: Any, b: Any) -> None:
  """Two ShardRecords are identical: version, placements, roles, structure, bits."""
  assert a.version == b.version
  assert a.placements == b.placements
  assert a.roles == b.roles
  assert_trees_bit_equal(a.state, b.state)


def snapshot(obj: Any) -> tuple[Any, list[tuple[str, bytes]]]:
  """Structure + every leaf's dtype/shape/bytes, to prove an input unchanged.

  Records are pytrees whose static fields (placements, version, roles) live in
  the treedef, so comparing treedefs compares them too.
  """
  leaves, treedef = jax.tree_util.tree_flatten(obj)
  return treedef, [(np.asarray(x).dtype.str, np.shape(x), np.asarray(x).tobytes()) for x in leaves]


def random_bits_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  """An array of ``dtype`` whose bits are uniformly random (NaN payloads, ±0,
  inf and subnormals all occur for 16-bit types at moderate sizes)."""
  dt = np.dtype(dtype)
  n = math.prod(shape)
  raw = rng.integers(0, 2 ** (8 * dt.itemsize), size=n, dtype=np.uint64)
  return raw.astype(_UINT[dt.itemsize]).view(dt).reshape(shape)


SPECIAL_F32 = np.array(
    [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4e38],
    dtype=np.float32,
)


def special_values(dtype) -> np.ndarray:
  """NaN (several payloads, both signs), ±inf, ±0, subnormals, in ``dtype``'s bits."""
  dt = np.dtype(dtype)
  if dt == np.float32:
    nan_payloads = np.array([0x7FC00001, 0xFFC00123, 0x7F800001, 0x7FBFFFFF], np.uint32)
    return np.concatenate([SPECIAL_F32, nan_payloads.view(np.float32)])
  u = np.array(
      [0x7E01, 0xFE55, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x8001, 0x007F]
      if dt == ml_dtypes.bfloat16 else
      [0x7E01, 0xFE55, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x8001, 0x03FF],
      np.uint16,
  )
  return u.view(dt)


BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def nest(flat: dict) -> dict:
  """A nested-dict pytree from ``{"a/b": x}`` ids (how flax nests params)."""
  root: dict = {}
  for pid, v in flat.items():
    *parents, last = pid.split("/")
    node = root
    for k in parents:
      node = node.setdefault(k, {})
    node[last] = v
  return root


def rchar() -> int:
  """Bytes this process has read through read-like syscalls (pread included) so far."""
  with open("/proc/self/io") as f:
    for line in f:
      if line.startswith("rchar:"):
        return int(line.split()[1])
  raise RuntimeError("no rchar in /proc/self/io")


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_xla_compiles():
  """Counts XLA backend compilations inside the block (jax.monitoring)."""
  counter = {"n": 0}

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == _BACKEND_COMPILE:
      counter["n"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)

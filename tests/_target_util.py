"""Helpers of the target-sharding restore tests (shared with the multi-process worker).

The example state is deterministic (same seed -> same bits in every process):
an AdamW with injected hyper-parameters on trainable params and
``set_to_zero`` on a frozen one (so ``MaskedNode`` positions exist), every
history buffer and every float hyper-parameter filled with random bits (NaN
payloads, -0.0, subnormals included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests._core_util import bits, nest, random_example
from tests._shapes import TARGET_SPECS

SPECS = TARGET_SPECS
FROZEN = ("frozen/w",)


def optimizer(pids=tuple(SPECS)) -> Any:
  """The example optimizer for params with ids ``pids``."""
  labels = nest({pid: "frozen" if pid in FROZEN else "train" for pid in pids})
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.multi_transform(
      {
        "train": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.1),
        "frozen": optax.set_to_zero(),
      },
      labels,
    ),
  )


def example(seed: int = 0, specs: dict = SPECS, opt: Any = None) -> tuple[Any, Any, Any]:
  """(optimizer, params, state): histories and float scalars are random bits."""
  opt = optimizer() if opt is None else opt
  return (opt, *random_example(opt, specs, seed))


# One big parameter under Adam (1 MiB of history), read in chunks of one row.
BIG = {"big/w": ((256, 512), np.float32)}
BIG_CHUNK_BYTES = 2048


def big_example(seed: int = 7) -> tuple[Any, Any, Any]:
  return example(seed=seed, specs=BIG, opt=optax.adam(1e-3))


def trainable() -> dict:
  return {pid: pid not in FROZEN for pid in SPECS}


def fits(spec: P, shape: tuple[int, ...], mesh: Any) -> bool:
  """Whether ``spec`` can lay out ``shape`` on ``mesh`` (jax needs even splits)."""
  if len(spec) > len(shape):
    return False
  for dim, names in zip(shape, spec):
    names = () if names is None else (names,) if isinstance(names, str) else names
    if dim % int(np.prod([mesh.shape[n] for n in names])):
      return False
  return True


def abstract(opt: Any, params: Any, sharding: Callable[[tuple, Any], Any]) -> Any:
  """``eval_shape(opt.init, params)`` with ``sharding(path, leaf)`` attached to each leaf."""
  with jax.numpy_dtype_promotion("standard"):  # inject_hyperparams' init mixes dtypes
    shapes = jax.eval_shape(opt.init, params)
  return jax.tree_util.tree_map_with_path(
    lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(path, x)), shapes
  )


def spec_or_replicated(mesh: Any, spec: P) -> Callable[[tuple, Any], Any]:
  """``spec`` on every leaf it fits, replicated on ``mesh`` elsewhere (scalars, odd sizes)."""

  def f(path, x):
    return NamedSharding(mesh, spec if fits(spec, x.shape, mesh) else P())

  return f


def shard_mismatches(restored: Any, original: Any, target: Any) -> list[str]:
  """Every leaf whose device pieces differ from the original's bits, or whose layout
  differs from the target's; empty when the restore is exact.

  Each addressable shard is compared with the same index of the original, so
  no gather (and no float computation) stands between the two.
  """
  bad = []
  r_leaves, r_def = jax.tree_util.tree_flatten_with_path(restored)
  o_leaves, o_def = jax.tree_util.tree_flatten(original)
  t_leaves = jax.tree.leaves(target)
  if r_def != jax.tree_util.tree_structure(original):
    return [f"tree structure {r_def} != {o_def}"]
  for (path, r), o, t in zip(r_leaves, o_leaves, t_leaves, strict=True):
    name = jax.tree_util.keystr(path)
    o = np.asarray(o)
    if r.shape != o.shape or np.dtype(r.dtype) != o.dtype:
      bad.append(f"{name}: {r.shape} {r.dtype} != {o.shape} {o.dtype}")
      continue
    if r.sharding != t.sharding:
      bad.append(f"{name}: sharding {r.sharding} != target {t.sharding}")
    for shard in r.addressable_shards:
      if not np.array_equal(bits(shard.data), bits(o[shard.index])):
        bad.append(f"{name}: device {shard.device.id} index {shard.index} differs")
  return bad

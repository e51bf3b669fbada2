"""The built-in example: a flax MLP's AdamW state, sharded 8 ways, resharded to 6.

``jaxreshard demo`` runs this end to end and proves every step exact by
comparing bits: the 6-rank archives unshard to the original state, 8 -> 6 -> 8
returns the original archives, the sharding-independent digests agree, and
rank 2 of 6 restored from disk equals the
in-memory one. Shapes are chosen so that neither 8 nor 6 divides them evenly
and the 5-element bias leaves trailing all-padding ranks.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import digestdiff as _digestdiff
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["DemoRow", "DemoSummary", "run_demo", "train_example"]

SOURCE_WORLD = 8
TARGET_WORLD = 6
DISK_RANK = 2


@dataclasses.dataclass(frozen=True)
class DemoRow:
  """One parameter of the demo model."""

  param: str
  shape: tuple[int, ...]
  slots_source: int
  slots_target: int
  buffers: int
  bytes: int
  exact: bool


@dataclasses.dataclass(frozen=True)
class DemoSummary:
  """What the demo proved.

  Attributes:
    rows: one per parameter.
    unshard_exact: the 6-rank archives unshard to the original state, bit for bit.
    round_trip_exact: 8 -> 6 -> 8 returns the original archives exactly.
    digest_equal: the 8- and 6-rank digests agree (and have no problems).
    disk_exact: rank 2 of 6 restored from disk equals the in-memory one.
    steps: optimizer steps trained before sharding.
    seconds: wall time of the whole demo.
  """

  rows: tuple[DemoRow, ...]
  unshard_exact: bool
  round_trip_exact: bool
  digest_equal: bool
  disk_exact: bool
  steps: int
  seconds: float

  @property
  def exact(self) -> bool:
    return (
      self.unshard_exact
      and self.round_trip_exact
      and self.digest_equal
      and self.disk_exact
      and all(r.exact for r in self.rows)
    )


def train_example(steps: int = 3, seed: int = 0) -> tuple[Any, Any, Any]:
  """Trains a small flax MLP on synthetic regression data.

  Returns:
    ``(optimizer, params, opt_state)`` after ``steps`` AdamW steps.
  """
  import flax.linen as nn  # the optional `examples` extra; only the demo needs it

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.gelu(nn.Dense(37, name="hidden")(x))
      return nn.Dense(5, name="out")(x)

  model = MLP()
  kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (64, 13), jnp.float32)
  y = jax.random.normal(ky, (64, 5), jnp.float32)
  params = model.init(kp, x)["params"]
  optimizer = optax.adamw(3e-3, weight_decay=1e-4)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(
      params
    )
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  # optax's own update mixes Python floats with int32 counters, which strict
  # dtype promotion (a setting of the caller's, e.g. a test suite) refuses.
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(steps):
      params, state, _ = step(params, state)
  return optimizer, params, state


def _same(a: Any, b: Any) -> bool:
  """Same tree structure and bit-identical leaves (shapes and dtypes included)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  return ta == tb and all(
    np.asarray(x).dtype == np.asarray(y).dtype
    and np.shape(x) == np.shape(y)
    and np.array_equal(_bitview.bits(x), _bitview.bits(y))
    for x, y in zip(la, lb)
  )


def _same_record(a: jr.ShardRecord, b: jr.ShardRecord) -> bool:
  return (a.version, a.placements, a.roles) == (b.version, b.placements, b.roles) and _same(
    a.state, b.state
  )


def _histories(state: Any, roles) -> dict[str, list[Any]]:
  """param id -> its history buffers, in state order."""
  out: dict[str, list[Any]] = {}
  for leaf, role in zip(jax.tree.leaves(state), roles):
    if role is not None:
      out.setdefault(role, []).append(leaf)
  return out


def _reshard_all(records, world_size):
  return [
    jr.reshard(records, jr.plan(records, world_size=world_size, rank=r)) for r in range(world_size)
  ]


def run_demo(
  steps: int = 3, *, archive_dir: str | None = None, log: Callable[[str], None] = lambda _: None
) -> DemoSummary:
  """Runs the demo and returns what it proved (nothing is printed).

  Args:
    steps: optimizer steps to train before sharding.
    archive_dir: where to save the 8 archives for the disk check (kept; it
      must not exist); a temporary directory, removed afterwards, by default.
    log: called with a short line as each stage finishes.

  Returns:
    A ``DemoSummary``; ``summary.exact`` is True only when every check passed.
  """
  t0 = time.perf_counter()
  if archive_dir is not None and os.path.lexists(archive_dir):
    raise jr.ArchiveExistsError(f"{archive_dir} already exists; the demo never overwrites it")
  parent = os.path.dirname(os.path.abspath(archive_dir)) if archive_dir is not None else None
  if parent is not None and not os.path.isdir(parent):  # refused before the training
    raise FileNotFoundError(f"parent directory {parent} of {archive_dir} does not exist")
  optimizer, params, state = train_example(steps)
  log(f"trained a flax MLP for {steps} AdamW steps")
  src = jr.shard_state(optimizer, params, state, SOURCE_WORLD)
  log(f"sharded its optimizer state over {SOURCE_WORLD} ranks")
  dst = _reshard_all(src, TARGET_WORLD)
  log(f"resharded {SOURCE_WORLD} -> {TARGET_WORLD} ranks")

  full = jr.unshard_state(dst)
  unshard_exact = _same(full, state)
  back = _reshard_all(dst, SOURCE_WORLD)
  round_trip_exact = len(back) == len(src) and all(map(_same_record, back, src))
  log(
    f"checked unshard({TARGET_WORLD} ranks) == state and {SOURCE_WORLD} -> {TARGET_WORLD}"
    f" -> {SOURCE_WORLD} == original"
  )
  d_src, d_dst = _digest.digest_records(src), _digest.digest_records(dst)
  digest_equal = not _digestdiff.compare_digests(d_src, d_dst)

  with tempfile.TemporaryDirectory(prefix="jaxreshard-demo-") as tmp:
    path = archive_dir or f"{tmp}/checkpoint"
    jr.save_records(path, src)
    restored = jr.restore(path, world_size=TARGET_WORLD, rank=DISK_RANK)
    disk_exact = _same_record(restored, dst[DISK_RANK])
  log(
    f"saved the {SOURCE_WORLD} archives and restored rank {DISK_RANK} of {TARGET_WORLD} from disk"
  )

  # Per parameter: its unsharded history and its 8 -> 6 -> 8 slices are exact.
  roles = src[0].roles
  original, unsharded = _histories(state, roles), _histories(full, roles)
  rows = []
  for p in src[0].placements:
    hist = original.get(p.param, [])
    exact = _same(hist, unsharded.get(p.param, [])) and all(
      _same(_histories(a.state, a.roles).get(p.param), _histories(b.state, b.roles).get(p.param))
      for a, b in zip(back, src)
    )
    rows.append(
      DemoRow(
        param=p.param,
        shape=p.shape,
        slots_source=jr.FlatShard(p.shape, 0, SOURCE_WORLD).slots,
        slots_target=jr.FlatShard(p.shape, 0, TARGET_WORLD).slots,
        buffers=len(hist),
        bytes=sum(np.asarray(h).nbytes for h in hist),
        exact=exact,
      )
    )
  return DemoSummary(
    tuple(rows),
    unshard_exact,
    round_trip_exact,
    digest_equal,
    disk_exact,
    steps,
    time.perf_counter() - t0,
  )

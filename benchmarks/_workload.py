"""The benchmark workload: Adam flat-shard archives with lognormal parameter sizes.

Archives are built directly (numpy slices of random flat buffers, then one
``jnp.asarray`` per shard) rather than with ``jr.shard_state``, so that setting
up a 10,000-parameter model does not spend minutes compiling the very kernels
the benchmarks measure. ``records_like_shard_state`` in the smoke test checks
that the two agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr

__all__ = ["param_sizes", "param_ids", "nest", "adam_records", "history_bytes"]


def param_sizes(total: int, n_params: int, seed: int = 0) -> list[int]:
  """``n_params`` lognormal sizes (sigma 1.5) summing exactly to ``total``."""
  rng = np.random.default_rng(seed)
  w = rng.lognormal(mean=0.0, sigma=1.5, size=n_params)
  sizes = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
  sizes[np.argmax(sizes)] += total - int(sizes.sum())
  assert sizes.min() >= 1 and int(sizes.sum()) == total, (total, n_params)
  return [int(s) for s in sizes]


def param_ids(n: int) -> list[str]:
  """The ids of ``n`` parameters: ``layer_<i>/w``, zero-padded so they sort by ``i``."""
  width = len(str(n - 1))
  return [f"layer_{i:0{width}d}/w" for i in range(n)]


def adam_records(
  history: int,
  n_params: int,
  world_size: int,
  seed: int = 0,
  *,
  as_numpy: bool = False,
  packed: bool = False,
) -> list[jr.ShardRecord]:
  """``world_size`` Adam archives whose ``mu`` + ``nu`` hold ``history`` elements.

  Args:
    history: total history elements (``mu`` and ``nu`` together; even).
    n_params: number of 1-D float32 parameters, lognormal sizes.
    world_size: source ranks.
    seed: random seed of sizes and values.
    as_numpy: keep shards as numpy arrays (for saving) instead of jax arrays.
    packed: (with ``as_numpy``) every rank's shards are views of one buffer,
      in packing order, and the ranks' buffers the rows of one 2-D array: the
      layout ``jr.shard_state`` and ``jr.reshard_ranks`` build. Otherwise
      each shard is an array of its own.

  Returns:
    Records in rank order, as ``jr.shard_state`` would build them.
  """
  sizes = param_sizes(history // 2, n_params, seed)
  ids = param_ids(n_params)
  rng = np.random.default_rng(seed + 1)
  flat = {name: rng.random(history // 2, dtype=np.float32) for name in ("mu", "nu")}
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  slots = [-(-n // world_size) for n in sizes]
  opt = optax.adam(1e-3)
  # Every rank has the same local shapes: one template, one set of roles.
  local = nest({pid: jax.ShapeDtypeStruct((s,), np.float32) for pid, s in zip(ids, slots)})
  template = jax.eval_shape(opt.init, local)
  # Packing order: params sorted by id (they are), then mu before nu.
  width = 2 * sum(slots)
  rows = np.zeros((world_size, width), np.float32) if packed else None
  order = sorted(range(n_params), key=ids.__getitem__)
  records = []
  roles = None
  for rank in range(world_size):
    bufs = {"mu": {}, "nu": {}}
    placements = []
    at = 0
    for i in order:
      pid, n, lo, s = ids[i], sizes[i], int(bounds[i]), slots[i]
      start, stop = min(rank * s, n), min((rank + 1) * s, n)
      placements.append(jr.ParamPlacement(pid, (n,), rank, world_size, np.dtype(np.float32), True))
      for name in ("mu", "nu"):
        shard = rows[rank, at : at + s] if packed else np.zeros((s,), np.float32)
        at += s
        shard[: stop - start] = flat[name][lo + start : lo + stop]
        bufs[name][pid] = shard if as_numpy or packed else jnp.asarray(shard)
    adam = template[0]
    state = (
      adam._replace(
        count=np.zeros((), np.int32) if as_numpy or packed else jnp.zeros((), jnp.int32),
        mu=nest(bufs["mu"]),
        nu=nest(bufs["nu"]),
      ),
      template[1],
    )
    if roles is None:
      roles = tuple(
        None if np.ndim(leaf) == 0 else _leaf_id(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
      )
    records.append(
      jr.ShardRecord(
        version=jr.RECORD_VERSION, placements=tuple(placements), state=state, roles=roles
      )
    )
  # Transfers to the CPU backend are asynchronous: finish them here, not inside
  # the first measured call.
  return jax.block_until_ready(records)


def nest(flat: dict) -> dict:
  """``{"layer/name": leaf}`` as ``{"layer": {"name": leaf}}``."""
  out: dict = {}
  for pid, leaf in flat.items():
    layer, name = pid.split("/")
    out.setdefault(layer, {})[name] = leaf
  return out


def _leaf_id(path) -> str:
  return "/".join(str(k.key) for k in path[-2:])


def history_bytes(records) -> int:
  """Bytes of every history buffer in ``records``."""
  return sum(
    int(np.asarray(x).nbytes) if not hasattr(x, "nbytes") else int(x.nbytes)
    for r in records
    for x, role in zip(jax.tree.leaves(r.state), r.roles)
    if role
  )

"""(f) Time per byte as the world grows (8 -> 6 .. 4,096 -> 3,072)."""

from __future__ import annotations

import gc
import time

import jax

import jaxreshard as jr
from benchmarks import _workload
from benchmarks._measure import Result, block, measure
from benchmarks._options import Options
from jaxreshard._src.exec import native as _native

NAME = "scale"
GOAL = (
  "every target rank, 1,000 parameters, the same bytes: time per byte at 256 -> 192 within"
  " 1.5x of 8 -> 6, and at 4,096 -> 3,072 within 2x"
)
# The most a row may take, relative to the first row, by its source world size.
_LIMITS = {256: 1.5, 4096: 2.0}
# Warm calls timed per row (the best is reported): each call faults in a fresh
# output, whose cost on a shared VM swings by 2-3x from call to call (the
# kernel's huge-page compaction); a warm call is short beside a row's setup.
_WARM_REPEATS = 6


def world_row(src: int, dst: int, opts: Options) -> dict:
  """Every target rank of a ``src``-rank state, in one ``reshard_ranks`` call."""
  t0 = time.perf_counter()
  records = _workload.adam_records(
    opts.scale_size, opts.scale_params, src, opts.seed, as_numpy=True, packed=True
  )
  setup = time.perf_counter() - t0
  plans = [jr.plan(records, world_size=dst, rank=r) for r in range(dst)]
  # The host executor returns numpy buffers, every byte copied when the call
  # returns: there is nothing to wait for, and waiting (``block``) would make
  # every rank's per-leaf objects, timed on their own below.
  t0 = time.perf_counter()
  targets = jr.reshard_ranks(records, plans)
  cold = time.perf_counter() - t0
  nbytes = _workload.history_bytes(targets)
  del targets
  gc.collect()
  repeats = 1 if opts.quick else _WARM_REPEATS
  warm = measure(lambda: jr.reshard_ranks(records, plans), repeats)
  leaves = measure(lambda: _every_leaf(jr.reshard_ranks(records, plans)), max(1, opts.repeats - 1))
  # The last target rank alone reads every all-padding source rank after its own
  # slots: its first call makes that plan's padding tables, later calls reuse them.
  t0 = time.perf_counter()
  jr.reshard(records, plans[-1])
  last_first = time.perf_counter() - t0
  last = measure(lambda: jr.reshard(records, plans[-1]), repeats)
  records = plans = None  # freed; the lambdas above are not called again
  gc.collect()
  return {
    "what": f"{src} -> {dst}",
    "source_ranks": src,
    "target_ranks": dst,
    "mib_built": round(nbytes / 2**20, 2),
    "setup_s": round(setup, 2),
    "cold_s": round(cold, 3),
    "warm_s": round(warm.best, 4),
    "ns_per_byte": round(1e9 * warm.best / nbytes, 3),
    "us_per_target_param": round(1e6 * warm.best / (dst * opts.scale_params), 2),
    "with_leaves_s": round(leaves.best, 3),
    "leaf_us_per_target_param": round(
      1e6 * max(leaves.best - warm.best, 0.0) / (dst * opts.scale_params), 2
    ),
    "last_rank_first_s": round(last_first, 4),
    "last_rank_warm_s": round(last.best, 4),
    "last_vs_share": round(last.best / (warm.best / dst), 2),
    "compiled_copy": _native.enabled,
  }


def _every_leaf(targets) -> list:
  """Every target's per-leaf objects: its state's leaves and its placements, waited for."""
  return [block(jax.tree_util.tree_leaves(t)) for t in targets]


def run(opts: Options) -> Result:
  rows = [world_row(s, d, opts) for s, d in opts.scale_worlds]
  base = rows[0]["ns_per_byte"]
  for r in rows:
    r["vs_first"] = round(r["ns_per_byte"] / base, 2)
  met = None
  if not opts.quick:
    limits = {r["source_ranks"]: r["vs_first"] for r in rows}
    met = all(s in limits and limits[s] <= most for s, most in _LIMITS.items())
  notes = (
    f"Resharding rows: Adam, {opts.scale_params} parameters, {opts.scale_size} history"
    " elements in total, every target rank in one `reshard_ranks` call (host executor;"
    " all sources in one process as simulated ranks; each source rank's shards are views"
    " of one buffer, the ranks' buffers rows of one array, as `shard_state` and"
    " `reshard_ranks` lay them out). `warm_s`: the call, best of the warm ones; it"
    " returns every target record with every byte copied (numpy buffers: nothing to"
    " wait for), each record's placements and state made from its packed buffers"
    " when first read. `ns_per_byte`: warm time / bytes built; `vs_first`: relative to"
    " 8 -> 6; `us_per_target_param`: warm time per (target rank, parameter) pair."
    " `with_leaves_s`: the call and then every record's leaves and placements made"
    " and waited for (`jax.block_until_ready` of each record); `leaf_us_per_target_param`:"
    " that extra time per pair (one view, one placement and two leaves per pair,"
    " which a reader touching every leaf of every rank pays)."
    " `last_rank_first_s`, `last_rank_warm_s`: `reshard` of the last target rank"
    " alone, its first call (which makes its plan's padding tables) and the best warm"
    " one; `last_vs_share`: the warm one over an average rank's share of `warm_s`."
    " `compiled_copy`: whether the block copies went through the compiled block copy"
    " (`_src/exec/_blockcopy.c`; numpy alone where the package was built without it)."
  )
  return Result(NAME, "time per byte vs world size", GOAL, met, tuple(rows), notes)

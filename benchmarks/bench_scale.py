"""(6) Scale: time per byte of resharding as the simulated world grows (8->6 .. 512->384)."""

from __future__ import annotations

import gc
import time

import jaxreshard as jr
from benchmarks import _workload
from benchmarks._measure import Result, block, measure
from benchmarks._options import Options

NAME = "scale"
GOAL = "time per byte stays flat from 8 -> 6 to 512 -> 384 ranks"


def measure_world(src: int, dst: int, opts: Options) -> dict:
  """One row: reshard a sample of target ranks of a ``src``-rank checkpoint."""
  t0 = time.perf_counter()
  records = _workload.adam_records(opts.scale_size, opts.n_params, src, opts.seed)
  setup = time.perf_counter() - t0
  ranks = sorted({0, dst // 2})
  plans = [jr.plan(records, dst, r) for r in ranks]
  go = lambda: block([jr.reshard(records, p) for p in plans])
  jr.clear_kernel_cache()
  t0 = time.perf_counter()
  targets = go()
  cold = time.perf_counter() - t0
  nbytes = _workload.history_bytes(targets)
  del targets
  warm = measure(go, opts.repeats)
  del records
  gc.collect()
  return {
      "source_ranks": src,
      "target_ranks": dst,
      "ranks_timed": len(plans),
      "mib_built": round(nbytes / 2**20, 2),
      "setup_s": round(setup, 3),
      "cold_s": round(cold, 3),
      "warm_s": round(warm.best, 5),
      "ns_per_byte": round(1e9 * warm.best / nbytes, 3),
      "programs": jr.kernel_cache_info().programs,
  }


def run(opts: Options) -> Result:
  rows = tuple(measure_world(s, d, opts) for s, d in opts.scale_worlds)
  base = rows[0]["ns_per_byte"]
  for r in rows:
    r["vs_first"] = round(r["ns_per_byte"] / base, 2)
  met = None if opts.quick else max(r["vs_first"] for r in rows) <= 1.5
  notes = (
      f"Adam, {opts.n_params} parameters, {opts.scale_size} history elements in total; all"
      " source archives live in one process (simulated ranks). Each row rebuilds target"
      " ranks 0 and M/2 (a target rank holds 1/M of the bytes, so the bytes per rank shrink"
      " as M grows). `ns_per_byte`: warm time / bytes built; `vs_first`: relative to 8 -> 6."
      " Flat means within 1.5x.")
  return Result(NAME, "time per byte vs simulated world size", GOAL, met, rows, notes)

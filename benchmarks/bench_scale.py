"""(f) Time per byte as the world grows (8 -> 6 .. 4,096 -> 3,072)."""

from __future__ import annotations

import gc
import time

import jaxreshard as jr
from benchmarks import _workload
from benchmarks._measure import Result, block, measure
from benchmarks._options import Options

NAME = "scale"
GOAL = (
  "every target rank, 1,000 parameters, the same bytes: time per byte at 256 -> 192 within"
  " 1.5x of 8 -> 6, and at 4,096 -> 3,072 within 2x"
)
# The most a row may take, relative to the first row, by its source world size.
_LIMITS = {256: 1.5, 4096: 2.0}


def world_row(src: int, dst: int, opts: Options) -> dict:
  """Every target rank of a ``src``-rank state, in one ``reshard_ranks`` call."""
  t0 = time.perf_counter()
  records = _workload.adam_records(
    opts.scale_size, opts.scale_params, src, opts.seed, as_numpy=True
  )
  setup = time.perf_counter() - t0
  plans = [jr.plan(records, world_size=dst, rank=r) for r in range(dst)]
  t0 = time.perf_counter()
  targets = block(jr.reshard_ranks(records, plans))
  cold = time.perf_counter() - t0
  nbytes = _workload.history_bytes(targets)
  del targets
  gc.collect()
  warm = measure(lambda: block(jr.reshard_ranks(records, plans)), max(1, opts.repeats - 1))
  records = plans = None  # freed; the lambda above is not called again
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
  }


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
    " all sources in one process as simulated ranks). `ns_per_byte`: warm time / bytes"
    " built; `vs_first`: relative to 8 -> 6; `us_per_target_param`: warm time per"
    " (target rank, parameter) pair, the unit of the per-rank work (a record of"
    " `scale_params` leaves per target rank)."
  )
  return Result(NAME, "time per byte vs world size", GOAL, met, tuple(rows), notes)

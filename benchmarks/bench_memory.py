"""(a) In-memory reshard of every target rank, rank after rank, vs numpy copyto of the same bytes."""

from __future__ import annotations

import gc
import time

import numpy as np

import jaxreshard as jr
from benchmarks import _workload
from benchmarks._measure import Result, block, gbps, measure
from benchmarks._options import Options

NAME = "memory"
GOAL = (
  "warm >= 0.5x numpy copyto of the same bytes into a pre-touched buffer; cold/warm"
  " <= 1.5 (200 parameters, 8 -> 6, every target rank, reshard rank after rank)"
)


def reshard_all(records, plans):
  """Every target rank, one ``reshard`` call each (as a user restarting rank by rank)."""
  return block([jr.reshard(records, p) for p in plans])


def measure_size(size: int, opts: Options) -> dict:
  """One row: reshard all target ranks of ``size`` history elements, and the baselines."""
  records = _workload.adam_records(size, opts.n_params, opts.src_world, opts.seed)
  plans = [jr.plan(records, world_size=opts.dst_world, rank=r) for r in range(opts.dst_world)]
  t0 = time.perf_counter()
  targets = reshard_all(records, plans)  # cold: first pass over these records in the process
  cold = time.perf_counter() - t0
  nbytes = _workload.history_bytes(targets)
  del targets
  gc.collect()
  warm = measure(lambda: reshard_all(records, plans), opts.repeats)
  batch = measure(lambda: block(jr.reshard_ranks(records, plans)), opts.repeats)
  records = None  # freed; the lambdas above are not called again
  gc.collect()
  src = np.random.default_rng(opts.seed).random(nbytes // 4, dtype=np.float32)
  dst = np.zeros_like(src)  # pre-touched
  memcpy = measure(lambda: np.copyto(dst, src), opts.repeats, warmup=1)
  fresh = measure(lambda: src.copy(), opts.repeats)
  dst = src = None
  gc.collect()
  return {
    "history_elements": size,
    "mib": round(nbytes / 2**20, 1),
    "cold_s": round(cold, 4),
    "reshard_s": round(warm.best, 5),
    "reshard_ranks_s": round(batch.best, 5),
    "memcpy_s": round(memcpy.best, 5),
    "fresh_copy_s": round(fresh.best, 5),
    "reshard_gbps": round(gbps(nbytes, warm.best), 2),
    "memcpy_gbps": round(gbps(nbytes, memcpy.best), 2),
    "vs_memcpy": round(memcpy.best / warm.best, 3),
    "vs_fresh_copy": round(fresh.best / warm.best, 3),
    "cold_over_warm": round(cold / warm.best, 2),
  }


def run(opts: Options) -> Result:
  rows = tuple(measure_size(s, opts) for s in opts.sizes)
  met = (
    None if opts.quick else all(r["vs_memcpy"] >= 0.5 and r["cold_over_warm"] <= 1.5 for r in rows)
  )
  notes = (
    f"Adam, {opts.n_params} parameters (lognormal sizes), {opts.src_world} ->"
    f" {opts.dst_world}; every target rank rebuilt per pass with one `reshard` call per"
    " rank (`reshard_ranks_s`: all ranks in one `reshard_ranks` call). Sources are jax"
    " arrays of the CPU backend, so the host executor runs (numpy copies into one fresh"
    " buffer per rank and dtype; nothing is compiled). `history_elements` = mu + nu"
    " elements (float32); GB/s counts bytes read + written. Times are the best of"
    f" {opts.repeats} warm passes; `cold_s` is the first pass over the records in this"
    " process (validation not yet cached). `vs_memcpy` = numpy copyto of the same bytes"
    " into a pre-touched buffer / reshard time; `vs_fresh_copy` the same against"
    " `src.copy()` (a fresh buffer, paying first-touch page faults as a reshard must)."
  )
  return Result(NAME, "reshard every target rank vs numpy copyto", GOAL, met, rows, notes)

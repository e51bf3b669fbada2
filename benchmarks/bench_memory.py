"""(1) In-memory reshard of every target rank vs numpy copyto vs a jitted device copy."""

from __future__ import annotations

import contextlib
import gc
import time

import jax
import numpy as np

import jaxreshard as jr
from jaxreshard import _kernels
from benchmarks import _measure, _workload
from benchmarks._measure import Result, block, gbps, measure
from benchmarks._options import Options

NAME = "memory"
GOAL = ">= 0.5x numpy memcpy speed on the CPU (>= 0.8x a device copy on a GPU)"


def reshard_all(records, plans):
  """Every target rank, blocked on; returns the target records."""
  return block([jr.reshard(records, p) for p in plans])


@contextlib.contextmanager
def kernel_timer():
  """Accumulates the wall time spent inside the jitted kernels (blocking on each)."""
  spent = [0.0]
  original = _kernels.assemble

  def timed(outputs):
    t0 = time.perf_counter()
    out = block(original(outputs))
    spent[0] += time.perf_counter() - t0
    return out

  _kernels.assemble = timed
  try:
    yield spent
  finally:
    _kernels.assemble = original


def measure_size(size: int, opts: Options) -> dict:
  """One row: reshard all target ranks of ``size`` history elements, and both baselines."""
  records = _workload.adam_records(size, opts.n_params, opts.src_world, opts.seed)
  plans = [jr.plan(records, opts.dst_world, r) for r in range(opts.dst_world)]
  jr.clear_kernel_cache()
  t0 = time.perf_counter()
  targets = reshard_all(records, plans)
  cold = time.perf_counter() - t0
  nbytes = _workload.history_bytes(targets)
  del targets
  warm = measure(lambda: reshard_all(records, plans), opts.repeats)
  with kernel_timer() as spent:
    t0 = time.perf_counter()
    reshard_all(records, plans)
    total = time.perf_counter() - t0
  kernel = spent[0]
  del records
  gc.collect()

  src = np.random.default_rng(opts.seed).random(nbytes // 4, dtype=np.float32)
  dst = np.zeros_like(src)  # pre-touched
  memcpy = measure(lambda: np.copyto(dst, src), opts.repeats, warmup=1)
  fresh = measure(lambda: src.copy(), opts.repeats)
  del dst
  x = jax.device_put(src.view(np.uint32))
  del src
  copy = jax.jit(lambda a: a + 0)
  device = measure(lambda: block(copy(x)), opts.repeats, warmup=1)
  del x
  gc.collect()
  return {
      "history_elements": size,
      "mib": round(nbytes / 2**20, 1),
      "cold_s": round(cold, 4),
      "reshard_s": round(warm.best, 5),
      "kernel_s": round(kernel, 5),
      "python_share": round(1 - kernel / total, 3) if total > 0 else None,
      "memcpy_s": round(memcpy.best, 5),
      "fresh_copy_s": round(fresh.best, 5),
      "device_copy_s": round(device.best, 5),
      "reshard_gbps": round(gbps(nbytes, warm.best), 2),
      "memcpy_gbps": round(gbps(nbytes, memcpy.best), 2),
      "device_copy_gbps": round(gbps(nbytes, device.best), 2),
      "vs_memcpy": round(memcpy.best / warm.best, 4),
      "vs_device_copy": round(device.best / warm.best, 4),
      "kernel_vs_memcpy": round(memcpy.best / kernel, 4) if kernel > 0 else None,
  }


def run(opts: Options) -> Result:
  rows = tuple(measure_size(s, opts) for s in opts.sizes)
  big = max(rows, key=lambda r: r["history_elements"])
  met = None if opts.quick else big["vs_memcpy"] >= 0.5
  notes = (
      f"Adam, {opts.n_params} parameters (lognormal sizes), {opts.src_world} -> {opts.dst_world};"
      " every target rank rebuilt per pass. `history_elements` = mu + nu elements (float32);"
      " GB/s counts bytes read + written. Times are the best of"
      f" {opts.repeats} warm passes; `cold_s` is the first pass after clear_kernel_cache()."
      " `kernel_s` is the time inside the jitted kernels (blocked on) during one pass;"
      " `python_share` the rest of that pass (validation, planning, state rebuild)."
      " `vs_memcpy` = memcpy time / reshard time (1.0 = as fast as numpy copyto into a"
      " pre-touched buffer); `kernel_vs_memcpy` the same for the kernels alone."
      " Verdict on the largest size.")
  return Result(NAME, "reshard all target ranks vs numpy copyto vs jitted copy", GOAL, met, rows,
                notes)

"""(5) Peak memory (RSS) of restoring one target rank vs that rank's bytes.

Each measurement is a fresh process: the import baseline is its RSS after
importing jax, orbax and jaxreshard; the peak is ``VmHWM`` of
``/proc/self/status`` (reset through ``/proc/self/clear_refs`` before the warm
restore; ``resource.getrusage`` maxrss where that is unavailable).
"""

from __future__ import annotations

import gc
import os
import resource
import tempfile

from benchmarks._measure import Result, run_child
from benchmarks._options import Options

NAME = "rss"
GOAL = "peak memory of a one-rank restore at most 1.5x the rank's bytes above the import baseline"


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def _peak_kib() -> int:
  try:
    return _status_kib("VmHWM")
  except (OSError, KeyError):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def child(path: str, rank: int, world_size: int) -> dict:
  """Restores ``rank`` twice (cold, then warm) and reports peaks above the baseline."""
  import jax  # noqa: F401 - part of the import baseline
  import orbax.checkpoint  # noqa: F401
  import psutil

  import jaxreshard as jr
  from benchmarks import _workload
  from benchmarks._measure import block

  proc = psutil.Process()
  gc.collect()
  base = proc.memory_info().rss
  target = block(jr.restore(path, world_size=world_size, rank=rank))
  cold_peak = _peak_kib() * 1024 - base
  nbytes = _workload.history_bytes([target])
  del target
  gc.collect()
  base_warm = proc.memory_info().rss
  reset = _reset_peak()
  target = block(jr.restore(path, world_size=world_size, rank=rank))
  warm_peak = _peak_kib() * 1024 - base_warm if reset else None
  held = proc.memory_info().rss - base_warm  # while `target` is still alive
  del target
  return {
    "rank_bytes": nbytes,
    "import_rss": base,
    "cold_peak": cold_peak,
    "warm_peak": warm_peak,
    "held_after": held,
    "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }


def run(opts: Options) -> Result:
  from benchmarks import _disk

  with tempfile.TemporaryDirectory(prefix="jr-bench-rss-") as tmp:
    path = os.path.join(tmp, "ckpt")
    _disk.write_jaxreshard(path, opts.disk_size, opts.n_params, opts.src_world, opts.seed)
    got = run_child("bench_rss", "child", dict(path=path, world_size=opts.dst_world, rank=0))
  mib = lambda b: None if b is None else round(b / 2**20, 1)
  row = {
    "rank_mib": mib(got["rank_bytes"]),
    "import_rss_mib": mib(got["import_rss"]),
    "cold_peak_mib": mib(got["cold_peak"]),
    "cold_over_rank": round(got["cold_peak"] / got["rank_bytes"], 2),
    "warm_peak_mib": mib(got["warm_peak"]),
    "warm_over_rank": (
      None if got["warm_peak"] is None else round(got["warm_peak"] / got["rank_bytes"], 2)
    ),
    "held_after_mib": mib(got["held_after"]),
  }
  ratio = row["warm_over_rank"] if row["warm_over_rank"] is not None else row["cold_over_rank"]
  met = None if opts.quick else ratio <= 1.5
  notes = (
    f"Adam, {opts.n_params} parameters, {opts.disk_size} history elements over"
    f" {opts.src_world} ranks; target rank 0 of {opts.dst_world} restored in a fresh process."
    " `cold_peak`: peak RSS during the first restore above the RSS right after imports"
    " (includes compiling the kernels: XLA's compiler memory); `warm_peak`: peak during a"
    " second restore of the same rank above the RSS before it (peak reset via"
    " /proc/self/clear_refs). Verdict on the warm peak (the data path); the cold one is"
    " reported for what a one-shot restore really costs."
  )
  return Result(NAME, "peak RSS of one-rank restore vs the rank's bytes", GOAL, met, (row,), notes)

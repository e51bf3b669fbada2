"""(d) Saving the 200-parameter state over 8 ranks vs orbax's save of the same state unsharded."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result, best_of
from benchmarks._options import Options

NAME = "save"
GOAL = (
  "save over 8 ranks <= 0.3x orbax StandardCheckpointer's save of the same state"
  " unsharded; files <= 4 per (rank, dtype) plus a constant"
)


def _files(path: str) -> int:
  return sum(len(fs) for _, _, fs in os.walk(path))


def measure(n_params: int, history: int, world: int, repeats: int, tmp: str) -> dict:
  """One row: jaxreshard's save of ``world`` archives and orbax's of the whole state."""
  records = _workload.adam_records(history, n_params, world, 0, as_numpy=True)
  # The same state unsharded, as orbax would save it: mu and nu per parameter.
  full = jr.unshard_state(records)
  tree = {
    "mu": _disk.flat_tree(full[0].mu),
    "nu": _disk.flat_tree(full[0].nu),
    "count": np.asarray(full[0].count),
  }
  tree = {
    k: (np.asarray(v) if not isinstance(v, dict) else {a: np.asarray(b) for a, b in v.items()})
    for k, v in tree.items()
  }

  def jr_save(i):
    jr.save_records(os.path.join(tmp, f"jr{n_params}_{i}"), records, durable=False)

  def orbax_save(i):
    _disk.write_orbax_plain(os.path.join(tmp, f"ob{n_params}_{i}"), tree)

  jr_s = best_of(jr_save, repeats)
  ob_s = best_of(orbax_save, repeats)
  files = _files(os.path.join(tmp, f"jr{n_params}_0"))
  orbax_files = _files(os.path.join(tmp, f"ob{n_params}_0"))
  dtypes = 1
  for name in os.listdir(tmp):
    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
  return {
    "params": n_params,
    "mib": round(_workload.history_bytes(records) / 2**20, 2),
    "ranks": world,
    "jaxreshard_save_s": round(jr_s, 4),
    "orbax_save_unsharded_s": round(ob_s, 4),
    "save_over_orbax": round(jr_s / ob_s, 3),
    "files": files,
    "files_per_rank_dtype": round((files - 1) / (world * dtypes), 2),
    # Computed: the previous format wrote per rank a record.json and, per history
    # buffer (mu and nu of each parameter), a zarr.json and a shard file.
    "v1_format_files": world * (1 + 2 * 2 * n_params) + 1,
    "orbax_files": orbax_files,
  }


def run(opts: Options) -> Result:
  with tempfile.TemporaryDirectory(prefix="jr-bench-save-") as tmp:
    rows = tuple(measure(n, h, opts.src_world, opts.repeats, tmp) for n, h in opts.save_states)
  met = (
    None
    if opts.quick
    else all(
      r["save_over_orbax"] <= 0.3 and r["files"] <= 4 * r["ranks"] + 1
      for r in rows
      if r["params"] == opts.n_params
    )
  )
  notes = (
    "Adam, float32, lognormal parameter sizes; 200 parameters is the workload of the goal,"
    " 148 the parameter count of GPT-2 (small) at its 8.4 MB optimizer state. jaxreshard"
    f" saves {opts.src_world} archives with `save_records` (one buffer per rank and"
    " dtype, crc32c per chunk, atomic rename); orbax saves the same state unsharded"
    " (mu and nu per parameter, numpy) with `StandardCheckpointer`. Best of"
    f" {opts.repeats}, each into a new directory; jaxreshard with `durable=False` (page"
    " cache, no fsync), orbax as it ships (tensorstore fsyncs its data files): the"
    " `durable` benchmark compares both durable."
    " `files`: files in the jaxreshard checkpoint: an index, and per rank archive.json"
    " plus zarr.json and the shard file per dtype. `v1_format_files`: what the"
    " previous format (one zarr array per buffer per rank) wrote for the same state."
  )
  return Result(NAME, "save over 8 ranks vs orbax save unsharded", GOAL, met, rows, notes)

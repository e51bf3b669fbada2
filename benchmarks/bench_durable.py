"""(d') Durable saves: jaxreshard's fsync'ed save vs orbax's save and ``dd conv=fsync``.

Both sides durable: ``save_records`` (default ``durable=True``) fsyncs every file
and directory, renames, then fsyncs the parent; orbax's ``StandardCheckpointer``
saves through tensorstore, which fsyncs its data files and manifests. ``dd
if=/dev/zero bs=1M conv=fsync`` of the same number of bytes on the same disk is
the bandwidth baseline (its own reported time, without its process start).
The rounds are interleaved (jaxreshard, orbax, dd, jaxreshard, ...) so that a
shared machine's load falls on every side alike; the median and the range of
the rounds are reported, with the load average before and after.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import google_crc32c
import numpy as np

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result
from benchmarks._options import Options
from jaxreshard._src.checkpoint import reader as _checkpoint

NAME = "durable"
GOAL = (
  "durable save over 8 ranks (200 parameters) <= 0.5x orbax StandardCheckpointer's save"
  " of the same state, and >= 0.7x the bandwidth of dd conv=fsync of the same bytes"
)


def _loadavg() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "?"


def _dd(path: str, nbytes: int) -> float:
  """Seconds ``dd conv=fsync`` reports for writing ``nbytes`` zeros to ``path``."""
  proc = subprocess.run(
    [
      "dd",
      "if=/dev/zero",
      f"of={path}",
      "bs=1M",
      f"count={nbytes}",
      "iflag=count_bytes",
      "conv=fsync",
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  m = re.search(r"copied, ([0-9.eE+-]+) s", proc.stderr)
  os.unlink(path)
  return float(m[1])


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def _spread(xs: list[float]) -> str:
  return f"{min(xs):.4f}..{max(xs):.4f}"


def measure(n_params: int, history: int, world: int, rounds: int, tmp: str) -> dict:
  """One row: ``rounds`` interleaved durable saves of each side, medians and ranges."""
  records = _workload.adam_records(history, n_params, world, 0, as_numpy=True)
  full = jr.unshard_state(records)
  tree = {
    "mu": _disk.flat_tree(full[0].mu),
    "nu": _disk.flat_tree(full[0].nu),
    "count": np.asarray(full[0].count),
  }
  nbytes = _workload.history_bytes(records)
  buffers = [
    np.asarray(x).reshape(-1).view(np.uint8)
    for r in records
    for x in (*_disk.flat_tree(r.state[0].mu).values(), *_disk.flat_tree(r.state[0].nu).values())
  ]
  load_before = _loadavg()
  jr_s, ob_s, dd_s, scratch_s, crc_s, build_s = [], [], [], [], [], []
  for i in range(max(1, rounds)):
    jr_s.append(_timed(lambda: jr.save_records(os.path.join(tmp, f"jr{i}"), records)))
    ob_s.append(_timed(lambda: _disk.write_orbax_plain(os.path.join(tmp, f"ob{i}"), tree)))
    dd_s.append(_dd(os.path.join(tmp, f"dd{i}"), nbytes))
    # The profile: the same save without any fsync (write + crc32c), and crc32c alone.
    scratch_s.append(
      _timed(lambda: jr.save_records(os.path.join(tmp, f"nd{i}"), records, durable=False))
    )
    crc_s.append(_timed(lambda: [google_crc32c.value(b) for b in buffers]))
    # The index entries and packed buffers alone (checks and packing, no I/O).
    builder = _checkpoint.IndexBuilder()
    build_s.append(_timed(lambda: [builder.add(j, r) for j, r in enumerate(records)]))
    for name in os.listdir(tmp):
      shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
  med = statistics.median
  return {
    "params": n_params,
    "mib": round(nbytes / 2**20, 2),
    "ranks": world,
    "rounds": len(jr_s),
    "jaxreshard_s": round(med(jr_s), 4),
    "jaxreshard_range_s": _spread(jr_s),
    "orbax_s": round(med(ob_s), 4),
    "orbax_range_s": _spread(ob_s),
    "dd_fsync_s": round(med(dd_s), 4),
    "dd_range_s": _spread(dd_s),
    "save_over_orbax": round(med(jr_s) / med(ob_s), 3),
    "bandwidth_over_dd": round(med(dd_s) / med(jr_s), 3),
    "jaxreshard_mb_s": round(nbytes / med(jr_s) / 1e6, 1),
    "dd_mb_s": round(nbytes / med(dd_s) / 1e6, 1),
    "profile_write_crc_s": round(med(scratch_s), 4),
    "profile_crc_s": round(med(crc_s), 4),
    "profile_index_pack_s": round(med(build_s), 4),
    "profile_fsync_s": round(med(jr_s) - med(scratch_s), 4),
    "load_before_after": f"{load_before} / {_loadavg()}",
  }


def run(opts: Options) -> Result:
  where = opts.durable_dir or None
  with tempfile.TemporaryDirectory(prefix="jr-bench-durable-", dir=where) as tmp:
    rows = tuple(
      measure(n, h, opts.src_world, opts.durable_rounds, tmp) for n, h in opts.durable_states
    )
  met = (
    None
    if opts.quick
    else all(
      r["save_over_orbax"] <= 0.5 and r["bandwidth_over_dd"] >= 0.7
      for r in rows
      if r["params"] == opts.n_params
    )
  )
  notes = (
    "Adam, float32, lognormal parameter sizes, the `save` benchmark's state. jaxreshard:"
    f" `save_records` of {opts.src_world} archives, durable (every file and directory"
    " fsync'ed, rename, parent fsync'ed). orbax: `StandardCheckpointer` of the same state"
    " unsharded; tensorstore fsyncs its data files, manifests and directories, while"
    " orbax's own metadata files and the parent after its rename are not fsync'ed (seen"
    " with strace), so orbax does slightly less. dd: `dd if=/dev/zero bs=1M"
    " iflag=count_bytes count=<the history bytes> conv=fsync`, its own reported time."
    f" {opts.durable_rounds} interleaved rounds per side, each into a new directory in the"
    " same temporary directory; medians, ranges min..max. Bandwidth counts the history"
    " bytes (jaxreshard also writes a crc32c per chunk and small metadata). Profile:"
    " `profile_write_crc_s` is the same save with `durable=False` (writes + crc32c +"
    " metadata), `profile_crc_s` crc32c alone over the history buffers,"
    " `profile_index_pack_s` the index entries and packed buffers alone (the archive"
    " checks and the copy into one buffer per rank and dtype, no I/O),"
    " `profile_fsync_s` = durable median - `durable=False` median."
  )
  return Result(NAME, "durable save vs orbax save and dd conv=fsync", GOAL, met, rows, notes)

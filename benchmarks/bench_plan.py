"""(c, d) Planning and restoring one target rank of a large model saved over many ranks."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result, run_child
from benchmarks._options import Options

NAME = "plan"
GOAL = (
  "10,000 parameters saved over 4,096 ranks, one target rank of 3,072: (c) open the checkpoint"
  " and plan the rank <= 50 ms; (d) restore it >= 0.5x a raw read() of its bytes"
)
PLAN_SECONDS = 0.05
VS_RAW_READ = 0.5


def needed_ranks(counts: np.ndarray, src: int, dst: int, rank: int) -> np.ndarray:
  """Source ranks whose slots meet target ``rank``'s slots of some param (flat geometry).

  These are the archives a restore of that rank reads or checks for padding,
  when no all-padding source rank past the target world's padded buffer falls
  to it (``copyplan.padding_ranks``): true of the rank measured, ``dst // 3``.
  Its share of the source ranks, whose ``archive.json`` it checks
  (``restore.described_sources``), is among them; archive 0 (the first of the
  group) it checks too.
  """
  counts = counts[counts > 0]
  ss, ts = -(-counts // src), -(-counts // dst)
  lo = np.minimum(rank * ts // ss, src)
  hi = np.minimum(-(-(rank + 1) * ts // ss), src)
  mark = np.zeros(src + 1, np.int64)
  np.add.at(mark, lo, 1)
  np.add.at(mark, hi, -1)
  return np.flatnonzero(np.cumsum(mark)[:src] > 0)


def element_bits(position: np.ndarray, seed: int) -> np.ndarray:
  """The uint32 bits stored at flat ``position`` (mirror-major) of the model: a hash."""
  x = position.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(seed + 1)
  x ^= x >> np.uint64(15)
  x *= np.uint64(0x85EBCA6B)
  x ^= x >> np.uint64(13)
  return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def write_index_checkpoint(
  path: str, n_params: int, history: int, world: int, seed: int, only=None
) -> tuple[list[int], dict]:
  """An Adam checkpoint of ``world`` ranks written straight in the on-disk format.

  Building ``world`` x ``n_params`` record objects in memory only to save them
  would take minutes and is not what is measured: the index is the one
  ``save_records`` writes (made from rank 0's record, the other archives
  differing only in their rank), and each archive's float32 buffer holds that
  rank's slices of mu and nu in packing order (params by id, mu before nu).
  ``only``: the ranks whose archives are written (all when None); the index
  always describes all of them.
  """
  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.checkpoint import shardfile as _shardfile

  sizes = _workload.param_sizes(history // 2, n_params, seed)
  rec0 = _workload.adam_records(8 * n_params, n_params, 1, seed, as_numpy=True)[0]
  ids = sorted(p.param for p in rec0.placements)
  order = np.argsort(_workload.param_ids(n_params))
  sizes_sorted = np.asarray(sizes, np.int64)[order]
  slots = -(-sizes_sorted // world)
  # Rank 0's record at this world size, with abstract buffers, describes every archive.
  import jax  # pylint: disable=g-import-not-at-top

  shape_of = dict(zip(ids, slots.tolist()))
  count_of = dict(zip(ids, sizes_sorted.tolist()))
  state = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      x
      if np.ndim(x) == 0
      else jax.ShapeDtypeStruct((shape_of["/".join(str(k.key) for k in p[-2:])],), np.float32)
    ),
    rec0.state,
  )
  placements = tuple(
    jr.ParamPlacement(pid, (count_of[pid],), 0, world, np.float32, True) for pid in ids
  )
  builder = _checkpoint.IndexBuilder()
  builder.add(0, jr.ShardRecord(1, placements, state, rec0.roles), pack=False)
  index = builder.index()
  index["archives"] = [[f"archive_{a:05d}", 0, 0] for a in range(world)]
  (group,) = index["groups"]
  group["ranks"] = [[a, a] for a in range(world)]
  total = int(sizes_sorted.sum())
  base = np.concatenate([[0], np.cumsum(sizes_sorted)[:-1]])
  # Packing order: per parameter (by id) its mu slots, then its nu slots. Position
  # q of that order is element j of mirror m of parameter p; at rank r it holds the
  # element at flat position m * total + base[p] + r * slots[p] + j, or padding.
  # Values are a function of that position (``element_bits``): the model is never
  # held whole, so a rank can hold as many bytes as a real one.
  p_of = np.repeat(np.arange(len(ids)), 2 * slots)
  first = np.repeat(np.cumsum(2 * slots) - 2 * slots, 2 * slots)
  within = np.arange(len(p_of)) - first
  m_of = within // slots[p_of]
  j_of = within % slots[p_of]
  origin = m_of * total + base[p_of] + j_of
  os.makedirs(path)
  _checkpoint.dump_index(path, index)
  describes = jr.open_checkpoint(path).index.describes  # what each archive.json records of it
  for r in range(world) if only is None else only:
    local = r * slots[p_of] + j_of
    valid = local < sizes_sorted[p_of]
    data = np.zeros(len(p_of), np.uint32)
    data[valid] = element_bits(origin[valid] + r * slots[p_of][valid], seed)
    data = data.view(np.float32)
    adir = os.path.join(path, f"archive_{r:05d}")
    os.mkdir(adir)
    chunk = _shardfile.chunk_elements(data.size, 4, _checkpoint.DEFAULT_CHUNK_BYTES)
    crcs = _shardfile.write_array(adir, "float32", data, chunk)
    _checkpoint.dump(
      os.path.join(adir, "archive.json"),
      {
        "format": _checkpoint.FORMAT,
        "format_version": _checkpoint.FORMAT_VERSION,
        "checkpoint": index["checkpoint"],
        "archive": f"archive_{r:05d}",
        "describes": describes(r),
        "buffers": {"float32": {"elements": int(data.size), "chunk": chunk, "crc32c": crcs}},
      },
    )
  return sizes, {
    "ids": ids,
    "count": count_of,
    "total": total,
    "base": dict(zip(ids, base.tolist())),
  }


def planning_rows(opts: Options) -> list[dict]:
  """Open a large checkpoint's index and plan one target rank, then restore it."""
  from benchmarks.bench_restore import _checked_read, _raw_read, _timed  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.checkpoint import read_plan as _read_plan  # pylint: disable=g-import-not-at-top

  src, dst = opts.plan_worlds
  rank = dst // 3
  sizes = _workload.param_sizes(opts.plan_size // 2, opts.plan_params, opts.seed)
  # And archive 0: the first of the group, whose archive.json vouches for the
  # skeleton and clock scalars every target rank takes from the index.
  only = sorted({0, *needed_ranks(np.asarray(sizes, np.int64), src, dst, rank).tolist()})
  with tempfile.TemporaryDirectory(prefix="jr-bench-plan-") as tmp:
    path = os.path.join(tmp, "ckpt")
    t0 = time.perf_counter()
    _, truth = write_index_checkpoint(
      path, opts.plan_params, opts.plan_size, src, opts.seed, only=only
    )
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt = jr.open_checkpoint(path)
    plan = _read_plan.read_plan(ckpt, world_size=dst, rank=rank)
    planning = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = jr.restore(path, world_size=dst, rank=rank)
    restore_s = time.perf_counter() - t0
    warm_s, warm_read, target = _timed(
      lambda: jr.restore(path, world_size=dst, rank=rank), opts.repeats
    )
    nbytes = plan.bytes_read
    raw_s, _, _ = _timed(lambda: _raw_read(path, nbytes), opts.repeats)
    checked_s, _, _ = _timed(lambda: _checked_read(path, warm_read), opts.repeats)
    # From the disk: every file dropped from the page cache before each run.
    disk_s, disk_raw_s, evicted = float("inf"), float("inf"), True
    for _ in range(max(1, opts.repeats)):
      evicted &= _disk.drop_cache(path)
      t0 = time.perf_counter()
      jr.restore(path, world_size=dst, rank=rank)
      disk_s = min(disk_s, time.perf_counter() - t0)
      evicted &= _disk.drop_cache(path)
      t0 = time.perf_counter()
      _raw_read(path, nbytes)
      disk_raw_s = min(disk_raw_s, time.perf_counter() - t0)
    # Exact: a parameter's mu on the target rank is its slice of the flat buffer.
    pid = truth["ids"][len(truth["ids"]) // 2]
    g = jr.FlatShard((truth["count"][pid],), rank, dst)
    want = np.zeros(g.slots, np.uint32)
    start = truth["base"][pid] + g.start
    want[: g.owned] = element_bits(np.arange(start, start + g.owned), opts.seed)
    layer, w = pid.split("/")
    got = np.asarray(target.state[0].mu[layer][w])
    exact = got.view(np.uint32).tobytes() == want.tobytes()
    index_mib = (
      sum(
        os.path.getsize(os.path.join(path, name))
        for name in ("jaxreshard.json", "jaxreshard.table")
        if os.path.exists(os.path.join(path, name))
      )
      / 2**20
    )
  return [
    {
      "what": f"plan one target rank from disk, {opts.plan_params} params, {src} -> {dst}",
      "setup_s": round(setup, 1),
      "archives_written": len(only),
      "index_mib": round(index_mib, 2),
      "plan_s": round(planning, 4),
      "archives_read": len(plan.per_archive),
      "mib": round(nbytes / 2**20, 2),
      "mib_read": round(warm_read / 2**20, 1),
      "restore_s": round(restore_s, 4),
      "warm_restore_s": round(warm_s, 4),
      "raw_read_s": round(raw_s, 4),
      "vs_raw_read": round(raw_s / warm_s, 3),
      "checked_read_s": round(checked_s, 4),
      "floor_vs_raw_read": round(raw_s / checked_s, 3),
      "disk_restore_s": round(disk_s, 4) if evicted else None,
      "disk_raw_read_s": round(disk_raw_s, 4) if evicted else None,
      "vs_raw_read_disk": round(disk_raw_s / disk_s, 3) if evicted else None,
      "exact": exact,
    }
  ]


def child_rows(quick: bool, **fields) -> list[dict]:
  """``planning_rows`` in a fresh process (``run_child``) with these plan options."""
  base = Options.smoke() if quick else Options.full()
  fields["plan_worlds"] = tuple(fields["plan_worlds"])
  return planning_rows(dataclasses.replace(base, **fields))


def run(opts: Options) -> Result:
  # A fresh process: in the benchmarks' own process the heap the earlier ones
  # leave behind (hundreds of thousands of records' leaves) made the same plan
  # several times slower.
  fields = {
    k: getattr(opts, k) for k in ("plan_params", "plan_worlds", "plan_size", "seed", "repeats")
  }
  rows = run_child("bench_plan", "child_rows", dict(quick=opts.quick, **fields))
  row = rows[0]
  met = (
    None
    if opts.quick
    else row["plan_s"] <= PLAN_SECONDS and row["vs_raw_read"] >= VS_RAW_READ and row["exact"]
  )
  notes = (
    f"An Adam checkpoint of {opts.plan_params} lognormal-sized parameters"
    f" ({opts.plan_size} history elements) over {opts.plan_worlds[0]} archives, written"
    " straight in the on-disk format (`write_index_checkpoint`). `plan_s`:"
    " `open_checkpoint` (read and check the index) + the read plan of one target rank of"
    f" {opts.plan_worlds[1]}, from the index alone; `archives_read`: archives that plan"
    " reads (only the archives that rank reads or checks are written, `archives_written`:"
    " those its runs overlap, and archive 0, whose archive.json vouches for the skeleton"
    " and clock scalars it takes from the index);"
    " `mib_read`: /proc/self/io rchar delta during the best warm restore (every piece"
    " reads its whole chunks, each checked against its crc32c: a rank's few elements of a"
    " small parameter in an archive cost a chunk);"
    " `restore_s`: the first restore of that rank in the process; `warm_restore_s`: the best"
    " of the warm restores; `raw_read_s`: a plain readinto of the same number of bytes (`mib`,"
    " what the rank copies) from the written archives' files into a fresh buffer, best of as"
    " many runs; `vs_raw_read`: raw_read_s / warm_restore_s; `checked_read_s`: a read of"
    " as many bytes as the warm restore read (`mib_read`) from the same files, a MiB a"
    " call, each MiB's crc32c computed right after it is read with the reader's own C"
    " function, and `floor_vs_raw_read`: raw_read_s / checked_read_s, the most"
    " `vs_raw_read` a restore that reads those chunks and checks them can reach here,"
    " whatever its bookkeeping; `disk_restore_s`,"
    " `disk_raw_read_s`, `vs_raw_read_disk`: the same from the disk, every file dropped from"
    " the page cache before each run (`POSIX_FADV_DONTNEED`), as a restarted host reads a"
    " checkpoint nobody has read since it was written; `exact`: one parameter's bits"
    " against the flat source. Verdict: (c) plan_s <= 50 ms and (d) vs_raw_read >= 0.5."
  )
  return Result(
    NAME, "planning one target rank from a large checkpoint", GOAL, met, tuple(rows), notes
  )

"""(3) restore of target ranks from disk vs orbax (plain arrays, and global array 8 -> 6 devices).

Runs in a child process with ``src_world`` simulated CPU devices, which orbax
needs to save a global array sharded over 8 devices and restore it onto 6.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from benchmarks._measure import Result, run_child
from benchmarks._options import Options

NAME = "restore"
GOAL = (
  "(g) one target rank at 8 -> 6 (200 params, page cache) >= 0.8x a raw read() of its bytes,"
  " and >= 3x orbax's restore-with-new-sharding per rank of the same state"
)
VS_RAW_READ = 0.8
VS_ORBAX = 3


def _timed(fn, repeats):
  """(best seconds, bytes read during the best run, last result)."""
  from benchmarks._measure import block, rchar

  best, read, out = float("inf"), 0, None
  for _ in range(max(1, repeats)):
    out = None
    r0, t0 = rchar(), time.perf_counter()
    out = block(fn())
    t, r = time.perf_counter() - t0, rchar() - r0
    if t < best:
      best, read = t, r
  return best, read, out


def _buffer_files(path: str):
  """The checkpoint's float32 buffer files, archive after archive (by name)."""
  for name in sorted(os.listdir(path)):
    f = os.path.join(path, name, "float32", "c", "0")
    if os.path.exists(f):
      yield f


def _raw_read(path: str, nbytes: int) -> np.ndarray:
  """``nbytes`` read with plain ``readinto`` from the checkpoint's buffer files, in order."""
  out = np.empty(nbytes, np.uint8)
  view, pos = memoryview(out), 0
  for f in _buffer_files(path):
    if pos >= nbytes:
      break
    with open(f, "rb", buffering=0) as fh:
      pos += fh.readinto(view[pos:])
  return out


def _crc32c_extend():
  """The C ``crc32c_extend`` the reader checks chunks with, as a ctypes function
  ``(crc, address, length) -> crc``; None where the package runs without it."""
  import ctypes

  from jaxreshard._src.checkpoint import chunkcrc

  address = chunkcrc.extend_address()
  if address is None:
    return None
  kind = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
  return kind(address)


def _checked_read(path: str, nbytes: int, piece: int = 1 << 20) -> np.ndarray:
  """``_raw_read`` of ``nbytes``, ``piece`` bytes a call, each piece's crc32c computed
  right after it is read (while in cache), with the reader's own C crc32c (a copy of
  each piece through google_crc32c where it is missing): the least a read that
  checks every byte it reads costs, with none of a restore's bookkeeping."""
  import google_crc32c

  extend = _crc32c_extend()
  out = np.empty(nbytes, np.uint8)
  view, pos = memoryview(out), 0
  crc = 0
  for f in _buffer_files(path):
    if pos >= nbytes:
      break
    with open(f, "rb", buffering=0) as fh:
      while pos < nbytes:
        got = fh.readinto(view[pos : min(pos + piece, nbytes)])
        if not got:
          break
        if extend is not None:
          crc = extend(crc, out.ctypes.data + pos, got)
        else:
          crc = google_crc32c.extend(crc, bytes(view[pos : pos + got]))
        pos += got
  return out


def child(
  history: int, n_params: int, src: int, dst: int, seed: int, repeats: int, workdir: str
) -> list[dict]:
  """Writes the three checkpoints, times every restore; runs with ``src`` devices."""
  import jax
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxreshard as jr
  from benchmarks import _disk, _workload
  from benchmarks._measure import block

  assert len(jax.devices()) >= src, jax.devices()
  jr_path = os.path.join(workdir, "jr")
  records = _disk.write_jaxreshard(jr_path, history, n_params, src, seed)
  # The same flat buffers as global arrays: each (src * slots,) buffer sharded over src devices.
  mesh_src = Mesh(np.array(jax.devices()[:src]), ("x",))
  mesh_dst = Mesh(np.array(jax.devices()[:dst]), ("x",))
  plain = _disk.history_tree(records)
  glob = {
    name: {
      pid: jax.device_put(
        np.concatenate([plain[r][name][pid] for r in sorted(plain)]),
        NamedSharding(mesh_src, P("x")),
      )
      for pid in plain["r00000"][name]
    }
    for name in ("mu", "nu")
  }
  del records, plain
  glob_path = os.path.abspath(os.path.join(workdir, "global"))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(glob_path, glob)
  counts = {pid: int(x.shape[0]) for pid, x in glob["mu"].items()}
  del glob
  sizes = dict(
    zip(
      [f"layer_{i:0{len(str(n_params - 1))}d}.w" for i in range(n_params)],
      _workload.param_sizes(history // 2, n_params, seed),
    )
  )
  restore_args = {
    name: {
      pid: ocp.ArrayRestoreArgs(
        sharding=NamedSharding(mesh_dst, P("x")),
        global_shape=(dst * jr.FlatShard((sizes[pid],), 0, dst).slots,),
        strict=False,
      )
      for pid in counts
    }
    for name in ("mu", "nu")
  }
  ckptr = ocp.PyTreeCheckpointer()
  restore_global = lambda: ckptr.restore(
    glob_path, args=ocp.args.PyTreeRestore(restore_args=restore_args)
  )

  rows = []
  rank = 0
  t0 = time.perf_counter()
  target = block(jr.restore(jr_path, world_size=dst, rank=rank))
  cold = time.perf_counter() - t0
  one_s, one_read, target = _timed(lambda: jr.restore(jr_path, world_size=dst, rank=rank), repeats)
  one_bytes = _workload.history_bytes([target])
  raw_s, raw_read, _ = _timed(lambda: _raw_read(jr_path, one_bytes), repeats)
  checked_s, checked_read, _ = _timed(lambda: _checked_read(jr_path, one_read), repeats)
  plain_path = os.path.join(workdir, "plain")
  _disk.write_orbax_plain(plain_path, _disk.history_tree([target]))
  plain_s, plain_read, _ = _timed(lambda: _disk.restore_orbax_plain(plain_path), repeats)
  # From the disk: the checkpoint's files dropped from the page cache before each
  # run (a restarted host reads a checkpoint nobody has read since it was written).
  disk_s, disk_raw_s, evicted = float("inf"), float("inf"), True
  for _ in range(max(1, repeats)):
    evicted &= _disk.drop_cache(jr_path)
    t0 = time.perf_counter()
    block(jr.restore(jr_path, world_size=dst, rank=rank))
    disk_s = min(disk_s, time.perf_counter() - t0)
    evicted &= _disk.drop_cache(jr_path)
    t0 = time.perf_counter()
    _raw_read(jr_path, one_bytes)
    disk_raw_s = min(disk_raw_s, time.perf_counter() - t0)
  all_s, all_read, targets = _timed(
    lambda: [jr.restore(jr_path, world_size=dst, rank=r) for r in range(dst)], repeats
  )
  all_bytes = _workload.history_bytes(targets)
  _timed(restore_global, 1)
  glob_s, glob_read, restored = _timed(restore_global, repeats)
  # Bit-exactness of the comparison: orbax's device-r shard is jaxreshard's rank r.
  pid = sorted(counts)[0]
  layer, w = pid.split(".")
  shard = np.asarray(restored["mu"][pid].addressable_shards[rank].data)
  exact = bool(
    np.array_equal(shard.view(np.uint32), np.asarray(target.state[0].mu[layer][w]).view(np.uint32))
  )
  del restored, targets
  rows.append(
    {
      "what": f"jaxreshard restore, rank {rank} of {dst}",
      "mib": one_bytes / 2**20,
      "seconds": one_s,
      "cold_seconds": cold,
      "disk_seconds": disk_s if evicted else None,
      "mib_read": one_read / 2**20,
    }
  )
  rows.append(
    {
      "what": "raw read() of the same number of bytes (fresh buffer)",
      "mib": one_bytes / 2**20,
      "seconds": raw_s,
      "cold_seconds": None,
      "disk_seconds": disk_raw_s if evicted else None,
      "mib_read": raw_read / 2**20,
    }
  )
  rows.append(
    {
      "what": "read() and crc32c of as many bytes as the restore reads, 1 MiB a call (floor)",
      "mib": one_bytes / 2**20,
      "seconds": checked_s,
      "cold_seconds": None,
      "disk_seconds": None,
      "mib_read": checked_read / 2**20,
    }
  )
  rows.append(
    {
      "what": "orbax restore of that rank's bytes as plain numpy arrays",
      "mib": one_bytes / 2**20,
      "seconds": plain_s,
      "cold_seconds": None,
      "disk_seconds": None,
      "mib_read": plain_read / 2**20,
    }
  )
  rows.append(
    {
      "what": f"jaxreshard restore, all {dst} ranks (one process)",
      "mib": all_bytes / 2**20,
      "seconds": all_s,
      "cold_seconds": None,
      "disk_seconds": None,
      "mib_read": all_read / 2**20,
    }
  )
  rows.append(
    {
      "what": f"orbax global arrays saved on {src} devices, restored onto {dst}",
      "mib": all_bytes / 2**20,
      "seconds": glob_s,
      "cold_seconds": None,
      "disk_seconds": None,
      "mib_read": glob_read / 2**20,
      "bit_exact_vs_jaxreshard": exact,
    }
  )
  for r in rows:
    r["gb_per_s"] = r["mib"] * 2**20 / r["seconds"] / 1e9
    for k, v in list(r.items()):
      if isinstance(v, float):
        r[k] = round(v, 4)
  return rows


def run(opts: Options) -> Result:
  with tempfile.TemporaryDirectory(prefix="jr-bench-restore-") as tmp:
    rows = run_child(
      "bench_restore",
      "child",
      dict(
        history=opts.disk_size,
        n_params=opts.n_params,
        src=opts.src_world,
        dst=opts.dst_world,
        seed=opts.seed,
        repeats=opts.repeats,
        workdir=tmp,
      ),
      devices=opts.src_world,
    )
  jr_one, raw, _, _, jr_all, orbax_global = rows
  per_rank_orbax = orbax_global["seconds"] / opts.dst_world
  for r in rows:
    r["vs_raw_read_disk"] = (
      round(raw["disk_seconds"] * r["mib"] / raw["mib"] / r["disk_seconds"], 3)
      if r.get("disk_seconds") and raw.get("disk_seconds")
      else None
    )
    r["vs_orbax_global"] = round(
      orbax_global["seconds"] * r["mib"] / orbax_global["mib"] / r["seconds"], 3
    )
    r["vs_raw_read"] = round(raw["seconds"] * r["mib"] / raw["mib"] / r["seconds"], 3)
  met = (
    None
    if opts.quick
    else (jr_one["vs_raw_read"] >= VS_RAW_READ and jr_one["vs_orbax_global"] >= VS_ORBAX)
  )
  notes = (
    f"Adam, {opts.n_params} parameters, {opts.disk_size} history elements saved over"
    f" {opts.src_world} ranks, restored for {opts.dst_world}; {opts.src_world} simulated CPU"
    " devices in a child process. Files are read from the page cache (just written; no"
    " root to drop caches), so this measures the read path, not the disk."
    " `seconds`: best of warm runs; `cold_seconds`: the first restore in the process."
    " `mib_read`: /proc/self/io rchar delta during the best run (whole chunks are read, each"
    " checked against its crc32c, so a rank reads more than it copies)."
    " `vs_orbax_global`: this row's bytes per second over orbax's global restore"
    " (>1: faster than orbax). Orbax restores every target rank at once onto"
    f" {opts.dst_world} devices; per rank that is {per_rank_orbax:.3f} s."
    " `disk_seconds`: the best of as many runs with the checkpoint's files dropped from the"
    " page cache before each (`POSIX_FADV_DONTNEED`), so read from the disk, as a restarted"
    " host reads them; `vs_raw_read_disk`: the same ratio as `vs_raw_read` from the disk."
    " `vs_raw_read`: this row's bytes per second over a plain readinto of the same number"
    " of bytes from the checkpoint's files into a fresh buffer. The floor row reads as many"
    " bytes as the restore read (`mib_read` of its row) from the same files, a MiB a call,"
    " and computes each MiB's crc32c with the reader's own C function right after reading"
    " it: no restore that reads whole chunks and checks every byte can beat its"
    " `vs_raw_read` on this machine. Verdict: the one-rank"
    " restore against the raw read and against orbax per rank."
  )
  return Result(NAME, "restore from disk vs orbax", GOAL, met, tuple(rows), notes)

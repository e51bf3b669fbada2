"""Page-cache read / write throughput: tensorstore zarr3 sharding_indexed+crc32c vs plain file I/O.

The measurement behind jaxreshard reading and writing its shard files itself
(summary: benchmarks/RESULTS-tensorstore-options.md).

Usage: python benchmarks/tensorstore_options.py [--quick]
Data (about 3 GB for the full run; delete it afterwards) lives under
/tmp/tsmeasure/data; results go to /tmp/tsmeasure/results.json and RESULTS_tables.md.
"""

import gc
import importlib.metadata as md
import json
import os
import platform
import shutil
import struct
import sys
import time

import google_crc32c
import numpy as np
import tensorstore as ts

QUICK = "--quick" in sys.argv
BASE = "/tmp/tsmeasure"
DATA = f"{BASE}/data"
N = (4 if QUICK else 64) * 2**20  # float32 elements (64M -> 256 MB)
ELEM = 4
CS = {"64KiB": 16384, "1MiB": 262144, "4MiB": 1048576, "16MiB": 4194304}
if QUICK:
  CS = {"64KiB": 16384, "1MiB": 262144}
SUB = (N // 6 * 2, N // 6 * 3)
REPS = 3
IOV_MAX = os.sysconf("SC_IOV_MAX")


def rounded_up(n, c):
  return -(-n // c) * c


def metadata(C):
  return {
    "shape": [N],
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [rounded_up(N, C)]}},
    "data_type": "float32",
    "codecs": [
      {
        "name": "sharding_indexed",
        "configuration": {
          "chunk_shape": [C],
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
          "index_codecs": [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c"},
          ],
          "index_location": "end",
        },
      }
    ],
  }


def spec(path, C=None):
  s = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
  if C is not None:
    s["metadata"] = metadata(C)
  return s


def ctx_spec(kind):
  if kind == "default":
    return {}
  if kind.startswith("lim"):
    k = int(kind[3:])
    return {"data_copy_concurrency": {"limit": k}, "file_io_concurrency": {"limit": k}}
  if kind == "memmap":
    return {"file_io_mode": {"mode": "memmap"}}
  if kind == "nosync":
    return {"file_io_sync": False}
  raise ValueError(kind)


def bench(items, reps=REPS, warm=True):
  """items: list of (name, fn, nbytes). Interleaved ('side by side'): every round runs every item once.
  Returns {name: (best_seconds, nbytes, all_times)}."""
  times = {name: [] for name, _, _ in items}
  if warm:
    for _name, fn, _nb in items:
      r = fn()
      del r
  for rep in range(reps):
    for name, fn, _nb in items:
      gc.collect()
      t0 = time.perf_counter()
      r = fn()
      dt = time.perf_counter() - t0
      del r  # free outside the timed region (same for every method)
      times[name].append(dt)
    print(f"  round {rep + 1}/{reps} done", flush=True)
  return {name: (min(times[name]), nb, times[name]) for name, _, nb in items}


def main():
  t_start = time.time()
  shutil.rmtree(DATA, ignore_errors=True)
  os.makedirs(DATA)
  rng = np.random.default_rng(0)
  arr = rng.standard_normal(N, dtype=np.float32)
  arr_u32 = arr.view(np.uint32)
  out = {
    "env": {
      "python": sys.version.split()[0],
      "tensorstore": md.version("tensorstore"),
      "jax": md.version("jax"),
      "numpy": np.__version__,
      "google-crc32c": md.version("google-crc32c"),
      "google_crc32c.implementation": google_crc32c.implementation,
      "orbax-checkpoint": md.version("orbax-checkpoint"),
      "kernel": platform.release(),
      "nproc": os.cpu_count(),
      "IOV_MAX": IOV_MAX,
      "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
      "N": N,
      "bytes": N * ELEM,
      "sub": list(SUB),
    }
  }
  print(json.dumps(out["env"]), flush=True)

  # ---------------- 1. write with tensorstore (read-test files) ----------------
  rd = {}
  for cn, C in CS.items():
    p = f"{DATA}/rd_{cn}"
    s = ts.open(spec(p, C), create=True, delete_existing=True).result()
    s.write(arr).result()
    rd[cn] = p
  zj = {cn: open(f"{rd[cn]}/zarr.json").read() for cn in CS}
  out["ts_zarr_json"] = zj
  print("zarr.json written by tensorstore (64KiB):\n" + zj[next(iter(CS))], flush=True)
  for cn, C in CS.items():
    fs = os.path.getsize(f"{rd[cn]}/c/0")
    nc = rounded_up(N, C) // C
    assert fs == N * ELEM + nc * 4 + nc * 16 + 4, (cn, fs)

  # ---------------- 2./3. reads ----------------
  a, b = SUB
  n_whole, n_sub = N * ELEM, (b - a) * ELEM
  maxfs = max(os.path.getsize(f"{rd[cn]}/c/0") for cn in CS)
  touched = np.ones(maxfs, np.uint8)  # pre-faulted buffer
  touched_f32 = np.ones(N, np.float32)
  base_file = f"{rd[next(reversed(CS))]}/c/0"

  items = []
  stores = {}
  for cn, _C in CS.items():
    for kind in ["default", "lim1", "lim2", "lim4", "memmap"]:
      st = ts.open(spec(rd[cn]), context=ts.Context(ctx_spec(kind)), read=True).result()
      stores[(cn, kind)] = st
      full = st.read().result()
      assert np.array_equal(full.view(np.uint32), arr_u32), (cn, kind)
      del full
      sp = spec(rd[cn])
      for rname, nb in [("whole", n_whole), ("sub", n_sub)]:
        if rname == "whole":
          items.append(
            (f"ts {rname} C={cn} ctx={kind} reuse", lambda st=st: st.read().result(), nb)
          )
          items.append(
            (
              f"ts {rname} C={cn} ctx={kind} open-per-read",
              lambda sp=sp, kind=kind: (
                ts.open(sp, context=ts.Context(ctx_spec(kind)), read=True).result().read().result()
              ),
              nb,
            )
          )
        else:
          items.append(
            (f"ts {rname} C={cn} ctx={kind} reuse", lambda st=st: st[a:b].read().result(), nb)
          )
          items.append(
            (
              f"ts {rname} C={cn} ctx={kind} open-per-read",
              lambda sp=sp, kind=kind: (
                ts.open(sp, context=ts.Context(ctx_spec(kind)), read=True)
                .result()[a:b]
                .read()
                .result()
              ),
              nb,
            )
          )

  def rd_fresh(off, n):
    buf = np.empty(n, np.uint8)
    with open(base_file, "rb", buffering=0) as f:
      f.seek(off)
      assert f.readinto(buf) == n
    return buf

  def rd_touched(off, n):
    with open(base_file, "rb", buffering=0) as f:
      f.seek(off)
      assert f.readinto(touched[:n]) == n

  def rd_preadv(off, n):
    fd = os.open(base_file, os.O_RDONLY)
    try:
      assert os.preadv(fd, [touched[:n]], off) == n
    finally:
      os.close(fd)

  def copyto(n):
    np.copyto(touched_f32[: n // ELEM], arr[: n // ELEM])

  for rname, off, nb in [("whole", 0, n_whole), ("sub", a * ELEM, n_sub)]:
    items.append(
      (f"(a) readinto fresh np.empty {rname}", lambda off=off, nb=nb: rd_fresh(off, nb), nb)
    )
    items.append((f"(b) readinto touched {rname}", lambda off=off, nb=nb: rd_touched(off, nb), nb))
    items.append((f"(c) os.preadv touched {rname}", lambda off=off, nb=nb: rd_preadv(off, nb), nb))
    items.append((f"np.copyto touched {rname}", lambda nb=nb: copyto(nb), nb))

  def read_index(fd, path, nc):
    fs = os.path.getsize(path)
    ib = os.pread(fd, nc * 16 + 4, fs - (nc * 16 + 4))
    ia = np.frombuffer(ib, np.uint8)
    if google_crc32c.value(ia[:-4]) != struct.unpack("<I", ib[-4:])[0]:
      raise OSError("index crc mismatch")
    return np.frombuffer(ib, "<u8", count=nc * 2).reshape(nc, 2)

  def d_readinto_crc(path, C, lo, hi):
    """(d) readinto touched buffer the covering chunks (incl. their crc) + crc32c per chunk; no reassembly."""
    nc = rounded_up(N, C) // C
    i0, i1 = lo // C, (hi - 1) // C + 1
    with open(path, "rb", buffering=0) as f:
      idx = read_index(f.fileno(), path, nc)
      start = int(idx[i0, 0])
      end = int(idx[i1 - 1, 0] + idx[i1 - 1, 1])
      f.seek(start)
      buf = touched[: end - start]
      assert f.readinto(buf) == end - start
      for i in range(i0, i1):
        o, nb = int(idx[i, 0]) - start, int(idx[i, 1])
        if google_crc32c.value(buf[o : o + nb - 4]) != int.from_bytes(
          buf[o + nb - 4 : o + nb].tobytes(), "little"
        ):
          raise OSError(f"chunk {i} crc mismatch")

  def e_preadv_scatter(path, C):
    """(e) whole array: preadv scatter chunk bytes straight into a fresh float32 array, crcs into a side
    array, then verify; returns the assembled array (apples-to-apples with ts read)."""
    nc = N // C
    cb = C * ELEM
    dest = np.empty(N, np.float32)
    d8 = dest.view(np.uint8)
    crcs = np.empty(nc, "<u4")
    c8 = crcs.view(np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
      idx = read_index(fd, path, nc)
      assert idx[0, 0] == 0 and np.all(np.diff(idx[:, 0].astype(np.int64)) == cb + 4)
      iov = []
      for i in range(nc):
        iov.append(d8[i * cb : (i + 1) * cb])
        iov.append(c8[i * 4 : (i + 1) * 4])
      off = 0
      step = IOV_MAX - (IOV_MAX % 2)
      for k in range(0, len(iov), step):
        part = iov[k : k + step]
        want = sum(x.nbytes for x in part)
        got = os.preadv(fd, part, off)
        assert got == want
        off += got
    finally:
      os.close(fd)
    for i in range(nc):
      if google_crc32c.value(d8[i * cb : (i + 1) * cb]) != int(crcs[i]):
        raise OSError(f"chunk {i} crc mismatch")
    return dest

  for cn, C in CS.items():
    p = f"{rd[cn]}/c/0"
    chk = e_preadv_scatter(p, C)
    assert np.array_equal(chk.view(np.uint32), arr_u32)
    del chk
    items.append(
      (
        f"(d) readinto touched + crc32c/chunk whole C={cn}",
        lambda p=p, C=C: d_readinto_crc(p, C, 0, N),
        n_whole,
      )
    )
    items.append(
      (
        f"(d) readinto touched + crc32c/chunk sub C={cn}",
        lambda p=p, C=C: d_readinto_crc(p, C, a, b),
        n_sub,
      )
    )
    items.append(
      (
        f"(e) preadv scatter into fresh array + crc32c whole C={cn}",
        lambda p=p, C=C: e_preadv_scatter(p, C),
        n_whole,
      )
    )

  print(f"read bench: {len(items)} items x ({REPS}+1 warm)", flush=True)
  out["read"] = bench(items)

  # ---------------- 4. writes ----------------

  def self_write(dirpath, C, mode, fsync):
    nc = rounded_up(N, C) // C
    assert nc * C == N
    cb = C * ELEM
    a8 = arr.view(np.uint8)
    pieces = []
    for i in range(nc):
      ch = a8[i * cb : (i + 1) * cb]
      pieces.append(ch)
      pieces.append(struct.pack("<I", google_crc32c.value(ch)))
    idx = np.empty((nc, 2), "<u8")
    idx[:, 0] = np.arange(nc, dtype=np.uint64) * (cb + 4)
    idx[:, 1] = cb + 4
    ib = idx.tobytes()
    pieces.append(ib + struct.pack("<I", google_crc32c.value(ib)))
    final = f"{dirpath}/c/0"
    tmp = final + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      if mode == "writev":
        k = 0
        while k < len(pieces):
          part = pieces[k : k + IOV_MAX]
          want = sum(memoryview(x).nbytes for x in part)
          got = os.writev(fd, part)
          if got != want:  # partial write: finish this batch piecewise
            for x in part:
              mv = memoryview(x).cast("B")
              if got >= mv.nbytes:
                got -= mv.nbytes
                continue
              mv = mv[got:]
              got = 0
              while mv.nbytes:
                mv = mv[os.write(fd, mv) :]
          k += IOV_MAX
      else:  # plain buffered file.write
        with open(fd, "wb", closefd=False) as f:
          for x in pieces:
            f.write(x)
      if fsync:
        os.fsync(fd)
    finally:
      os.close(fd)
    os.replace(tmp, final)

  witems = []
  wstores = {}
  for cn, C in CS.items():
    pts = f"{DATA}/wts_{cn}"
    for kind in ["default", "nosync"]:
      st = ts.open(
        spec(pts, C), context=ts.Context(ctx_spec(kind)), create=True, delete_existing=True
      ).result()
      st.write(arr).result()
      wstores[(cn, kind)] = st
      witems.append(
        (
          f"ts write C={cn} ctx={kind} (file_io_sync={'true' if kind == 'default' else 'false'}) reuse",
          lambda st=st: st.write(arr).result(),
          n_whole,
        )
      )
    witems.append(
      (
        f"ts write C={cn} ctx=nosync open(create,delete_existing)+write",
        lambda pts=pts, C=C: (
          ts.open(
            spec(pts, C), context=ts.Context(ctx_spec("nosync")), create=True, delete_existing=True
          )
          .result()
          .write(arr)
          .result()
        ),
        n_whole,
      )
    )
    ps = f"{DATA}/self_{cn}"
    os.makedirs(f"{ps}/c", exist_ok=True)
    # hand-written zarr.json (not copied from tensorstore)
    zmeta = {
      "zarr_format": 3,
      "node_type": "array",
      **metadata(C),
      "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
      "fill_value": 0.0,
    }
    with open(f"{ps}/zarr.json", "w") as f:
      json.dump(zmeta, f)
    for mode in ["writev", "file.write"]:
      for fsync in [False, True]:
        witems.append(
          (
            f"self {mode} chunk+crc32c,index{' +fsync' if fsync else ''} C={cn}",
            lambda ps=ps, C=C, mode=mode, fsync=fsync: self_write(ps, C, mode, fsync),
            n_whole,
          )
        )
  print(f"write bench: {len(witems)} items x {REPS}", flush=True)
  out["write"] = bench(witems, warm=False)

  # ---------------- verification of self-written files ----------------
  verify = {}
  for cn, C in CS.items():
    ps = f"{DATA}/self_{cn}"
    for mode in ["writev", "file.write"]:
      self_write(ps, C, mode, False)
      st = ts.open(spec(ps), context=ts.Context(), read=True).result()
      got = st.read().result()
      exact = bool(
        got.dtype == np.float32
        and got.shape == (N,)
        and np.array_equal(got.view(np.uint32), arr_u32)
      )
      sub_exact = bool(np.array_equal(st[a:b].read().result().view(np.uint32), arr_u32[a:b]))
      with open(f"{ps}/c/0", "rb") as f1, open(f"{DATA}/wts_{cn}/c/0", "rb") as f2:
        same_bytes = f1.read() == f2.read()
      verify[f"{cn} {mode}"] = {
        "ts_read_whole_bit_exact": exact,
        "ts_read_sub_bit_exact": sub_exact,
        "shard_bytes_identical_to_ts_written": same_bytes,
      }
    # negative control: corrupt one byte of a chunk -> tensorstore must fail
    p = f"{ps}/c/0"
    with open(p, "r+b") as f:
      f.seek(12345)
      byte = f.read(1)
      f.seek(12345)
      f.write(bytes([byte[0] ^ 0xFF]))
    try:
      ts.open(spec(ps), context=ts.Context(), read=True).result().read().result()
      verify[f"{cn} corrupted-byte read"] = "NO ERROR (bad)"
    except Exception as e:  # noqa: BLE001
      verify[f"{cn} corrupted-byte read"] = f"error raised: {str(e)[:120]}"
  out["verify"] = verify
  print(json.dumps(verify, indent=1), flush=True)
  out["elapsed_s"] = time.time() - t_start

  with open(f"{BASE}/results{'_quick' if QUICK else ''}.json", "w") as f:
    json.dump(out, f, indent=1)

  # ---------------- tables ----------------
  def gbps(nb, t):
    return nb / 1e9 / t

  lines = []
  R = out["read"]
  for rname in ["whole", "sub"]:
    ta, nba, _ = R[f"(a) readinto fresh np.empty {rname}"]
    tb, nbb, _ = R[f"(b) readinto touched {rname}"]
    ga, gb = gbps(nba, ta), gbps(nbb, tb)
    lines.append(
      f"\n### Read, {rname} ({'256 MB' if rname == 'whole' else f'{n_sub / 1e6:.1f} MB, elements [{a},{b})'})\n"
    )
    lines.append(
      "| method | GB/s | ratio to (a) readinto fresh | ratio to (b) readinto touched | best s |"
    )
    lines.append("|---|---:|---:|---:|---:|")
    for name, (t, nb, _) in R.items():
      if f" {rname}" not in name:
        continue
      g = gbps(nb, t)
      lines.append(f"| {name} | {g:.2f} | {g / ga:.2f} | {g / gb:.2f} | {t:.4f} |")
  W = out["write"]
  lines.append(
    "\n### Write, whole 256 MB array (page cache; +fsync rows include flushing to disk)\n"
  )
  lines.append("| method | GB/s | best s |")
  lines.append("|---|---:|---:|")
  for name, (t, nb, _) in W.items():
    lines.append(f"| {name} | {gbps(nb, t):.2f} | {t:.4f} |")
  tables = "\n".join(lines)
  with open(f"{BASE}/RESULTS_tables{'_quick' if QUICK else ''}.md", "w") as f:
    f.write(tables + "\n")
  print(tables)
  print(f"elapsed {out['elapsed_s']:.1f}s")


if __name__ == "__main__":
  main()

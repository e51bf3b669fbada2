"""(4) ``jaxreshard reshard`` of a whole checkpoint vs an orbax load + save of the same data.

Both run as fresh processes (interpreter start and imports included on both
sides). A third figure runs the CLI twice more with JAX's persistent
compilation cache pointed at an empty directory: the first fills it, the
second (timed) shows what a restart costs when the kernels are not recompiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from benchmarks import _disk
from benchmarks._measure import Result
from benchmarks._options import Options

NAME = "cli"
GOAL = "CLI reshard 8 -> 6 in a fresh process at most 0.7x an orbax load + save of the same data"

_ORBAX_COPY = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from benchmarks import _disk
_disk.write_orbax_plain(sys.argv[2], _disk.restore_orbax_plain(sys.argv[1]))
"""


def _env(cache: str = "") -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  if cache:
    env.update(
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  return env


def _time(cmd: list[str], env: dict) -> float:
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  took = time.perf_counter() - t0
  if proc.returncode != 0:
    raise RuntimeError(f"{cmd} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
  return took


def _cli(src: str, out: str, world: int) -> list[str]:
  return [sys.executable, "-m", "jaxreshard", "reshard", src, out, "--world-size", str(world)]


def _scale(opts: Options, tmp: str) -> dict:
  """Time per byte of the CLI's conversion at each of ``opts.cli_scale_worlds``."""
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  out, cli_ns, copy_ns = {}, [], []
  nbytes = 4 * opts.cli_scale_size
  for src_world, dst_world in opts.cli_scale_worlds:
    src = os.path.join(tmp, f"scale-{src_world}")
    _disk.write_jaxreshard(src, opts.cli_scale_size, opts.scale_params, src_world, opts.seed)
    best = None
    for i in range(max(2, opts.repeats)):  # the first also compiles; the best is kept
      dst = os.path.join(tmp, f"scale-{src_world}-{i}")
      t0 = time.perf_counter()
      result = CliRunner().invoke(app, ["reshard", src, dst, "--world-size", str(dst_world)])
      took = time.perf_counter() - t0
      if result.exit_code != 0:
        raise RuntimeError(f"reshard {src_world} -> {dst_world} failed:\n{result.output[-3000:]}")
      best = took if best is None else min(best, took)
      _disk.rmtree(dst)
    copy = float("inf")
    for i in range(max(2, opts.repeats)):
      dst = os.path.join(tmp, f"copy-{src_world}-{i}")
      t0 = time.perf_counter()
      _disk.durable_copy(src, dst)
      copy = min(copy, time.perf_counter() - t0)
      _disk.rmtree(dst)
    _disk.rmtree(src)
    cli_ns.append(1e9 * best / nbytes)
    copy_ns.append(1e9 * copy / nbytes)
    out[f"ns_per_byte_{src_world}_{dst_world}"] = round(cli_ns[-1], 2)
    out[f"copy_ns_per_byte_{src_world}"] = round(copy_ns[-1], 2)
    out[f"cli_over_copy_{src_world}_{dst_world}"] = round(best / copy, 2)
  out["cli_scale_vs_first"] = round(cli_ns[-1] / cli_ns[0], 2)
  out["copy_scale_vs_first"] = round(copy_ns[-1] / copy_ns[0], 2)
  return out


def run(opts: Options) -> Result:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory(prefix="jr-bench-cli-") as tmp:
    src = os.path.join(tmp, "src")
    records = _disk.write_jaxreshard(src, opts.disk_size, opts.n_params, opts.src_world, opts.seed)
    plain = os.path.join(tmp, "plain")
    _disk.write_orbax_plain(plain, _disk.history_tree(records))
    del records
    nbytes = _disk.dir_bytes(src)
    import_s = _time([sys.executable, "-c", "import jaxreshard, orbax.checkpoint"], _env())
    orbax = min(
      _time(
        [sys.executable, "-c", _ORBAX_COPY.format(root=root), plain, os.path.join(tmp, f"copy{i}")],
        _env(),
      )
      for i in range(opts.repeats)
    )
    # The first CLI run starts from an empty persistent cache: it compiles everything,
    # exactly like a run without the cache, and fills it for the second.
    cache = os.path.join(tmp, "jax-cache")
    cli = _time(_cli(src, os.path.join(tmp, "out"), opts.dst_world), _env(cache))
    cached = _time(_cli(src, os.path.join(tmp, "cached"), opts.dst_world), _env(cache))
    scale = _scale(opts, tmp)
  row = {
    "checkpoint_mib": round(nbytes / 2**20, 1),
    "source_ranks": opts.src_world,
    "target_ranks": opts.dst_world,
    "cli_s": round(cli, 3),
    "orbax_load_save_s": round(orbax, 3),
    "cli_over_orbax": round(cli / orbax, 2),
    "cli_with_compile_cache_s": round(cached, 3),
    "cached_over_orbax": round(cached / orbax, 2),
    "python_import_s": round(import_s, 3),
    **scale,
  }
  met = None if opts.quick else row["cli_over_orbax"] <= 0.7
  notes = (
    f"Adam, {opts.n_params} parameters, {opts.disk_size} history elements over"
    f" {opts.src_world} ranks, resharded to {opts.dst_world} by `python -m jaxreshard reshard`"
    " (every target rank, written as a new checkpoint) vs a python process that restores"
    " the same history buffers (a plain orbax checkpoint) as numpy arrays and saves them"
    " again with orbax (best of"
    f" {opts.repeats} fresh processes); page cache warm. `cli_s`: one fresh CLI process"
    " (compiles every kernel; JAX_COMPILATION_CACHE_DIR set but empty);"
    " `cli_with_compile_cache_s`: a second CLI process, that cache now filled;"
    " `python_import_s`: starting python and importing jaxreshard + orbax."
    f" `ns_per_byte_S_M`: the same `reshard` command run in this process (imports and"
    f" compiles done; best of {max(2, opts.repeats)}), converting"
    f" {opts.scale_params} Adam parameters of {opts.cli_scale_size} history elements in all"
    " from S to M ranks, per history byte; `cli_scale_vs_first`: the last of those over"
    " the first (the same bytes over more ranks). `copy_ns_per_byte_S`: a durable copy of"
    " the S-rank source checkpoint's files (`_disk.durable_copy`: each file read, written"
    " anew and fsynced, every directory fsynced; best of as many), per history byte, the"
    " floor of a command that reads a checkpoint and writes one as large, in as many"
    " files; `cli_over_copy_S_M`: the conversion over that copy; `copy_scale_vs_first`:"
    " how the copy itself grows with the ranks (files per archive, not bytes)."
  )
  return Result(NAME, "CLI reshard vs orbax load + save", GOAL, met, (row,), notes)

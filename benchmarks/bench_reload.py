"""Pod-scale bookkeeping of whole checkpoints: load, save again, merge one-rank parts."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import optax
from typer.testing import CliRunner

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result, best_of
from benchmarks._options import Options
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.cli.commands import app

NAME = "reload"
GOAL = (
  "no goal of its own: the bookkeeping of a whole checkpoint (load_records, a save of what"
  " it returned, a merge of one-rank parts) beside the save of the records shard_state"
  " makes and a plain read of the same files"
)


def _records(n_params: int, history: int, world: int, seed: int) -> list:
  """Adam records as ``shard_state`` makes them (packed, one buffer per rank and dtype)."""
  sizes = _workload.param_sizes(history // 2, n_params, seed)
  ids = _workload.param_ids(n_params)
  params = {pid: np.zeros(n, np.float32) for pid, n in zip(ids, sizes)}
  opt = optax.adam(1e-3)
  rng = np.random.default_rng(seed + 1)
  state = opt.init(params)
  state = (
    state[0]._replace(
      mu={k: rng.random(v.size, np.float32) for k, v in params.items()},
      nu={k: rng.random(v.size, np.float32) for k, v in params.items()},
    ),
    *state[1:],
  )
  return jr.shard_state(opt, params, state, world_size=world)


def _read_files(path: str) -> None:
  for dirpath, _, names in os.walk(path):
    for name in names:
      with open(os.path.join(dirpath, name), "rb") as f:
        f.read()


def row(n_params: int, history: int, world: int, parts: int, repeats: int, tmp: str) -> dict:
  records = _records(n_params, history, world, 0)
  src = os.path.join(tmp, "src")
  jr.save_records(src, records, durable=False)
  fresh = best_of(lambda i: jr.save_records(f"{src}-fresh{i}", records, durable=False), repeats, 2)
  load = best_of(lambda i: jr.load_records(src), repeats, 2)
  read = best_of(lambda i: _read_files(src), repeats, 2)
  loaded = jr.load_records(src)
  resave = best_of(lambda i: jr.save_records(f"{src}-again{i}", loaded, durable=False), repeats, 2)
  # One-rank parts of a reshard to ``parts`` ranks, as one host each would write them.
  few = _records(n_params, history, parts, 0)
  small = os.path.join(tmp, "small")
  jr.save_records(small, few, durable=False)
  paths = []
  for r in range(parts):
    paths.append(os.path.join(tmp, f"part{r}"))
    result = CliRunner().invoke(
      app, ["reshard", small, paths[-1], "--world-size", str(parts), "--rank", str(r)]
    )
    if result.exit_code != 0:
      raise RuntimeError(f"reshard --rank {r} failed:\n{result.output[-3000:]}")
  merge = best_of(lambda i: _merge.merge_parts(os.path.join(tmp, f"merged{i}"), paths), repeats, 2)
  save_parts = best_of(
    lambda i: jr.save_records(os.path.join(tmp, f"few{i}"), few, durable=False), repeats, 2
  )
  for name in os.listdir(tmp):
    _disk.rmtree(os.path.join(tmp, name))
  return {
    "params": n_params,
    "ranks": world,
    "mib": round(history * 4 / 2**20, 1),
    "save_fresh_s": round(fresh, 3),
    "load_s": round(load, 3),
    "read_files_s": round(read, 3),
    "save_loaded_s": round(resave, 3),
    "loaded_over_fresh": round(resave / fresh, 2),
    "load_over_read": round(load / read, 2),
    "merge_parts": parts,
    "merge_s": round(merge, 3),
    "merge_over_save": round(merge / save_parts, 2),
  }


def run(opts: Options) -> Result:
  with tempfile.TemporaryDirectory(prefix="jr-bench-reload-") as tmp:
    rows = (
      row(
        opts.reload_params,
        opts.reload_size,
        opts.reload_world,
        opts.reload_parts,
        opts.repeats,
        tmp,
      ),
    )
  notes = (
    f"Adam, float32, {opts.reload_params} lognormal parameter sizes over"
    f" {opts.reload_world} ranks (`jr.shard_state`'s records), page cache, `durable=False`,"
    " best of the repeats. `save_fresh_s`: `save_records` of those records;"
    " `load_s`: `load_records` of the checkpoint; `read_files_s`: a plain read of"
    " every file of it; `save_loaded_s`: `save_records` of what `load_records`"
    " returned. `merge_s`: `jaxreshard merge` (the library call) of"
    f" {opts.reload_parts} one-rank parts (each a `jaxreshard reshard --rank` output of"
    f" the same params over {opts.reload_parts} ranks), against `save_records` of those"
    f" {opts.reload_parts} records made in memory (`merge_over_save`). No goal: figures."
  )
  return Result(NAME, "load, save again and merge whole checkpoints", GOAL, None, rows, notes)

"""Pod-scale bookkeeping of whole checkpoints: load, save again, merge one-rank parts."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import optax
from typer.testing import CliRunner

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result, best_of, run_child
from benchmarks._options import Options
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.cli.commands import app

NAME = "reload"
GOAL = (
  "no goal of its own: the bookkeeping of a whole checkpoint (load_records, a save of what"
  " it returned, a merge of one-rank parts, restore_sharded and save_sharded on a mesh) beside the save"
  " of the records shard_state makes, a plain read of the same files and jax's own"
  " device_put and device_get of the restored leaves"
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


_MESH_DEVICES = 8


def mesh_restore(path: str, repeats: int) -> dict:
  """(In a child with ``_MESH_DEVICES`` CPU devices.) ``restore_sharded`` of ``path``
  onto a ``(_MESH_DEVICES,)`` mesh, first call and best warm one, against one
  ``jax.device_put`` of the same global arrays (host copies) with the same shardings;
  then ``save_sharded`` of what it restored against one ``jax.device_get`` of it."""
  import time  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((_MESH_DEVICES,), ("fsdp",))
  t0 = time.perf_counter()
  state, _ = jr.restore_sharded(path, mesh, axis="fsdp")
  jax.block_until_ready(state)
  cold = time.perf_counter() - t0

  def restore(_):
    jax.block_until_ready(jr.restore_sharded(path, mesh, axis="fsdp").state)

  warm = best_of(restore, repeats, 2)
  leaves = jax.tree.leaves(state)
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  host = [np.asarray(x) for x in arrays]
  shardings = [x.sharding for x in arrays]
  put = best_of(lambda _: jax.block_until_ready(jax.device_put(host, shardings)), repeats, 2)
  placements = jr.restore_sharded(path, mesh, axis="fsdp").placements[0]
  shapes = {p.param: p for p in placements}
  opt = optax.adam(1e-3)
  saves = []

  def save(i):
    saves.append(f"{path}-mesh{i}")
    jr.save_sharded(saves[-1], opt, state, shapes, mesh, "fsdp")

  saved = best_of(save, repeats, 2)
  # jax keeps an array's host copy once made (``host`` above made them): each timed
  # device_get is of a fresh restore's arrays.
  get = None
  for _ in range(max(2, repeats)):
    fresh = [x for x in jax.tree.leaves(jr.restore_sharded(path, mesh, axis="fsdp").state)]
    fresh = [x for x in fresh if isinstance(x, jax.Array)]
    t0 = time.perf_counter()
    jax.device_get(fresh)
    took = time.perf_counter() - t0
    get = took if get is None else min(get, took)
    fresh = None
  for d in saves:
    _disk.rmtree(d)
  return {
    "leaves": len(arrays),
    "cold_s": cold,
    "warm_s": warm,
    "put_s": put,
    "save_s": saved,
    "get_s": get,
  }


def row(n_params: int, history: int, world: int, parts: int, repeats: int, tmp: str) -> dict:
  records = _records(n_params, history, world, 0)
  src = os.path.join(tmp, "src")
  jr.save_records(src, records, durable=False)
  fresh = best_of(lambda i: jr.save_records(f"{src}-fresh{i}", records, durable=False), repeats, 2)
  load = best_of(lambda i: jr.load_records(src), repeats, 2)
  read = best_of(lambda i: _read_files(src), repeats, 2)
  loaded = jr.load_records(src)
  on_mesh = run_child(
    "bench_reload", "mesh_restore", {"path": src, "repeats": repeats}, devices=_MESH_DEVICES
  )
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
    "mesh_leaves": on_mesh["leaves"],
    "mesh_restore_cold_s": round(on_mesh["cold_s"], 3),
    "mesh_restore_s": round(on_mesh["warm_s"], 3),
    "device_put_s": round(on_mesh["put_s"], 3),
    "mesh_restore_over_put": round(on_mesh["warm_s"] / on_mesh["put_s"], 2),
    "mesh_save_s": round(on_mesh["save_s"], 3),
    "device_get_s": round(on_mesh["get_s"], 3),
    "mesh_save_over_get": round(on_mesh["save_s"] / on_mesh["get_s"], 2),
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
    f" {opts.reload_parts} records made in memory (`merge_over_save`). `mesh_restore_s`:"
    f" `restore_sharded` of the checkpoint onto a ({_MESH_DEVICES},) 'fsdp' mesh of simulated"
    " CPU devices, in a fresh process (`mesh_restore_cold_s`: its first call; the"
    " warm figure the best of the repeats), against one `jax.device_put` of host"
    " copies of the same `mesh_leaves` global arrays with the same shardings"
    " (`device_put_s`: what jax itself takes to put those leaves on the mesh)."
    " `mesh_save_s`: `save_sharded` (durable) of the state it restored, against one"
    " `jax.device_get` of the leaves of a fresh restore (`device_get_s`: what jax itself"
    " takes to bring them to the host)."
    " No goal: figures."
  )
  return Result(
    NAME,
    "whole checkpoints: load, save again, merge, restore and save on a mesh",
    GOAL,
    None,
    rows,
    notes,
  )

"""(device) The device executor and mesh restores on the machine's accelerator (XLA:CPU smoke).

``python -m benchmarks --device``: (1) ``jr.reshard(..., executor="device")`` of one target
rank against an on-device copy of the same bytes; (2) ``jr.restore_sharded`` onto every
device of the default backend against orbax's restore of the same state with the same
target shardings. Neither needs an accelerator: on CPU they run on XLA:CPU.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxreshard as jr
from benchmarks import _disk, _workload
from benchmarks._measure import Result, block, measure
from benchmarks._options import Options

NAME = "device"
GOAL = (
  "device executor warm within 2x an on-device copy of the target's bytes; restore_sharded"
  " onto the devices at least as fast as orbax's restore of the same state"
)


def _executor_row(opts: Options) -> dict:
  device = jax.devices()[0]
  with jax.default_device(device):
    records = _workload.adam_records(opts.device_size, opts.n_params, opts.src_world, opts.seed)
    records = [jax.device_put(r, device) for r in records]
  plan = jr.plan(records, world_size=opts.dst_world, rank=1)
  jr.clear_kernel_cache()
  t0 = time.perf_counter()
  out = block(jr.reshard(records, plan, executor="device"))
  cold = time.perf_counter() - t0
  warm = measure(lambda: block(jr.reshard(records, plan, executor="device")), opts.repeats)
  nbytes = _workload.history_bytes([out])
  flat = jax.device_put(np.zeros(nbytes // 4, np.float32), device)
  copy = jax.jit(jnp.copy)
  block(copy(flat))
  base = measure(lambda: block(copy(flat)), opts.repeats)
  return {
    "what": f"reshard {opts.src_world} -> {opts.dst_world}, rank 1, executor=device",
    "backend": device.platform,
    "mib": round(nbytes / 2**20, 1),
    "seconds": round(warm.best, 5),
    "baseline": "jitted on-device copy of the same bytes",
    "baseline_seconds": round(base.best, 5),
    "over_baseline": round(warm.best / base.best, 2),
    "cold_s": round(cold, 3),
    "programs": jr.kernel_cache_info().programs,
  }


def _restore_row(opts: Options, tmp: str) -> dict:
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh

  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  path = os.path.join(tmp, "jr")
  records = _workload.adam_records(opts.device_size, opts.n_params, opts.src_world, opts.seed)
  jr.save_records(path, records)
  nbytes = _workload.history_bytes(records)
  records = None
  out = block(jr.restore_sharded(path, mesh))  # warm-up: imports, page cache
  ours = measure(lambda: block(jr.restore_sharded(path, mesh).state), opts.repeats)
  theirs_path = os.path.join(tmp, "orbax")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(theirs_path, out.state)
  target = jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
    ),
    out.state,
  )
  with ocp.StandardCheckpointer() as ckptr:
    got = block(ckptr.restore(theirs_path, target))
    theirs = measure(lambda: block(ckptr.restore(theirs_path, target)), opts.repeats)
  same = all(
    np.array_equal(_bits(a), _bits(b))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(out.state))
  )
  return {
    "what": f"restore_sharded of {opts.src_world} archives onto {len(mesh.devices)} devices",
    "backend": jax.default_backend(),
    "mib": round(nbytes / 2**20, 1),
    "seconds": round(ours.best, 5),
    "baseline": "orbax StandardCheckpointer restore of the same state, same shardings",
    "baseline_seconds": round(theirs.best, 5),
    "over_baseline": round(ours.best / theirs.best, 2),
    "cold_s": None,
    "programs": None,
    "bit_exact_vs_orbax": bool(same),
  }


def _bits(x) -> np.ndarray:
  a = np.asarray(x).reshape(-1)
  return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def run(opts: Options) -> Result:
  tmp = tempfile.mkdtemp(prefix="jr-bench-device-")
  try:
    rows = [_executor_row(opts), _restore_row(opts, tmp)]
  finally:
    _disk.rmtree(tmp)
  rows[0]["bit_exact_vs_orbax"] = None
  met = None
  if not opts.quick:
    met = rows[0]["over_baseline"] <= 2 and rows[1]["over_baseline"] <= 1
  notes = (
    f"Adam, {opts.device_size} history elements over {opts.n_params} parameters, on"
    f" backend {jax.default_backend()}. `seconds`: best of {opts.repeats} warm runs;"
    " `over_baseline`: seconds over the baseline's (< 1: faster). Row 1 reshards target"
    " rank 1 with the device executor from records placed on the first device; `cold_s`"
    " includes compiling its programs. Row 2 restores the saved archives onto a (devices,)"
    " 'fsdp' mesh; orbax restores the state jaxreshard restored, saved by orbax, with the"
    " same target shardings; `bit_exact_vs_orbax` compares both results bit for bit."
  )
  return Result(
    NAME, "device executor and mesh restore vs on-device baselines", GOAL, met, tuple(rows), notes
  )

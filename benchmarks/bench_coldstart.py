"""What a restarted process pays the first time: programs compiled and seconds.

A restart is a fresh process: whatever a first call compiles (on XLA:CPU ~20 ms
a program, more on an accelerator) is paid at every restart, and a call that
compiles a program per parameter shape costs seconds at a few hundred. Each
row is measured in a fresh python with 8 simulated CPU devices; the checkpoint
it reads is written by another one.
"""

from __future__ import annotations

import os
import tempfile
import time

from benchmarks._measure import Result, run_child
from benchmarks._options import Options

NAME = "coldstart"
GOAL = (
  "in a fresh process, restore, load_records and unshard_state compile no program, and"
  " flat_sharded's init outside jit compiles at most 2 (not one per parameter shape)"
)


def _params(n: int, seed: int):
  """``n`` params of distinct shapes (float32 numpy), as a model's layers differ."""
  import numpy as np

  rng = np.random.default_rng(seed)
  return {
    f"layer_{i:04d}": {"w": rng.standard_normal((i + 2, 3)).astype(np.float32)} for i in range(n)
  }


def writer(path: str, n_params: int, seed: int) -> dict:
  """Writes the checkpoint the restore rows read (8 ranks of an Adam state)."""
  import jax
  import optax

  import jaxreshard as jr

  params = _params(n_params, seed)
  opt = optax.adam(1e-3)
  with jax.numpy_dtype_promotion("standard"):
    state = jax.jit(opt.init)(params)
  jr.save_records(path, jr.shard_state(opt, params, state, 8))
  return {}


def child(path: str, n_params: int, seed: int) -> list[dict]:
  """Every row, each call's first run timed against its second, compiles counted."""
  import jax
  import jax.monitoring
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxreshard as jr

  compiled = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiled.append(seconds) if "backend_compile" in event else None
  )

  def row(what: str, fn) -> dict:
    del compiled[:]
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    programs, compile_s = len(compiled), sum(compiled)
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    second = time.perf_counter() - t0
    return {
      "what": what,
      "params": n_params,
      "first_s": round(first, 4),
      "second_s": round(second, 4),
      "first_over_second": round(first / second, 1),
      "programs": programs,
      "compile_s": round(compile_s, 3),
    }

  rows = [
    row("restore one target rank of 6", lambda: jr.restore(path, world_size=6, rank=1).state),
    row("load_records (8 archives)", lambda: [r.state for r in jr.load_records(path)]),
  ]
  params = _params(n_params, seed + 1)  # other shapes than the checkpoint's: nothing cached
  opt = optax.adam(1e-3)
  # Its state made on the host (numpy), as a loaded one is: nothing compiled here.
  state = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), jax.eval_shape(opt.init, params))
  records = jr.shard_state(opt, params, state, 4)
  rows.append(row("unshard_state (4 archives)", lambda: jr.unshard_state(records)))
  mesh = jax.make_mesh((8,), ("fsdp",))
  on_mesh = jax.device_put(_params(n_params, seed + 2), NamedSharding(mesh, P()))
  wrapped = jr.flat_sharded(optax.adam(1e-3), mesh, axis="fsdp")
  with jax.numpy_dtype_promotion("standard"):
    rows.append(row("flat_sharded(adam).init outside jit", lambda: wrapped.init(on_mesh)))
    baseline = jax.device_put(_params(n_params, seed + 3), NamedSharding(mesh, P()))
    rows.append(row("optax.adam init outside jit (baseline)", lambda: opt.init(baseline)))
  return rows


def run(opts: Options) -> Result:
  n = opts.coldstart_params
  with tempfile.TemporaryDirectory(prefix="jr-bench-coldstart-") as tmp:
    path = os.path.join(tmp, "ckpt")
    run_child("bench_coldstart", "writer", dict(path=path, n_params=n, seed=opts.seed), devices=8)
    rows = run_child(
      "bench_coldstart", "child", dict(path=path, n_params=n, seed=opts.seed), devices=8
    )
  restore, load, unshard, init, _ = rows
  met = None
  if not opts.quick:
    met = all(r["programs"] == 0 for r in (restore, load, unshard)) and init["programs"] <= 2
  notes = (
    f"Adam, {n} parameters of distinct shapes ((i + 2, 3) float32), 8 simulated CPU devices."
    " The rows run in order in one fresh python (the checkpoint, 8 archives, is written by"
    " another):"
    " `first_s` is the first call in the process, `second_s` the next one; `programs` and"
    " `compile_s` count the programs XLA compiled during the first call"
    " (`jax.monitoring`'s backend-compile events) and their seconds. A restore comes first,"
    " so that its clock scalar's conversion is not already compiled."
    " The baseline row is optax's own `init` run op by op on the same kind of params: one"
    " program per distinct shape, the cost `flat_sharded`'s `init` used to pay three and a"
    " half times over. Verdict: no program for restore, load_records and unshard_state; at"
    " most 2 for flat_sharded's init outside jit."
  )
  return Result(NAME, "first calls in a fresh process", GOAL, met, tuple(rows), notes)

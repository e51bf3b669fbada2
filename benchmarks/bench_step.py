"""(g) One jitted optimizer step: ``flat_sharded`` vs optax with its state ``NamedSharding``-ed."""

from __future__ import annotations

import statistics
import time

from benchmarks._measure import Result, run_child
from benchmarks._options import Options

NAME = "step"
GOAL = (
  "one jitted adamw + clip_by_global_norm step, 8 devices, params and grads replicated:"
  " `flat_sharded` <= 1.0x optax with each state leaf sharded on a divisible axis"
  " (ZeRO-1 with NamedSharding), the same optimizer bytes per device (1/8); on explicit"
  " axes with `shard_updates=True`, which lays the updates out as the baseline's are (the"
  " default row, updates laid out like the grads, is reported beside it)"
)
_DEVICES = 8


def _shapes(layers: int, width: int) -> dict:
  """A transformer-like tree of ``6 * layers`` params; every dim divisible by 8."""
  block = {
    "up": (width, 4 * width),
    "up_bias": (4 * width,),
    "down": (4 * width, width),
    "down_bias": (width,),
    "scale": (width,),
    "shift": (width,),
  }
  return {f"layer{i}": dict(block) for i in range(layers)}


def _per_device_bytes(state) -> int:
  """Bytes of ``state`` held by the first device (shards of every leaf)."""
  import jax

  dev = jax.devices()[0]
  return sum(
    s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == dev
  )


def _steps(kind: str, layers: int, width: int):
  """(params, grads, (name, step, state) x 2) on a fresh ``kind`` mesh of 8 devices."""
  import jax
  import optax
  from jax.sharding import AxisType, NamedSharding, PartitionSpec

  import jaxreshard as jr

  axis_type = AxisType.Explicit if kind.startswith("explicit") else AxisType.Auto
  mesh = jax.make_mesh((_DEVICES,), ("fsdp",), axis_types=(axis_type,))
  rep = NamedSharding(mesh, PartitionSpec())
  shapes = _shapes(layers, width)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(leaves))
  params, grads = (
    jax.tree.unflatten(
      treedef, [jax.device_put(jax.random.normal(k, s), rep) for k, s in zip(ks, leaves)]
    )
    for ks in (keys[: len(leaves)], keys[len(leaves) :])
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-2))

  def spec(x):  # the first axis the mesh axis divides; scalars replicated
    axis = next((i for i, n in enumerate(x.shape) if n % _DEVICES == 0), None)
    return PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "fsdp")

  zero1 = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tx.init(params))
  flat = jr.flat_sharded(tx, mesh, "fsdp", shard_updates=kind.endswith("shard_updates"))
  flat_state = flat.init(params)
  out = []
  for name, opt, state, shardings in (
    ("namedsharding", tx, jax.device_put(tx.init(params), zero1), zero1),
    ("flat_sharded", flat, flat_state, jax.tree.map(lambda x: x.sharding, flat_state)),
  ):

    def step(p, g, s, opt=opt):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    jitted = jax.jit(
      step, out_shardings=(jax.tree.map(lambda _: rep, params), shardings), donate_argnums=(0, 2)
    )
    out.append((name, jitted, state))
  return mesh, params, grads, out


def measure_step(kind: str, layers: int, width: int, rounds: int) -> dict:
  """Median step times of both sides, interleaved round by round, in this process."""
  import jax

  mesh, params, grads, sides = _steps(kind, layers, width)
  bytes_per_device = [_per_device_bytes(state) for _, _, state in sides]
  with jax.set_mesh(mesh):
    live = []
    for name, jitted, state in sides:
      p = jax.tree.map(lambda x: x.copy(), params)
      p, state = jax.block_until_ready(jitted(p, grads, state))  # compile + warm up
      live.append([name, jitted, p, state, []])
    for _ in range(rounds):
      for side in live:
        _, jitted, p, state, times = side
        t0 = time.perf_counter()
        side[2], side[3] = jax.block_until_ready(jitted(p, grads, state))
        times.append(time.perf_counter() - t0)
  base, flat = (statistics.median(side[4]) for side in live)
  ratios = [f / b for b, f in zip(live[0][4], live[1][4])]
  return {
    "mesh_axes": kind,
    "params": len(jax.tree.leaves(params)),
    "elements": sum(x.size for x in jax.tree.leaves(params)),
    "namedsharding_ms": round(1e3 * base, 2),
    "flat_sharded_ms": round(1e3 * flat, 2),
    "ratio": round(flat / base, 3),
    "ratio_per_round_median": round(statistics.median(ratios), 3),
    "state_bytes_per_device_namedsharding": bytes_per_device[0],
    "state_bytes_per_device_flat": bytes_per_device[1],
    "rounds": rounds,
    "loadavg": open("/proc/loadavg").read().split(" ")[:3],
  }


def run(opts: Options) -> Result:
  kwargs = {"layers": opts.step_layers, "width": opts.step_width, "rounds": opts.step_rounds}
  rows = []
  for kind in ("auto", "explicit", "explicit+shard_updates"):
    if _enough_devices():
      rows.append(measure_step(kind, **kwargs))
    else:
      rows.append(run_child("bench_step", "measure_step", dict(kind=kind, **kwargs), devices=8))
  for r in rows:
    r["loadavg"] = " ".join(r["loadavg"])
  met = None
  if not opts.quick:
    met = all(
      r["ratio"] <= 1.0
      and r["state_bytes_per_device_flat"] <= r["state_bytes_per_device_namedsharding"]
      for r in rows
      if r["mesh_axes"] != "explicit"
    )
  notes = (
    f"optax.chain(clip_by_global_norm(1.0), adamw(1e-3)) over {6 * opts.step_layers} params"
    f" (width {opts.step_width}: (w, 4w), (4w,), (4w, w), 3 x (w,) per layer), params and grads"
    f" replicated on {_DEVICES} simulated CPU devices, one `jax.jit` of update +"
    " `apply_updates` with the params' and state's shardings as `out_shardings` and params"
    " and state donated. Baseline: the unwrapped optimizer with each state leaf sharded on"
    " its first axis divisible by 8 (`NamedSharding`, ZeRO-1). Both sides run"
    f" interleaved in one process, {opts.step_rounds} rounds; times are medians, `ratio`"
    " = flat / baseline medians. `auto`: a mesh of `AxisType.Auto` axes; `explicit`:"
    " `jax.make_mesh`'s default, with `flat_sharded`'s default updates, laid out like"
    " the grads (replicated: the all-gather carries the updates and each device adds"
    " whole params), while the baseline's come out sharded like its state;"
    " `explicit+shard_updates`: the same mesh with `shard_updates=True`, where both"
    " sides' updates come out sharded by rows (every leading dimension here is"
    " divisible by 8), are added on each device's rows, and `out_shardings`"
    " all-gathers the new params. The verdict takes `auto` and"
    " `explicit+shard_updates`. Bytes: the optimizer state held by device 0."
  )
  return Result(
    NAME, "flat_sharded step vs NamedSharding ZeRO-1 step", GOAL, met, tuple(rows), notes
  )


def _enough_devices() -> bool:
  """Whether this process already has the simulated devices (else a child gets them)."""
  import jax

  return jax.device_count() >= _DEVICES

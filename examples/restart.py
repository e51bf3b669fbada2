"""Train, save with an orbax CheckpointManager, and resume on another number of devices.

A small flax MLP trains with ``jr.flat_sharded(optax.adamw(...))``: params are
replicated, the AdamW moments live flat-sharded over the mesh axis ``fsdp``
(each device holds and updates only its own slots). Every ``--save-every``
steps a ``CheckpointManager`` saves both, asynchronously; on start the script
resumes from the latest step, whatever number of devices or processes saved
it.

One process, every local device::

  python examples/restart.py --ckpt /tmp/run --steps 6 --kill-after 3
  python examples/restart.py --ckpt /tmp/run --steps 6 --devices 5

Several processes (run once per process, same arguments but the id)::

  python examples/restart.py --ckpt /tmp/run --steps 6 \\
      --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0

``--kill-after N`` stops the job the hard way (SIGKILL, no clean shutdown)
right after step N's checkpoint is committed, as a lost host would. Only
process 0 prints (each step once); a run directory that already holds
``--steps`` (or a later step) is said so, and nothing is trained. ``--out``
writes what the run saw (each step's loss and the final params, as bits) to a
JSON file, which is how the tests compare a resumed run with an uninterrupted
one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

import jaxreshard as jr

# How long process 0 outlives the others of a job stopped by ``--kill-after``.
KILL_GRACE_S = 2.0

FEATURES, HIDDEN, BATCH = 8, 37, 16  # 37 hidden units: no world size divides the params


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(HIDDEN)(x))
    return nn.Dense(1)(x)[..., 0]


def batch(step: int) -> tuple[jax.Array, jax.Array]:
  """The same batch for a step in every run and every process."""
  kx = jax.random.fold_in(jax.random.key(1), step)
  x = jax.random.normal(kx, (BATCH, FEATURES))
  return x, jnp.sin(x.sum(axis=-1))


def inner_optimizer() -> optax.GradientTransformation:
  return optax.adamw(3e-3, weight_decay=1e-2)


def run(
  mesh: jax.sharding.Mesh,
  ckpt: str,
  steps: int,
  *,
  save_every: int = 1,
  kill_after: int | None = None,
) -> dict:
  """Trains up to ``steps``, resuming from ``ckpt``'s latest step; returns what it saw."""
  model, inner = MLP(), inner_optimizer()
  optimizer = jr.flat_sharded(inner, mesh, axis="fsdp")
  replicated = NamedSharding(mesh, PartitionSpec())
  # Host values, placed on the mesh: the same numbers in every process.
  init = jax.tree.map(np.asarray, model.init(jax.random.key(0), batch(0)[0])["params"])
  params = jax.device_put(init, replicated)

  @jax.jit
  def train_step(params, state, x, y):
    def loss_fn(p):
      return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = {}
  with ocp.CheckpointManager(os.path.abspath(ckpt), item_names=("params", "opt_state")) as manager:
    start = manager.latest_step()
    if start is None:
      start, state = 0, optimizer.init(params)
    else:
      abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
      )
      restored = manager.restore(
        start,
        args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract),
          # Checked against the optimizer it feeds: another optimizer or model
          # is refused naming the leaf, not at the first update.
          opt_state=jr.ReshardRestore(mesh=mesh, axis="fsdp", optimizer=optimizer, params=abstract),
        ),
      )
      params, state = restored.params, restored.opt_state
    for step in range(start, steps):
      x, y = jax.device_put(jax.tree.map(np.asarray, batch(step)), replicated)
      params, state, loss = train_step(params, state, x, y)
      losses[step] = float(loss)
      if (step + 1) % save_every == 0 or step + 1 == steps:
        manager.save(
          step + 1,
          args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=jr.ReshardSave(state=state, optimizer=inner, params=params, mesh=mesh),
          ),
        )
      if step + 1 == kill_after:
        manager.wait_until_finished()
        return {"start": start, "losses": losses, "killed": True}
    manager.wait_until_finished()
  return {"start": start, "losses": losses, "params": _params_bits(params)}


def _params_bits(params: Any) -> dict:
  """Each param's bits (its first local replica), hashed: equal means bit-identical."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    a = np.asarray(leaf.addressable_data(0))
    out[jax.tree_util.keystr(path)] = hashlib.sha256(a.view(np.uint32).tobytes()).hexdigest()
  return out


def loss_bits(losses: dict) -> dict:
  """``{step: loss}`` as ``{"step": float32 bit pattern}``: losses compared exactly, in JSON."""
  return {str(k): np.float32(v).view(np.uint32).item() for k, v in sorted(losses.items())}


def _say(message: str) -> None:
  """Prints on process 0 only: every process sees the same steps and losses."""
  if jax.process_index() == 0:
    print(message, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--ckpt", required=True, help="the CheckpointManager directory")
  p.add_argument("--steps", type=int, default=6, help="train until this step")
  p.add_argument("--save-every", type=int, default=1)
  p.add_argument(
    "--kill-after",
    type=int,
    default=None,
    help="SIGKILL the job right after this step's checkpoint is committed",
  )
  p.add_argument(
    "--devices", type=int, default=None, help="use only this many devices (default: all)"
  )
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-process)")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--out", default=None, help="write the losses and params bits here (JSON)")
  args = p.parse_args(argv)

  if args.num_processes > 1:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  devices = jax.devices()[: args.devices] if args.devices else jax.devices()
  mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)
  seen = run(mesh, args.ckpt, args.steps, save_every=args.save_every, kill_after=args.kill_after)
  where = f"{jax.process_count()} process(es) x {jax.local_device_count()} devices"
  if seen["start"] >= args.steps:
    _say(
      f"{args.ckpt} already holds step {seen['start']} (--steps {args.steps}): nothing to"
      " train; pass a larger --steps to continue"
    )
  for step, loss in sorted(seen["losses"].items()):
    _say(f"step {step + 1}: loss {loss:.6f}  ({where}, fsdp={len(devices)})")
  if args.out and jax.process_index() == 0:
    with open(args.out, "w") as f:
      json.dump(
        {
          "start": seen["start"],
          "losses": loss_bits(seen["losses"]),
          "params": seen.get("params"),
          "devices": len(devices),
          "processes": jax.process_count(),
        },
        f,
      )
  if seen.get("killed"):
    _say(f"killed after step {args.kill_after} (its checkpoint is committed)")
    if jax.process_index() == 0 and jax.process_count() > 1:
      # Process 0 hosts the coordination service: killed first, it would take the
      # service with it and the runtime would abort the others (SIGABRT) before
      # their own SIGKILL. They go at once (a dead peer is noticed only at the
      # heartbeat timeout); it follows a moment later.
      time.sleep(KILL_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])

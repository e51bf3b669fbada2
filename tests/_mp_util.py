"""Helpers of the distributed tests: one example state, and local process groups.

The example state is deterministic (same seed -> same bits in every process),
so a worker process and the pytest process build it independently and the
pytest process computes the single-process reference with the core.

``ProcessGroup`` starts ``n`` real Python processes that call
``jax.distributed.initialize`` against a coordinator on a free localhost port,
each with its own simulated CPU device count, and guarantees they are all gone
when it exits (killed if still running), whatever happened.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from tests._core_util import nest, random_example
from tests._shapes import MP_SPECS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_mp_worker.py")

SPECS = MP_SPECS
FROZEN = ("head/w",)


def optimizer() -> Any:
  """Adam (bf16 first moment) on trainable params, nothing on frozen ones, clipped."""
  labels = nest({pid: "frozen" if pid in FROZEN else "train" for pid in SPECS})
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.multi_transform(
      {"train": optax.adam(1e-3, mu_dtype=jnp.bfloat16), "frozen": optax.set_to_zero()}, labels
    ),
  )


def example(seed: int = 0):
  """(optimizer, params, state, shapes): history buffers are random bits, count set."""
  opt = optimizer()
  params, state = random_example(opt, SPECS, seed, random_float_scalars=False)
  shapes = {pid: s for pid, (s, _) in SPECS.items()}
  return opt, params, state, shapes


def example_params(seed: int = 0) -> Any:
  """Params of the example's shapes and dtypes, random finite values (host numpy).

  Finite: ``jax.device_put`` onto a multi-process sharding checks that every
  process passes equal values, and NaN is never equal. Without the zero-size
  parameter: orbax refuses to save arrays with zero size.
  """
  rng = np.random.default_rng(seed + 1000)
  return nest(
    {pid: rng.standard_normal(s).astype(d) for pid, (s, d) in SPECS.items() if math.prod(s)}
  )


def trainable() -> dict:
  return {pid: pid not in FROZEN for pid in SPECS}


_HANDED_OUT: set[int] = set()


def free_port() -> int:
  """A localhost port free now and never handed out before by this process.

  The port is bound again only when a group's coordinator starts, and the kernel
  gives a port just closed to the next ``bind(0)`` now and then (within five calls,
  8 times in 20,000 here). Two groups started together on one port can both bind it
  (gRPC servers set SO_REUSEPORT), and a worker of one then reaches the other's
  coordinator: a run saw a worker refused as "a different incarnation" of a task
  the coordinator already had, and every process of its group abort.
  """
  while True:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    if port not in _HANDED_OUT:
      _HANDED_OUT.add(port)
      return port


class ProcessGroup:
  """``n`` worker processes of one jax.distributed job on localhost.

  Args:
    n: number of processes.
    devices: simulated CPU devices per process.
    task: the worker task name (see ``_mp_worker.py``).
    out: a directory the workers write results to (``<out>/p<i>.json`` ...).
    args: JSON-able task arguments, the same for every process.
    timeout: seconds the whole group may run.
    argv: optional ``argv(i, coordinator) -> list[str]``: process ``i`` runs
      ``python *argv`` (a script of its own) instead of the worker task.
  """

  def __init__(
    self,
    n: int,
    devices: int,
    task: str,
    out: str,
    args: dict,
    timeout: float = 150.0,
    argv: Any | None = None,
  ):
    self.n, self.devices, self.task, self.out, self.args = n, devices, task, out, args
    # ``argv(i, coordinator)``: run that command line instead of the worker.
    self.argv = argv
    self.timeout = timeout
    self.procs: list[subprocess.Popen] = []
    self.logs: list[str] = []

  def __enter__(self) -> ProcessGroup:
    os.makedirs(self.out, exist_ok=True)
    port = free_port()
    for i in range(self.n):
      env = dict(os.environ)
      env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={self.devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        MP_COORDINATOR=f"127.0.0.1:{port}",
        MP_NUM_PROCESSES=str(self.n),
        MP_PROCESS_ID=str(i),
        MP_TASK=self.task,
        MP_OUT=self.out,
        MP_ARGS=json.dumps(self.args),
      )
      log = os.path.join(self.out, f"p{i}.log")
      self.logs.append(log)
      cmd = (
        [sys.executable, WORKER]
        if self.argv is None
        else [sys.executable, *self.argv(i, f"127.0.0.1:{port}")]
      )
      with open(log, "wb") as f:
        self.procs.append(
          subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
          )
        )
    self.started = time.monotonic()
    return self

  def __exit__(self, *exc) -> None:
    self.kill()

  def kill(self, i: int | None = None) -> None:
    """SIGKILLs process ``i`` (default: every process still running)."""
    for j, p in enumerate(self.procs):
      if (i is None or i == j) and p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)

  def wait(self, only: Sequence[int] | None = None) -> list[int]:
    """Waits for the processes (all, or ``only``); returns exit codes; kills all on timeout."""
    which = range(self.n) if only is None else only
    for j in which:
      left = self.timeout - (time.monotonic() - self.started)
      try:
        self.procs[j].wait(max(left, 0.1))
      except subprocess.TimeoutExpired:
        self.kill()
        raise AssertionError(f"process group {self.task!r} timed out:\n{self.tail()}") from None
    return [self.procs[j].returncode for j in which]

  def check(self) -> list[dict]:
    """Waits for every process, asserts success, returns each one's JSON result."""
    codes = self.wait()
    if any(codes):
      self.kill()
      raise AssertionError(f"process group {self.task!r} exit codes {codes}:\n{self.tail()}")
    return [json.load(open(os.path.join(self.out, f"p{i}.json"))) for i in range(self.n)]

  def tail(self, chars: int = 3000) -> str:
    parts = []
    for log in self.logs:
      try:
        text = open(log, errors="replace").read()
      except OSError:
        text = ""
      parts.append(f"--- {log} ---\n{text[-chars:]}")
    return "\n".join(parts)

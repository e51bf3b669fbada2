"""Measuring helpers: timers, bandwidth, bytes read, memory, the machine, results."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Timing", "Result", "measure", "gbps", "rchar", "machine", "run_child", "block"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall-clock seconds of repeated runs of one measured block."""

  runs: tuple[float, ...]

  @property
  def best(self) -> float:
    return min(self.runs)

  @property
  def median(self) -> float:
    return statistics.median(self.runs)


@dataclasses.dataclass(frozen=True)
class Result:
  """One benchmark's outcome: rows of figures and the verdict on its goal.

  Attributes:
    name: the benchmark's short name (``--only`` takes it).
    title: one line saying what is compared with what.
    goal: the goal the figure is measured against, in words.
    met: True / False, or None where no verdict applies (quick run, skipped).
    rows: one dict per configuration; every dict has the same keys.
    notes: how to read the rows, and where a goal is missed, why.
  """

  name: str
  title: str
  goal: str
  met: bool | None
  rows: tuple[dict, ...]
  notes: str = ""

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def block(x: Any) -> Any:
  """Waits for every jax array in ``x`` (dispatch is asynchronous).

  Only jax arrays are handed to ``jax.block_until_ready``: on any other leaf it
  calls a missing method and catches the ``AttributeError`` (~1-2 us each), which
  on the host path's numpy leaves (20,000 at 10,000 parameters) would time the
  benchmark rather than the call. Flattening ``x`` still reads every leaf.
  """
  import jax

  jax.block_until_ready([leaf for leaf in jax.tree.leaves(x) if isinstance(leaf, jax.Array)])
  return x


def measure(fn: Callable[[], Any], repeats: int = 3, warmup: int = 0) -> Timing:
  """Times ``fn()`` (which must block on its own results) ``repeats`` times."""
  for _ in range(warmup):
    fn()
  runs = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    fn()
    runs.append(time.perf_counter() - t0)
  return Timing(tuple(runs))


def best_of(fn: Callable[[int], Any], repeats: int, least: int = 1) -> float:
  """The best time of ``max(least, repeats)`` calls ``fn(i)`` (``i``: the call's number,
  for a fresh output path each time)."""
  best = float("inf")
  for i in range(max(least, repeats)):
    t0 = time.perf_counter()
    fn(i)
    best = min(best, time.perf_counter() - t0)
  return best


def gbps(nbytes: int, seconds: float) -> float:
  """Copy bandwidth in GB/s, counting bytes read plus bytes written (2x)."""
  return 2 * nbytes / seconds / GB if seconds > 0 else float("inf")


def rchar() -> int:
  """Bytes this process has read so far (``/proc/self/io`` rchar; 0 if absent)."""
  try:
    with open("/proc/self/io") as f:
      for line in f:
        if line.startswith("rchar:"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def machine() -> dict:
  """What the figures were measured on, read from the running machine."""
  import jax
  import numpy as np

  info = {
    "python": platform.python_version(),
    "platform": platform.platform(),
    "cpus": os.cpu_count(),
    "jax": jax.__version__,
    "numpy": np.__version__,
    "backend": jax.default_backend(),
    "devices": ", ".join(sorted({d.device_kind for d in jax.devices()})),
  }
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    info["cpu"] = names[0] if names else platform.processor()
  except OSError:
    info["cpu"] = platform.processor()
  try:
    with open("/proc/meminfo") as f:
      kb = int(next(l for l in f if l.startswith("MemTotal")).split()[1])
    info["memory_gib"] = round(kb / 2**20, 1)
  except (OSError, StopIteration):
    pass
  try:
    info["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    pass
  for mod in ("optax", "orbax.checkpoint"):
    try:
      info[mod] = __import__(mod, fromlist=["_"]).__version__
    except Exception:  # noqa: BLE001 - a missing optional package is just not listed
      pass
  return info


def run_child(
  module: str, func: str, kwargs: dict, *, devices: int = 0, timeout: float = 900
) -> dict:
  """Runs ``benchmarks.<module>.<func>(**kwargs)`` in a fresh python, returns its JSON.

  A fresh process is how peak memory is isolated and how simulated devices
  are set up (``XLA_FLAGS`` must be set before jax is imported).
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if devices:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  code = (
    "import json, sys\n"
    f"from benchmarks import {module} as m\n"
    f"out = m.{func}(**json.loads(sys.argv[1]))\n"
    "print('@@RESULT@@' + json.dumps(out))\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, json.dumps(kwargs)],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  for line in proc.stdout.splitlines():
    if line.startswith("@@RESULT@@"):
      return json.loads(line[len("@@RESULT@@") :])
  raise RuntimeError(
    f"benchmarks.{module}.{func} failed (rc {proc.returncode}):\n"
    f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  )

"""The fetch step on a device: jitted gathers from each source archive's packed buffers.

``pipeline.memory_fetch`` hands its runs here when the executor is "device", or
"auto" with a source on a GPU/TPU.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.engine.sources import MemorySources

__all__ = ["device_fetch", "gather_runs", "on_one_device", "packed_sources"]


def device_fetch(
  src: MemorySources, runs: dict, keys: list, layout: _copyplan.TargetLayout
) -> dict:
  """Gathers on the device from each source archive's packed buffer of a dtype.

  Packing an archive's buffers (one program per archive layout) makes every
  source of a group one array of one size, so the gathers compile a handful
  of programs per dtype whatever the number of parameters.
  """
  out = {}
  for dtype, r in runs.items():
    if not len(r.source):  # a target that is all padding in this dtype reads nothing
      out[dtype] = jax.numpy.zeros(layout.sizes[dtype], dtype)
      continue
    out[dtype] = gather_runs(src, dtype, r, keys, layout.sizes[dtype])
  return out


def gather_runs(src: MemorySources, dtype: np.dtype, r: Any, keys: list, size: int) -> Any:
  """A ``(size,)`` device buffer of ``dtype``: runs ``r`` (of at least one run) copied in,
  from the packed buffers of the archives they read."""
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  arrays, source, base = packed_sources(src, dtype, r, keys)
  return _device_exec.gather(arrays, source, r.src + base, r.dst, r.length, size)


def packed_sources(src: MemorySources, dtype: np.dtype, r: Any, keys: list) -> tuple:
  """The packed ``dtype`` buffer of each archive that runs ``r`` read, on one device;
  each run's index into them, and where its history buffer starts there."""
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  archives = sorted({keys[s][0] for s in r.source.tolist()})
  packed, offsets = {}, {}
  for a in archives:
    order = [(pid, m, buf) for pid, m, buf in src.packing(a) if np.dtype(buf.dtype) == dtype]
    offsets[a] = {}
    pos = 0
    for pid, m, buf in order:
      offsets[a][(pid, m)] = pos
      pos += int(np.size(buf))
    packed[a] = _device_exec.pack([jax.numpy.asarray(buf) for _, _, buf in order])
  arrays = on_one_device([packed[a] for a in archives])
  index = {a: i for i, a in enumerate(archives)}
  source = np.asarray([index[keys[s][0]] for s in r.source.tolist()], np.int64)
  base = np.asarray([offsets[keys[s][0]][keys[s][1:]] for s in r.source.tolist()], np.int64)
  return arrays, source, base


def on_one_device(arrays: list[Any]) -> list[Any]:
  """Sources on several devices (each rank's archive on its own) feed one gather on
  the default device; sources on one device stay there."""
  devices = {d for x in arrays for d in x.devices()}
  if len(devices) <= 1:
    return arrays
  target = jax.config.jax_default_device
  if target is None or isinstance(target, str):
    target = jax.devices(target)[0]
  return [jax.device_put(x, target) for x in arrays]

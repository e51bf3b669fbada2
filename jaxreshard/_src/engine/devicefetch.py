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

__all__ = ["Packs", "device_fetch", "gather_runs", "on_one_device", "packed_sources"]


class Packs:
  """Packed device buffers of one call, shared by the reads that follow each other:
  the padding check and the gathers of a target rank read the same archives, and
  consecutive target ranks mostly the same.

  Each (archive, dtype) is packed when first asked for. Only the archives of the
  latest request of each dtype are kept: a pack is a device copy of an
  archive's buffers, so keeping every one would hold a second copy of the
  sources on the device for the rest of the call. The call that makes a
  ``Packs`` owns it; nothing outlives the call.
  """

  def __init__(self, src: MemorySources):
    self.src = src
    self._kept: dict = {}  # dtype -> {archive: (packed buffer, offsets)}

  def take(self, archives: list[int], dtype: np.dtype) -> list[tuple[Any, dict]]:
    """``(packed buffer, {(param, mirror): its start there})`` of each archive's
    ``dtype`` history buffers, in packing order; these are the ones kept now."""
    dtype = np.dtype(dtype)
    kept = self._kept.get(dtype, {})
    now = {a: kept[a] if a in kept else self._pack(a, dtype) for a in archives}
    self._kept[dtype] = now
    return [now[a] for a in archives]

  def _pack(self, archive: int, dtype: np.dtype) -> tuple[Any, dict]:
    from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

    order = [b for b in self.src.packing(archive) if np.dtype(b[2].dtype) == dtype]
    sizes = [int(np.size(buf)) for _, _, buf in order]
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    offsets = {(pid, m): at for (pid, m, _), at in zip(order, starts)}
    # A jax array goes in as it is: ``jnp.asarray`` of one costs ~20 us, per leaf.
    leaves = [b if isinstance(b, jax.Array) else jax.numpy.asarray(b) for _, _, b in order]
    # An archive whose leaves lie on several devices is packed on one, as the
    # sources of one gather are (``on_one_device``).
    return _device_exec.pack(on_one_device(leaves)), offsets


def device_fetch(
  src: MemorySources, runs: dict, keys: list, layout: _copyplan.TargetLayout, packs: Packs
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
    out[dtype] = gather_runs(packs, dtype, r, keys, layout.sizes[dtype])
  return out


def gather_runs(packs: Packs, dtype: np.dtype, r: Any, keys: list, size: int) -> Any:
  """A ``(size,)`` device buffer of ``dtype``: runs ``r`` (of at least one run) copied in,
  from the packed buffers of the archives they read."""
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  arrays, source, base = packed_sources(packs, dtype, r, keys)
  return _device_exec.gather(arrays, source, r.src + base, r.dst, r.length, size)


def packed_sources(packs: Packs, dtype: np.dtype, r: Any, keys: list) -> tuple:
  """The packed ``dtype`` buffer of each archive that runs ``r`` read, on one device;
  each run's index into them, and where its history buffer starts there."""
  archives = sorted({keys[s][0] for s in r.source.tolist()})
  taken = packs.take(archives, dtype)
  offsets = {a: o for a, (_, o) in zip(archives, taken)}
  arrays = on_one_device([p for p, _ in taken])
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

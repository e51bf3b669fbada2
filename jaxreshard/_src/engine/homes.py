"""Where the history buffers of in-memory archives live: host views and devices.

A :class:`BufferHomes` answers, for one list of archives' state parts, what the
copy needs to know about each buffer before reading it: its bytes as a flat
unsigned numpy view (made once per buffer) and whether it lives on a GPU/TPU
(looked at once per buffer, or once per archive whose buffers are all on the
host). It is owned by the source object and lives as long as it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.exec import host as _host_exec

__all__ = ["BufferHomes", "copied_on_read"]


def copied_on_read(buffer: Any) -> bool:
  """Whether ``buffer``'s host view is a copy of a buffer a caller may write into:
  a numpy array not in C order. Nothing made from such a view is kept across calls."""
  return isinstance(buffer, np.ndarray) and not buffer.flags.c_contiguous


class BufferHomes:
  """Host views and accelerator placement of the buffers of one source set."""

  def __init__(
    self, parts_by_archive: Sequence[_structure.StateParts], buffer: Callable[[Any], Any]
  ):
    self._parts = parts_by_archive
    self._buffer = buffer
    self._host_views: dict[tuple[int, str, int], np.ndarray] = {}
    # Buffers whose host view is a copy: numpy arrays not laid out flat in C
    # order. Their views are made again at every read and never kept, so a write
    # into such an array between two calls is read, as it is through a view.
    self._copied: set[tuple[int, str, int]] = set()
    self._accelerator: dict[tuple[int, str, int], bool] = {}
    # Per archive: whether any of its buffers lives on a GPU/TPU.
    self._archive_on_accelerator: dict[int, bool] = {}

  def host_views(self, keys: Sequence[tuple[int, str, int]]) -> list[np.ndarray]:
    """``host_view`` of each key."""
    views = self._host_views
    return [views[k] if k in views else self.host_view(k) for k in keys]

  def host_view(self, key: tuple[int, str, int]) -> np.ndarray:
    """A buffer's bytes as a flat unsigned numpy view, made once per source set
    (a copy, made at every call, for a numpy array that is not C-contiguous)."""
    view = self._host_views.get(key)
    if view is None:
      buffer = self._buffer(key)
      view = _host_exec.host_bits(buffer)
      if copied_on_read(buffer):
        self._copied.add(key)
      else:
        self._host_views[key] = view
    return view

  @property
  def copies(self) -> bool:
    """Whether a buffer read so far is copied at every read (see ``host_view``):
    what is made from host views must then not be kept across calls."""
    return bool(self._copied)

  def on_accelerator(self, keys: Sequence[tuple[int, str, int]]) -> bool:
    """Whether any of these buffers lives on a GPU/TPU (each looked at once).

    An archive none of whose buffers is on an accelerator answers for all of
    its keys at once: one look at the distinct shardings of its buffers.
    """
    archives = {key[0] for key in keys}
    if not any(self._archive(a) for a in archives):
      return False
    for key in keys:
      hit = self._accelerator.get(key)
      if hit is None:
        x = self._buffer(key)
        hit = self._accelerator[key] = isinstance(x, jax.Array) and any(
          d.platform != "cpu" for d in x.devices()
        )
      if hit:
        return True
    return False

  def on_accelerator_archives(self, archives: Iterable[int]) -> bool:
    """Whether any buffer of these archives lives on a GPU/TPU."""
    return any(self._archive(a) for a in set(archives))

  def _archive(self, archive: int) -> bool:
    hit = self._archive_on_accelerator.get(archive)
    if hit is None:
      types = set()
      for m in self._parts[archive].subtrees:
        types.update(map(type, m.entries.values()))
      if not any(issubclass(t, jax.Array) for t in types):
        self._archive_on_accelerator[archive] = False
        return False
      shardings = {
        id(x.sharding): x.sharding
        for m in self._parts[archive].subtrees
        for x in m.entries.values()
        if isinstance(x, jax.Array)
      }
      hit = self._archive_on_accelerator[archive] = any(
        d.platform != "cpu" for s in shardings.values() for d in s.device_set
      )
    return hit

"""Deferred records in the index: a layout's entry made once, then each rank from its buffers.

A deferred record (``ShardRecord.deferred``, made by the host executor) holds
one packed buffer per dtype and the :class:`Assembly` that says where each
history buffer lies in them; its placements and state are made only when
read. Every target rank of one assembly and world size has the same state
structure, clock, param entries, layout entry and packing; only its rank and
its buffers differ. The first such record is registered leaf by leaf, as any
record (every check the writer makes); what it gave is kept here, and every
later rank of that assembly is registered from its rank and buffers alone,
its buffers written as they are: the same index entry and the same bytes,
with no per-param object made.

``add_ranks`` does the same for the ranks of a global flat-sharded state, whose
records are shapes alone: the first rank is registered leaf by leaf, every
later one from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.assembly import uniform_parts
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.record import RECORD_VERSION
from jaxreshard._src.errors import PlacementError

__all__ = ["DeferredLayouts", "add_ranks"]


@dataclasses.dataclass
class _Known:
  """What the first deferred record of one assembly and world size gave the index."""

  assembly: Any  # held, so that its id is not reused while this entry lives
  layout: int
  clock: int
  describes: dict[str, str]  # the layout and clock digests of ``archive.json``
  block: int  # the param entries' set (``ParamEntries``)
  sizes: dict[np.dtype, int]  # elements of each packed buffer
  tiles: bool  # the writer's packing is the buffers themselves (packing order = layout order)


def _same_buffers(buffers: dict, sizes: dict[np.dtype, int]) -> bool:
  """``buffers`` are flat, contiguous numpy buffers of exactly ``sizes``."""
  if len(buffers) != len(sizes):
    return False
  for d, n in sizes.items():
    b = buffers.get(d)
    if not (
      isinstance(b, np.ndarray)
      and b.dtype == d
      and b.ndim == 1
      and b.size == n
      and b.flags.c_contiguous
    ):
      return False
  return True


def _address(x: np.ndarray) -> int:
  return x.__array_interface__["data"][0]


class DeferredLayouts:
  """The index entries of deferred records, by assembly and world size."""

  def __init__(self):
    self._known: dict[tuple[int, int], _Known] = {}

  def add(self, builder: Any, index: int, record: Any, pack: bool) -> dict | None:
    """Registers archive ``index`` with ``builder`` from its rank and buffers alone, and
    returns its packed buffers (``{}`` unless ``pack``); None when ``record`` is not a
    deferred record of a known assembly (the builder registers it leaf by leaf)."""
    found = uniform_parts(record)
    if found is None or record.version != RECORD_VERSION:
      return None
    parts, rank, world = found
    known = self._known.get((id(parts.assembly), world))
    if (
      known is None
      or known.assembly is not parts.assembly
      or (pack and not known.tiles)
      or not 0 <= rank < world
      or not _same_buffers(parts.buffers, known.sizes)
    ):
      return None
    # What a reader refuses is never written: its padding must hold zero bits
    # (its buffers are the caller's, who may have written into them).
    fault = parts.assembly.nonzero_padding(parts.buffers, rank, world)
    if fault is not None:
      pid, shape, mirror, local = fault
      raise _validate.nonzero_padding(pid, index, mirror, local, FlatShard(shape, rank, world))
    while len(builder.archives) <= index:
      builder.archives.append(None)
    builder.archives[index] = [f"archive_{index:05d}", known.layout, known.clock]
    digest = builder.entries.add_block(index, known.block, rank, world)
    builder.describes[index] = dict(known.describes, placements=digest)
    return dict(parts.buffers) if pack else {}

  def learn(self, builder: Any, index: int, record: Any, packed: dict, pack: bool) -> None:
    """Keeps what archive ``index``, just registered leaf by leaf, gave ``builder``,
    when it is a deferred record (``packed``: the buffers the builder packed)."""
    found = uniform_parts(record)
    if found is None:
      return
    parts, rank, world = found
    sizes = {np.dtype(d): int(np.size(b)) for d, b in parts.buffers.items()}
    last = builder.entries.last
    if len(last) != 1 or last[0][0] != (world, rank) or not _same_buffers(parts.buffers, sizes):
      return
    tiles = pack and len(packed) == len(sizes)
    if tiles:
      for d, b in parts.buffers.items():
        got = packed.get(d)
        tiles = tiles and (
          got is not None
          and got.dtype == b.dtype
          and got.size == b.size
          and got.flags.c_contiguous
          and (b.size == 0 or _address(got) == _address(b))
        )
    _, layout, clock = builder.archives[index]
    describes = {k: v for k, v in builder.describes[index].items() if k != "placements"}
    block = last[0][1]
    self._known[(id(parts.assembly), world)] = _Known(
      parts.assembly, layout, clock, describes, block, sizes, tiles
    )


def add_ranks(builder: Any, ranks: Sequence[int], record_of: Callable[[int], Any]) -> None:
  """Registers archive ``r`` as ``record_of(r)`` with ``builder`` for each ``r`` of
  ``ranks``, which are ranks of one world size whose records differ only in their
  placements' rank (one state of shapes alone, one clock, one set of params): what a
  global flat-sharded state gives every rank. The first is registered leaf by leaf,
  with every check, and the others from it, with nothing made per param: the same
  entries ``add`` makes of each. When the first holds its params at more or less
  than one (world size, rank), each is registered leaf by leaf."""
  ranks = [int(r) for r in ranks]
  if not ranks:
    return
  first = ranks[0]
  builder.add(first, record_of(first), pack=False)
  last = builder.entries.last if builder.entries is not None else []
  if len(last) != 1 or last[0][0][1] != first:
    for r in ranks[1:]:
      builder.add(r, record_of(r), pack=False)
    return
  (world, _), block = last[0]
  _, layout, clock = builder.archives[first]
  describes = builder.describes[first]
  for r in ranks[1:]:
    if not 0 <= r < world:
      raise PlacementError(f"archive {r}: rank {r} is not a rank of world size {world}")
    while len(builder.archives) <= r:
      builder.archives.append(None)
    builder.archives[r] = [f"archive_{r:05d}", layout, clock]
    builder.describes[r] = dict(describes, placements=builder.entries.add_block(r, block, r, world))

"""Plain records of one layout in the index: the first leaf by leaf, the others from it.

The archives one process writes for a save of a state on a mesh (host copies of
its local ranks, ``sharded.host_record``) are plain records that differ only in
their placements' rank, their clock's values and their bytes: one state
structure, one set of roles, one shape and dtype per history buffer, one list of
params. The first is registered leaf by leaf, with every check the writer makes;
what it gave is kept here. A later record of the same structure and exact keys
is checked with a few comparisons and array operations (its placements the
first's but for one rank, its buffers numpy arrays of the first's shapes and
dtypes, its padding zero bits) and registered with the first's layout and param
entries and its own clock. Anything else is registered leaf by leaf, so every refusal keeps its
words (a record with nonzero padding is passed on, and refused there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import storable as _storable
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord, deferred_parts
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["PlainLayouts"]


@dataclasses.dataclass
class _Known:
  """What the first plain record of one structure gave the index."""

  roles: tuple[Any, ...]
  history: tuple[int, ...]  # the leaves that are history buffers
  shapes: list[tuple[tuple[int, ...], np.dtype]]  # theirs, in leaf order
  keys: list[tuple]  # each placement but its rank (``_key``), in order
  world: int
  layout: int
  block: int  # the param entries' set (``ParamEntries``)
  layout_digest: str
  # Per dtype: the leaves packed, in packing order, and each one's offset, slots
  # and its param's element count (int64 arrays).
  packing: dict[np.dtype, tuple[list[int], np.ndarray, np.ndarray, np.ndarray]]


def _key(p: Any) -> tuple:
  """A placement but its rank: what every rank of one layout shares. The types of every
  field and of each dimension are part of it: ``(10.0,)`` equals ``(10,)`` and
  ``True`` equals ``1``, but the leaf-by-leaf checks refuse a float dimension and a
  trainability that is no bool, and an index keys its entries by hash."""
  return (
    type(p),
    type(p.param),
    p.param,
    type(p.shape),
    tuple(map(type, p.shape)) if type(p.shape) is tuple else None,
    p.shape,
    type(p.dtype),
    p.dtype,
    type(p.trainable),
    bool(p.trainable),
    type(p.world_size),
    p.world_size,
    type(p.rank),
  )


def _one_rank(placements: Any, world: int) -> int | None:
  ranks = {p.rank for p in placements}
  if len(ranks) != 1:
    return None
  rank = ranks.pop()
  return rank if type(rank) is int and 0 <= rank < world else None


class PlainLayouts:
  """The index entries of plain records, by tree structure."""

  def __init__(self):
    self._known: dict[Any, _Known] = {}

  def add(
    self, builder: Any, index: int, record: Any, pack: Callable[[list, np.dtype], np.ndarray]
  ) -> dict[np.dtype, np.ndarray] | None:
    """Registers archive ``index`` with ``builder`` from the first record of its structure,
    and returns its packed buffers (``pack`` of each dtype's buffers in packing order);
    None when ``record`` is not a plain record of a known structure whose checks pass
    (it goes leaf by leaf)."""
    if not self._known or builder.source is not None or not _plain(record):
      return None
    leaves, treedef = jax.tree_util.tree_flatten(record.state)
    known = self._known.get(treedef)
    # jax takes a structure keyed True as one keyed 1 (``storable.exact_keys``): it is
    # the first's only when every key is exactly a str, an int or a tuple of those.
    if known is None or record.roles != known.roles or not _storable.exact_keys(record.state):
      return None
    history = [leaves[i] for i in known.history]
    if any(type(x) is not np.ndarray for x in history):
      return None
    if [(x.shape, x.dtype) for x in history] != known.shapes:
      return None
    placements = record.placements
    if type(placements) is not tuple or len(placements) != len(known.keys):
      return None
    rank = _one_rank(placements, known.world)
    if rank is None or [_key(p) for p in placements] != known.keys:
      return None
    packed = {d: pack([leaves[i] for i in at], d) for d, (at, *_) in known.packing.items()}
    if _nonzero_padding(packed, known, rank):
      return None
    clock, clock_digest = builder.register_clock(index, leaves, known.roles)
    while len(builder.archives) <= index:
      builder.archives.append(None)
    builder.archives[index] = [f"archive_{index:05d}", known.layout, clock]
    digest = builder.entries.add_block(index, known.block, rank, known.world)
    builder.describes[index] = {
      "layout": known.layout_digest,
      "clock": clock_digest,
      "placements": digest,
    }
    return packed

  def learn(self, builder: Any, index: int, record: Any, pack: bool) -> None:
    """Keeps what archive ``index``, just registered leaf by leaf, gave ``builder``, when
    it was packed and is a plain record of numpy history buffers at one rank."""
    if not pack or builder.source is not None or not _plain(record):
      return
    leaves, treedef = jax.tree_util.tree_flatten(record.state)
    roles = record.roles
    history = tuple(i for i, r in enumerate(roles) if r is not None)
    if any(type(leaves[i]) is not np.ndarray for i in history):
      return
    where = {id(leaves[i]): i for i in history}
    if len(where) != len(history):
      return  # one array at two places: nothing says which place a packed piece is
    placements = record.placements
    world = placements[0].world_size if placements else None
    if type(world) is not int or type(placements) is not tuple:
      return
    rank = _one_rank(placements, world)
    last = builder.entries.last
    if rank is None or len(last) != 1 or last[0][0] != (world, rank):
      return
    state_parts = _structure.state_parts(record.state, roles, [p.param for p in placements])
    count = {p.param: math.prod(p.shape) for p in placements}
    order: dict[np.dtype, list[tuple[int, int]]] = {}
    for pid, _m, buf in _copyplan.packing_order(
      {pid: state_parts.history(pid) for pid in state_parts.param_set()}
    ):
      order.setdefault(np.dtype(buf.dtype), []).append((where[id(buf)], count[pid]))
    packing = {}
    for dtype, entries in order.items():
      at = [i for i, _ in entries]
      slots = np.asarray([leaves[i].size for i in at], np.int64)
      offset = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
      packing[dtype] = (at, offset, slots, np.asarray([c for _, c in entries], np.int64))
    _, layout, _ = builder.archives[index]
    self._known[treedef] = _Known(
      roles,
      history,
      [(leaves[i].shape, leaves[i].dtype) for i in history],
      [_key(p) for p in placements],
      world,
      layout,
      last[0][1],
      builder.describes[index]["layout"],
      packing,
    )


def _plain(record: Any) -> bool:
  """A record built with its fields, of this record version, with recorded roles."""
  return (
    type(record) is ShardRecord
    and deferred_parts(record) is None
    and type(record.version) is int
    and record.version == RECORD_VERSION
    and type(record.roles) is tuple
    and all(type(p) is ParamPlacement for p in record.placements)
  )


def _nonzero_padding(packed: dict[np.dtype, np.ndarray], known: _Known, rank: int) -> bool:
  """Whether any packed buffer holds nonzero bits past the elements ``rank`` owns."""
  for dtype, (_, offset, slots, count) in known.packing.items():
    owned = np.clip((rank + 1) * slots, 0, count) - np.clip(rank * slots, 0, count)
    length = slots - owned
    total = int(length.sum())
    if total:
      # Every padding element's place: each span's start, then the steps within it.
      start = offset + owned
      at = np.repeat(start - (np.cumsum(length) - length), length) + np.arange(total)
      if _bitview.bits(packed[dtype])[at].any():
        return True
  return False

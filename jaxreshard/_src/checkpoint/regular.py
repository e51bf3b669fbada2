"""A regular checkpoint's plans of target ranks, made from the index's arrays.

A checkpoint is *regular* when every group of its index is complete (one
archive per rank), no param id is in two groups, every archive is in one
group, every archive of a group has one layout and one clock, every history
buffer has its group's slots, every param its layout holds a history for is
in its group, every storage and buffer dtype is one jaxreshard copies, and all
groups share one optimizer clock. Then validating the migrations of a target
rank (``pipeline.validate`` of ``reshard.plan_groups`` of the checkpoint's
complete groups) can refuse nothing but the target's own rank and world size,
and its result follows from a few arrays per parameter, made once
(``Regular``); each target rank then costs array operations and one
``Migration`` per parameter, not a validation of each.

Whatever is not regular (a check above fails, however rarely) takes the
general path, which refuses with its own words or plans it the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import groups as _groups
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import SUPPORTED_DTYPES, Migration
from jaxreshard._src.core.structure import MASKED
from jaxreshard._src.errors import PlacementError, ReshardError

__all__ = ["Regular", "make", "rank_groups", "regular"]


@dataclasses.dataclass(frozen=True)
class Regular:
  """What every target rank of a regular checkpoint shares, one row per param, sorted by id.

  Attributes:
    entry: the param entry of each row.
    group: its group; count, src_slots, src_world: its flat source layout.
    itemsize: the bytes one element of the param takes over all its history buffers.
    by_rank: per group, the archive holding each rank (a tuple, and as an array).
    layout: per group, the layout of its archives.
    clock: the optimizer clock class every archive shares.
  """

  index: Any
  entry: np.ndarray
  group: np.ndarray
  count: np.ndarray
  src_slots: np.ndarray
  src_world: np.ndarray
  itemsize: np.ndarray
  pattern: np.ndarray  # per row, its history's index into ``patterns``
  patterns: tuple  # (history, buffer dtypes) tuples as ``SourceFacts`` holds them
  by_rank: tuple
  by_rank_array: tuple
  layout: np.ndarray
  clock: int

  @property
  def pids(self) -> list[str]:
    t = self.index.tables
    return [t.pids[n] for n in t.p_name[self.entry].tolist()]

  @functools.cached_property
  def shapes(self) -> list[tuple[int, ...]]:
    t = self.index.tables
    at, dims = t.p_dims_at, t.p_dims
    ndim = at[self.entry + 1] - at[self.entry]
    if (ndim == 1).all():  # vectors: one dim each
      return list(zip(dims[at[self.entry]].tolist()))
    flat = dims.tolist()
    return [tuple(flat[s : s + k]) for s, k in zip(at[self.entry].tolist(), ndim.tolist())]

  @functools.cached_property
  def facts(self) -> tuple[_validate.SourceFacts, ...]:
    """The validated facts of every row, as the general path makes them."""
    t = self.index.tables
    dtypes = t.dtypes
    out = []
    make = FlatShard.of_checked_shape
    for pid, shape, n, g, w, d, tr, pat in zip(
      self.pids,
      self.shapes,
      self.count.tolist(),
      self.group.tolist(),
      self.src_world.tolist(),
      t.p_dtype[self.entry].tolist(),
      t.p_trainable[self.entry].tolist(),
      self.pattern.tolist(),
    ):
      history, buffer_dtypes = self.patterns[pat]
      out.append(
        _validate.SourceFacts(
          pid,
          shape,
          make(shape, n, 0, w),
          self.by_rank[g],
          dtypes[d],
          tr,
          history,
          buffer_dtypes,
          self.clock,
        )
      )
    return tuple(out)


def regular(ckpt: Any) -> Regular | None:
  """The checkpoint's ``Regular``, or None when it is not regular: made once and kept
  by the checkpoint (``Checkpoint.regular``)."""
  return ckpt.regular()


_STORAGE = frozenset(np.dtype(jax.numpy.dtype(n)) for n in SUPPORTED_DTYPES)


def _copied(d: np.dtype) -> bool:
  """A buffer dtype validation accepts (``check_buffer_dtype``)."""
  return d in _STORAGE or (d.name == "float64" and jax.config.jax_enable_x64)


def histories(
  index: Any, group_layout: np.ndarray, name: np.ndarray, group: np.ndarray, slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
  """Per row (param), its history buffers' dtype codes (-1 masked, -2 none) and their
  summed item size; None when a buffer lacks its group's slots or a copied dtype, a
  group lacks a param its layout holds, or the layouts differ in their mirrors."""
  t = index.tables
  n_m = {index.layouts[L].n_mirrors for L in set(group_layout.tolist())}
  if len(n_m) != 1:
    return None
  (n_m,) = n_m
  itemsize = np.zeros(len(name), np.int64)
  hist = np.full((len(name), n_m), -2, np.int64)
  isz = np.asarray([d.itemsize for d in t.dtypes], np.int64)
  copied = np.asarray([_copied(d) for d in t.dtypes], bool)
  for L in set(group_layout.tolist()):
    cols = index.layouts[L].columns
    rows = np.flatnonzero(group_layout[group] == L)
    at = cols.rows_of(name[rows])
    held = at >= 0
    h, hs = cols.hist[at[held]], cols.hist_slots[at[held]]
    buf = h >= 0
    # Every buffer has its group's slots and a dtype validation copies.
    if (buf & (hs != slots[rows[held]][:, None])).any() or not copied[h[buf]].all():
      return None
    hist[rows[held]] = h
    itemsize[rows[held]] = np.where(buf, isz[np.maximum(h, 0)], 0).sum(axis=1)
    # Every param the layout holds a history for is in each of its groups.
    for g in _copyplan.unique_ints(group[rows]).tolist():
      if not np.isin(cols.names, name[group == g]).all():  # one the group lacks
        return None
  return hist, itemsize


def make(ckpt: Any) -> Regular | None:
  """The checkpoint's ``Regular`` made from its index, or None when it is not regular."""
  index = ckpt.index
  t = index.tables
  n_g, n_a = len(t.g_world), len(t.a_layout)
  if not n_g:
    return None
  of_pair = np.repeat(np.arange(n_g), np.diff(t.g_ranks_at))
  # Every group complete: each of its ranks held by exactly one of its pairs.
  key = t.g_rank + np.concatenate([[0], np.cumsum(t.g_world)[:-1]])[of_pair]
  if (
    len(t.g_rank) != int(t.g_world.sum())
    or not (np.bincount(key, minlength=len(t.g_rank)) == 1).all()
  ):
    return None
  # Every archive in exactly one group; a group's archives share a layout and a clock.
  if not (np.bincount(t.g_archive, minlength=n_a) == 1).all():
    return None
  layout_of, clock_of = t.a_layout[t.g_archive], t.a_clock[t.g_archive]
  first = t.g_ranks_at[:-1]
  if (layout_of != layout_of[first][of_pair]).any() or (clock_of != clock_of[first][of_pair]).any():
    return None
  group_layout = layout_of[first]
  # A param id in one group only; rows sorted by id (the names are sorted).
  of_param = np.repeat(np.arange(n_g), np.diff(t.g_params_at))
  entry = t.g_params
  name = t.p_name[entry]
  order = np.argsort(name, kind="stable")
  entry, name, group = entry[order], name[order], of_param[order]
  if (name[1:] == name[:-1]).any():
    return None
  # Storage dtypes.
  storage = np.asarray([d in _STORAGE for d in t.dtypes], bool)
  if len(entry) and not storage[t.p_dtype[entry]].all():
    return None
  count, world = t.p_count[entry], t.g_world[group]
  slots = -(-count // world)
  found = histories(index, group_layout, name, group, slots)
  if found is None:
    return None
  hist, itemsize = found
  # One optimizer clock class for every group (a layout that cannot say its class is
  # refused by the general path, in its own order).
  try:
    clocks = {ckpt.clock_class(int(t.g_archive[first[g]])) for g in range(n_g)}
  except ReshardError:
    return None
  if len(clocks) != 1:
    return None
  codes, pattern = np.unique(hist, axis=0, return_inverse=True)
  marks = {-2: None, -1: MASKED}
  patterns = tuple(
    (
      tuple(True if c >= 0 else marks[c] for c in row),
      tuple(t.dtypes[c] if c >= 0 else None for c in row),
    )
    for row in codes.tolist()
  )
  by_rank, arrays = [], []
  for g in range(n_g):
    a = np.empty(int(t.g_world[g]), np.int64)
    archive, rank = t.group_ranks(g)
    a[rank] = archive
    arrays.append(a)
    by_rank.append(tuple(a.tolist()))
  return Regular(
    index,
    entry,
    group,
    count,
    slots,
    world,
    itemsize,
    pattern.reshape(-1),
    patterns,
    tuple(by_rank),
    tuple(arrays),
    group_layout,
    clocks.pop(),
  )


def check_target(world_size: Any, rank: Any) -> tuple[int, int]:
  """A target rank and world size, refused as ``plan_groups`` refuses them."""
  FlatShard((), rank, world_size)
  return operator.index(rank), operator.index(world_size)


def target_geometry(
  count: np.ndarray, rank: int, world: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(slots, start, stop)`` of target ``rank`` of ``world`` for each count, clipped as
  ``Groups`` clips them."""
  slots = -(-count // world)
  if len(count) and int(count.max()) >= 1 << 61:
    # ``(rank + 1) * slots`` may pass 2**63 before it is clipped: Python ints.
    rows = list(zip(slots.tolist(), count.tolist()))
    start = np.asarray([min(rank * s, c) for s, c in rows], np.int64)
    stop = np.asarray([min((rank + 1) * s, c) for s, c in rows], np.int64)
    return slots, start, stop
  return slots, np.minimum(rank * slots, count), np.minimum((rank + 1) * slots, count)


def rank_groups(
  reg: Regular, world_size: int, rank: int, families: dict | None = None
) -> _groups.Groups:
  """The validated groups of target ``rank`` of ``world_size`` (checked by ``check_target``).

  ``families``: ``world size -> _groups.Family`` of ``reg``'s checkpoint, kept by its
  owner: every target rank of one world size then shares one family, and with it the
  layout, record structure and copy plans the pipeline keeps there. Its rows are
  made and checked with the first rank's migrations; a later rank's migrations
  differ from those in their rank alone and are made when read.
  """
  family = None if families is None else families.get(world_size)
  if family is not None:
    return family.recent(
      ("groups", rank), lambda: family.table(_RankMigrations(reg, rank, world_size), rank)
    )
  n = len(reg.entry)
  migrations = _migrations(reg, world_size, rank)
  groups = _groups.Groups(
    migrations,
    reg.facts,
    columns=(reg.count, reg.src_slots, reg.src_world, np.full(n, rank), np.full(n, world_size)),
  )
  if not groups:
    raise PlacementError("no migrations: a target rank needs at least one parameter")
  if families is None:
    return groups
  family = families.setdefault(world_size, _groups.Family(groups, world_size))
  return family.recent(("groups", rank), lambda: family.table(migrations, rank))


def _migrations(reg: Regular, world_size: int, rank: int) -> list[Migration]:
  n = len(reg.entry)
  return list(
    map(
      Migration.checked,
      reg.pids,
      reg.shapes,
      [rank] * n,
      [world_size] * n,
      [reg.by_rank[g] for g in reg.group.tolist()],
    )
  )


class _RankMigrations(Sequence):
  """One target rank's migrations of a regular checkpoint, each made when read."""

  def __init__(self, reg: Regular, rank: int, world_size: int):
    self._reg, self._rank, self._world = reg, rank, world_size

  def __len__(self) -> int:
    return len(self._reg.entry)

  def __getitem__(self, i: Any) -> Any:
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    reg = self._reg
    t = reg.index.tables
    return Migration.checked(
      t.pids[int(t.p_name[reg.entry[i]])],
      reg.shapes[i],
      self._rank,
      self._world,
      reg.by_rank[int(reg.group[i])],
    )

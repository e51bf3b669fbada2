"""Validated migrations of one target rank as a table: one row per parameter.

Validation checks each migration against its sources' facts (made once per
source group and shared by every target rank) and the target geometry of all
rows at once. The result keeps the geometry as int64 columns, so planning and
the padding checks read arrays; a row is a :class:`SourceGroup` only when one
is asked for by index.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE, FlatShard
from jaxreshard._src.core.placement import Migration

__all__ = ["Family", "Groups", "SourceFacts", "SourceGroup", "clipped", "targets_checked"]

# Below this element count, ``(rank + 1) * slots`` (at most about twice the
# count) cannot overflow int64.
_EXACT_PRODUCTS = 1 << 61


class SourceFacts(NamedTuple):
  """The validated source side of one parameter's group; no target yet.

  Immutable, and a named tuple rather than a frozen dataclass: a checkpoint's
  group makes one per parameter, and a frozen dataclass sets each field
  through ``object.__setattr__``.
  """

  param: str
  shape: tuple[int, ...]
  source: FlatShard  # rank 0 of the source layout (slots, count)
  by_rank: tuple[int, ...]  # archive index holding each original rank
  dtype: np.dtype
  trainable: bool
  history: tuple[Any, ...]  # per mirror: MASKED, None (absent) or True (a buffer)
  buffer_dtypes: tuple[np.dtype | None, ...]  # per mirror: the buffer's dtype
  clock: int  # clock class shared by every source


@dataclasses.dataclass(frozen=True)
class SourceGroup:
  """A validated migration: the target geometry and its sources' facts."""

  migration: Migration
  target: FlatShard
  facts: SourceFacts

  @property
  def param(self) -> str:
    return self.facts.param

  @property
  def source(self) -> FlatShard:
    return self.facts.source

  @property
  def by_rank(self) -> tuple[int, ...]:
    return self.facts.by_rank

  @property
  def dtype(self) -> np.dtype:
    return self.facts.dtype

  @property
  def trainable(self) -> bool:
    return self.facts.trainable

  @property
  def history(self) -> tuple[Any, ...]:
    return self.facts.history

  @property
  def buffer_dtypes(self) -> tuple[np.dtype | None, ...]:
    return self.facts.buffer_dtypes


class Groups(Sequence):
  """Validated groups of one target rank, sorted by param id.

  Attributes:
    migrations: the migrations, one per row.
    facts: their sources' validated facts, one per row.
    count, rank, world, slots, start, stop: the target geometry per row
      (``FlatShard``'s fields, clipped as it clips them).
    src_slots, src_world: each row's source layout (slots per rank, ranks).
  """

  # The ranks' shared rows, for a table made by ``Family.table``; None otherwise.
  family: Family | None = None

  def __init__(
    self,
    migrations: Sequence[Migration],
    facts: Sequence[SourceFacts],
    *,
    columns: tuple[np.ndarray, ...] | None = None,
  ):
    """``columns``: ``(count, src_slots, src_world, rank, world)`` of the rows, when the
    caller has them as arrays already (a checkpoint's index); read off the rows otherwise."""
    n = len(facts)
    self.migrations = tuple(migrations)
    self.facts = tuple(facts)
    if columns is not None:
      self.count, self.src_slots, self.src_world, self.rank, self.world = (
        np.asarray(c, np.int64) for c in columns
      )
    else:
      sources = np.array(
        [(s.count, s.slots, s.world_size) for s in (f.source for f in facts)], np.int64
      ).reshape(n, 3)
      # ``operator.index``, as the geometry check reads them (numpy would call
      # ``__int__``, which an int-like type may answer differently).
      index = operator.index
      targets = np.array(
        [(index(m.rank), index(m.world_size)) for m in migrations], np.int64
      ).reshape(n, 2)
      self.count, self.src_slots, self.src_world = sources.T.copy()
      self.rank, self.world = targets.T.copy()
    self.slots = -(-self.count // self.world)
    if n and int(self.count.max()) >= _EXACT_PRODUCTS:
      # ``(rank + 1) * slots`` may pass 2**63 before it is clipped: Python ints.
      rows = list(zip(self.rank.tolist(), self.slots.tolist(), self.count.tolist()))
      self.start = np.asarray([min(r * s, c) for r, s, c in rows], np.int64)
      self.stop = np.asarray([min((r + 1) * s, c) for r, s, c in rows], np.int64)
    else:
      self.start = np.minimum(self.rank * self.slots, self.count)
      self.stop = np.minimum((self.rank + 1) * self.slots, self.count)
    # ``by_rank`` as an array, by the tuple's id; at -1 the id of each row's tuple.
    self._archives: dict[int, tuple[tuple, np.ndarray]] = {}

  def __len__(self) -> int:
    return len(self.facts)

  def __getitem__(self, i: Any) -> Any:
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    m, f = self.migrations[i], self.facts[i]
    return SourceGroup(
      m, FlatShard.of_checked_shape(f.shape, f.source.count, m.rank, m.world_size), f
    )

  @property
  def params(self) -> list[str]:
    return [f.param for f in self.facts]

  def archives(self, row: np.ndarray, source_rank: np.ndarray) -> np.ndarray:
    """The archive holding source rank ``source_rank[i]`` of row ``row[i]``, for all i.

    Rows of one source group share one ``by_rank`` tuple, turned into an
    array once per table.
    """
    out = np.empty(len(row), np.int64)
    if not len(row):
      return out
    # Which ``by_rank`` tuple each row has, by identity: made once for the facts,
    # which every target rank of a family shares (kept beside the arrays).
    memo = self._archives.get(-1)
    if memo is None or memo[0] is not self.facts:
      facts = self.facts
      ids = np.fromiter((id(f.by_rank) for f in facts), np.int64, len(facts))
      memo = self._archives[-1] = (facts, ids)
    which = memo[1][row]
    for t in _copyplan.unique_ints(which).tolist():
      hit = self._archives.get(t)
      if hit is None:
        g = int(row[np.argmax(which == t)])
        by_rank = self.facts[g].by_rank
        hit = self._archives[t] = (by_rank, np.asarray(by_rank, np.int64))
      sel = which == t
      out[sel] = hit[1][source_rank[sel]]
    return out


class Family:
  """The rows every target rank of one world size shares, validated once for them all.

  Made from one validated table whose rows all have one target world size;
  the table of any rank of that world (``table``) then takes its facts and
  columns, and only its rank differs. What is made once per layout for every
  rank (the packed layout, the record's structure, copy tables) is kept in
  ``memo``, owned by the family.
  """

  def __init__(self, table: Groups, world: int):
    self.world = world
    self.facts = table.facts
    self.count, self.src_slots, self.src_world = table.count, table.src_slots, table.src_world
    self.slots = table.slots
    self.worlds = table.world
    self.archives_memo = table._archives
    self.memo: dict[Any, Any] = {}
    self._lock = threading.Lock()

  def table(self, migrations: Sequence[Migration], rank: int) -> Groups:
    """The validated table of ``migrations``: this family's rows, all at target ``rank``.

    A list is kept as a tuple; any other sequence (one that makes each migration
    when read) is kept as given.
    """
    if isinstance(migrations, list):
      migrations = tuple(migrations)
    return _RankGroups(self, migrations, rank)

  # Per-rank values of one kind kept by ``recent``, at most this many.
  RECENT = 16

  def recent(self, key: tuple, make: Any) -> Any:
    """A per-rank value made by ``make()``, kept for the ``RECENT`` latest keys of its
    kind (``key[0]``): each kind keeps its own, so a rank's several values (its
    runs, its padding plan, its placements) never push out those of the other
    ranks a caller cycles through."""
    with self._lock:
      recent = self.memo.setdefault(("recent", key[0]), collections.OrderedDict())
      value = recent.get(key)
      if value is not None:
        recent.move_to_end(key)
        return value
    value = make()
    with self._lock:
      recent[key] = value
      while len(recent) > self.RECENT:
        recent.popitem(last=False)
    return value

  def remember(self, key: Any, make: Any) -> Any:
    """``memo[key]``, made by ``make()`` on first use."""
    value = self.memo.get(key)
    if value is None:
      value = self.memo.setdefault(key, make())
    return value


class _RankGroups(Groups):
  """One target rank's table of a :class:`Family`: the family's columns, and its
  rank's columns made when first read (a plan of every rank reads none)."""

  def __init__(self, family: Family, migrations: Sequence[Migration], rank: int):
    self.family = family
    self.uniform_rank = rank
    self.migrations = migrations
    self.facts = family.facts
    self.count, self.src_slots, self.src_world = family.count, family.src_slots, family.src_world
    self.slots, self.world = family.slots, family.worlds
    self._archives = family.archives_memo

  @functools.cached_property
  def rank(self) -> np.ndarray:
    return np.full(len(self.facts), self.uniform_rank, np.int64)

  @functools.cached_property
  def start(self) -> np.ndarray:
    return clipped(self.uniform_rank, self.slots, self.count)

  @functools.cached_property
  def stop(self) -> np.ndarray:
    return clipped(self.uniform_rank + 1, self.slots, self.count)


def clipped(k: int, slots: np.ndarray, count: np.ndarray) -> np.ndarray:
  """``min(k * slots, count)`` per row, exact for any int64 count."""
  if len(count) and int(count.max()) >= _EXACT_PRODUCTS:
    return np.asarray([min(k * s, c) for s, c in zip(slots.tolist(), count.tolist())], np.int64)
  return np.minimum(k * slots, count)


def targets_checked(migrations: Sequence[Migration]) -> bool:
  """Whether every target rank and world size is an int with ``0 <= rank <
  world_size <= MAX_WORLD_SIZE``, checked for all migrations at once. When
  not, the caller checks each migration's geometry on its own, which names the
  first refusal (or accepts integers of other types)."""
  pairs = [(m.rank, m.world_size) for m in migrations]
  if not all(type(r) is int and type(w) is int for r, w in pairs):
    return False
  try:
    rank, world = np.array(pairs, np.int64).reshape(len(pairs), 2).T
  except OverflowError:
    return False
  return not ((world < 1) | (world > MAX_WORLD_SIZE) | (rank < 0) | (rank >= world)).any()

"""What an opened checkpoint learns of its index as the pipeline asks it.

Everything here is made from the index a ``Checkpoint`` read and checked when
it was opened, never from an archive's files, and is kept by that one object
for its life: a checkpoint opened again learns it all again from the index it
reads then.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxreshard._src.checkpoint import groupfacts as _groupfacts
from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint.index import _TWICE, Index
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.errors import PlacementError

__all__ = ["Memo", "archive_params", "complete_groups"]

_UNSET = object()


class Memo:
  """A ``Checkpoint``'s answers to what validation asks of its index, each made once.

  Attributes:
    facts_cache: facts of params outside uniform groups.
    group_facts: facts of the params of each uniform group, by group, then param.
    uniform: whether each group is uniform (``is_uniform``).
    complete: ``complete_groups``' answer.
    group_of: each param's (archive of each rank, group), from ``complete_groups``.
    clock_classes: the clock class of each (layout, clock).
    by_archive: ``param id -> (group, rank, param entry)`` of archives in several groups.
    families: ``world size -> _groups.Family`` of a regular checkpoint's target ranks
      (``_regular.rank_groups``): what the pipeline makes once for every rank of a world
      size (target layout, record structure) and for each of its latest ranks (the
      validated table, copy runs, placements), made from the index alone.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self.facts_cache = _sources.FactsCache()
    self.group_facts: dict = {}
    self.uniform: dict = {}
    self.complete: list | None = None
    self.group_of: dict = {}
    self.clock_classes = _clock.ClockClasses()
    self.by_archive: dict = {}
    self.families: dict = {}
    self._regular: Any = _UNSET

  def regular(self, ckpt: Any) -> _regular.Regular | None:
    """The checkpoint's ``Regular``, or None when it is not regular."""
    if self._regular is _UNSET:
      self._regular = _regular.make(ckpt)
    return self._regular

  def archive_params(self, index: Index, archive: int) -> dict[str, Any]:
    """``param id -> (group, rank, param entry)`` of an archive in several groups (or
    ``_TWICE``): a lookup then costs O(1), not time in the groups."""
    out = self.by_archive.get(archive)
    if out is None:
      out = self.by_archive[archive] = archive_params(index, archive)
    return out

  def complete_groups(self, index: Index) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(param, shape, archive of each rank) of every param, from the groups alone."""
    with self._lock:
      if self.complete is not None:
        return self.complete
    out, group_of = complete_groups(index)
    with self._lock:
      self.complete, self.group_of = out, group_of
    return out

  def facts(self, ckpt: Any, pid: str, sources: tuple) -> _validate.SourceFacts:
    hit = self.group_of.get(pid)
    if (
      hit is not None and (hit[0] is sources or hit[0] == sources) and self.is_uniform(ckpt, hit[1])
    ):
      # A uniform group's facts are made for all its params at once (``group_facts``);
      # a param refused there is asked again alone, for its own refusal.
      table = self.group_facts.get(hit[1])
      if table is None:
        table = self.group_facts[hit[1]] = _groupfacts.group_facts(ckpt, hit[1], hit[0])
      facts = table.get(pid)
      return facts if facts is not None else _groupfacts.uniform_facts(ckpt, hit[1], pid, sources)
    with self._lock:
      return self.facts_cache.facts(pid, sources, ckpt)

  def is_uniform(self, ckpt: Any, gi: int) -> bool:
    """Every archive of the group has one layout and clock, with the group's slots."""
    u = self.uniform.get(gi)
    if u is None:
      # A regular checkpoint's groups are all uniform (``_regular``), checked with arrays.
      u = (
        _regular.regular(ckpt) is not None
        or _groupfacts.uniform_by_tables(ckpt, gi)
        or _groupfacts.is_uniform(ckpt, gi)
      )
      self.uniform[gi] = u
    return u


def archive_params(index: Index, archive: int) -> dict[str, Any]:
  """``param id -> (group, rank, param entry)`` of an archive (``_TWICE`` for a param
  two of its groups list)."""
  out: dict[str, Any] = {}
  for gi, rank in index.member[archive]:
    for pid, p in index.param_index[gi].items():
      out[pid] = _TWICE if pid in out else (gi, rank, p)
  return out


def complete_groups(index: Index) -> tuple[list, dict]:
  """(param, shape, archive of each rank) of every param, from the groups alone, and
  the ``(archive of each rank, group)`` of each param one group holds; an incomplete
  group is refused.

  The rule and its messages are those of records in memory (``_sources.complete_groups``),
  params in sorted order: a param listed by several groups (archives of different
  saves, dtypes or trainability) is one group of all its archives, whose world sizes
  and shapes must agree and whose ranks must be complete; what else differs is
  refused by its facts, as in memory.
  """
  held: dict[str, list[tuple[int, int]]] = {}  # param -> (group, param entry) of each holder
  for gi, g in enumerate(index.groups):
    for p in g.params:
      held.setdefault(index.params[p].param, []).append((gi, p))
  by_group: dict[int, tuple[int, ...]] = {}
  out, group_of = [], {}
  for pid in sorted(held):
    holders = held[pid]
    if len(holders) == 1:
      gi, p = holders[0]
      by_rank = by_group.get(gi)
      if by_rank is None:
        g = index.groups[gi]
        by_rank = by_group[gi] = _validate.rank_sources(pid, g.world_size, g.ranks)
      group_of[pid] = (by_rank, gi)
      out.append((pid, index.params[p].shape, by_rank))
      continue
    entries = sorted(
      (a, r, index.params[p].shape, index.groups[gi].world_size)
      for gi, p in holders
      for a, r in index.groups[gi].ranks
    )
    twice = [a for (a, *_), (b, *_) in zip(entries, entries[1:]) if a == b]
    if twice:
      raise _validate.listed_twice(pid, twice[0])
    first_archive, _, shape, world = entries[0]
    for a, _, s, w in entries:
      if (s, w) != (shape, world):
        raise PlacementError(
          f"param {pid!r}: archive {a} has shape {s} over world_size {w} but archive"
          f" {first_archive} has {shape} over {world}; pass explicit migrations to pick one group"
        )
    out.append((pid, shape, _validate.rank_sources(pid, world, ((a, r) for a, r, _, _ in entries))))
  return out, group_of

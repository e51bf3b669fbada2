"""Source archives in memory, validated once and remembered while they live.

A :class:`RecordSources` holds what the pipeline learns about one list of
``ShardRecord``s: each archive's state parts and placements, its clock class, and
the validated source side of every (param, sources) group. Resharding rank
after rank over the same records asks :func:`record_sources` for them again;
it answers from :data:`CACHE`, which is keyed by the records' identities and
drops an entry as soon as one of its records is garbage collected, so it never
keeps records alive, and takes the records apart afresh when one changed since
(a buffer or clock scalar replaced in a container of its state, a key added or
removed, a field of the record set: ``recordguard``). What is remembered is
what the records were when first looked at: their structure, placements and
clock scalars (numpy ones copied then). Only the values of history buffers are
read as they are at each call: host views of them, never copies, are kept (a
strided numpy buffer, whose host view is a copy, is copied again per call).
Those views are of the memory each buffer viewed when first looked at, as it
viewed it: a shape, dtype or strides set in place later on a numpy buffer, or a
jax buffer deleted, may not be seen (looking would cost a check per leaf per call).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.gcpause import no_gc
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.engine import plans as _plans
from jaxreshard._src.engine import stacks as _stacks
from jaxreshard._src.engine.caches import FactsCache, RecentByObject, sources_key  # noqa: F401  (re-exported)
from jaxreshard._src.engine.homes import BufferHomes
from jaxreshard._src.engine.recordguard import RecordGuard
from jaxreshard._src.errors import PlacementError

__all__ = [
  "Sources",
  "MemorySources",
  "FactsCache",
  "RecentByObject",
  "RecordSources",
  "SourceCache",
  "CACHE",
  "record_sources",
  "complete_groups",
]


@runtime_checkable
class Sources(_validate.Sources, Protocol):
  """What the pipeline reads of a list of source archives, wherever they live.

  Validation's questions (``_validate.Sources``), the clock's (``skeleton``,
  ``scalars``), the groups of ``plan``, the record template, and where each
  history buffer lies (``locate``). Records in memory (:class:`RecordSources`)
  and a checkpoint on disk (``Checkpoint``) both answer them.
  """

  def skeleton(self, archive: int) -> tuple[Any, ...]: ...
  def scalars(self, archive: int) -> list[Any]: ...
  def template(self, archive: int) -> _structure.StateParts: ...
  def facts(self, pid: str, sources: tuple) -> _validate.SourceFacts: ...
  def complete_groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]: ...
  def locate_runs(
    self, groups: Any, archive: np.ndarray, group: np.ndarray, subtree: np.ndarray, dtype: np.dtype
  ) -> tuple[np.ndarray, np.ndarray, list[Any]]: ...


@runtime_checkable
class MemorySources(Sources, Protocol):
  """Sources whose history buffers are arrays in memory, read by ``memory_fetch``."""

  def packing(self, archive: int) -> list[tuple[str, int, Any]]: ...
  def buffer(self, key: Any) -> Any: ...
  def buffers(self, keys: Sequence[Any]) -> list[Any]: ...
  def host_view(self, key: Any) -> np.ndarray: ...
  def host_views(self, keys: Sequence[Any]) -> list[np.ndarray]: ...
  def on_accelerator(self, keys: Sequence[Any]) -> bool: ...
  def on_accelerator_archives(self, archives: Iterable[int]) -> bool: ...


def complete_groups(
  placements: Sequence[Any], n: int
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
  """For every param the archives list: (param, shape, archive of each original rank).

  Args:
    placements: ``archive -> iterable of ParamPlacement``.
    n: number of archives.

  Raises:
    PlacementError: a parameter whose archives are not exactly one complete group.
  """
  groups: dict[str, list[tuple[int, ParamPlacement]]] = {}
  for i in range(n):
    for p in placements(i):
      groups.setdefault(p.param, []).append((i, p))
  out = []
  for pid in sorted(groups):
    entries = groups[pid]
    first_index, first = entries[0]
    for i, p in entries:
      if p.world_size != first.world_size or p.shape != first.shape:
        raise PlacementError(
          f"param {pid!r}: archive {i} has shape {p.shape} over world_size"
          f" {p.world_size} but archive {first_index} has {first.shape} over"
          f" {first.world_size}; pass explicit migrations to pick one group"
        )
    sources = _validate.rank_sources(pid, first.world_size, ((i, p.rank) for i, p in entries))
    out.append((pid, first.shape, sources))
  return out


class RecordSources:
  """Validated facts about one list of in-memory source archives."""

  def __init__(self, records: Sequence[ShardRecord]):
    # The records are not kept (a cache entry never keeps them alive): their parts are.
    if not records:
      raise PlacementError("no archives supplied")
    # What the records hold, before they are taken apart (changes since: ``current``).
    guard = RecordGuard.before(records)
    checked = [_validate.check_record(i, r) for i, r in enumerate(records)]
    self.checkpoint_id = _record.CheckpointOf.of(records)  # their targets' too
    self.parts_by_archive = [a for a, _ in checked]
    self._placements = [p for _, p in checked]
    # What makes archives interchangeable but for their rank and their bytes:
    # the state's structure, each buffer's shape and dtype, the placements.
    self._signatures = [_signature(a, p) for a, p in zip(self.parts_by_archive, self._placements)]
    # The layout keys numbered, so that comparing two archives' costs O(1), not
    # time in their parameters (each ``_is_uniform`` compares every archive of a group).
    self._layout_ids = _numbered([sig[0] for sig in self._signatures])
    _check_one_tree(self._layout_ids, self.parts_by_archive)
    self._guard = None if guard is None else guard.note_scalars(self.parts_by_archive)
    # Whether a source tuple is uniform, by ``sources_key``.
    self._uniform: dict[tuple, bool] = {}
    # Each buffer's host view, and whether it lives on an accelerator.
    self._homes = BufferHomes(self.parts_by_archive, self.buffer)
    self._clocks = _clock.ClockClasses()
    self._stacks = _stacks.Stacks()  # ``stacked``'s, made once
    # Every validated group of these sources, for as long as they live.
    self._cache = FactsCache()
    # The plans ``plan`` made of these sources, and what they validate to.
    self.plan_cache = _plans.PlanCache()
    # The host copy programs of run tables that are reused (a cached plan's).
    self.programs = RecentByObject()
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.parts_by_archive)

  def current(self, records: Sequence[Any]) -> bool:
    """Whether ``records`` (these sources' records, in order) still hold what they were
    taken apart with (``recordguard``); else they are taken apart afresh."""
    return self._guard is not None and self._guard.holds(records)

  def placement(self, archive: int, pid: str) -> ParamPlacement | None:
    return self._placements[archive].get(pid)

  def history(self, archive: int, pid: str) -> tuple[Any, ...]:
    return self.parts_by_archive[archive].history(pid)

  def template(self, archive: int) -> _structure.StateParts:
    return self.parts_by_archive[archive]

  def skeleton(self, archive: int) -> tuple[Any, ...]:
    return _validate.skeleton_key(self.parts_by_archive[archive])

  def scalars(self, archive: int) -> list[Any]:
    return [x for _, x in self.parts_by_archive[archive].scalars]

  def clock_class(self, archive: int) -> int:
    """Archives with one structure and bit-identical clock scalars share a class."""
    return self._clocks.of(self, archive)

  def facts(self, pid: str, sources: tuple) -> _validate.SourceFacts:
    facts = self._cache.known(pid, sources)
    if facts is not None:
      return facts
    with self._lock:
      if self._is_uniform(sources):
        facts = self._cache.memo(
          ("uniform", pid, self._cache.key(sources)),
          lambda: _validate.uniform_facts(pid, sources, self),
        )
      else:
        facts = self._cache.facts(pid, sources, self)
      self._cache.remember(pid, sources, facts)
      return facts

  def _is_uniform(self, sources: tuple) -> bool:
    """Archive ``r`` of ``sources`` holds rank ``r`` of every parameter, and all of
    them share one structure, buffer shapes, placements and clock: one archive's
    facts are every archive's."""
    key = self._cache.key(sources) if isinstance(sources, tuple) else None
    if key is None:
      return False
    hit = self._uniform.get(key)
    if hit is not None:
      return hit
    ok = (
      isinstance(sources, tuple)
      and len(sources) > 0
      and all(
        isinstance(s, int) and not isinstance(s, bool) and 0 <= s < len(self) for s in sources
      )
    )
    if ok:
      first = self._signatures[sources[0]]
      layout = self._layout_ids[sources[0]]
      ok = (
        first[1] is not None
        and first[2] == len(sources)
        and all(
          self._layout_ids[s] == layout
          and self._signatures[s][1] == r
          and self.clock_class(s) == self.clock_class(sources[0])
          for r, s in enumerate(sources)
        )
      )
    self._uniform[key] = ok
    return ok

  def complete_groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    with self._lock:
      return self._complete_groups

  @functools.cached_property
  def _complete_groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return self._uniform_groups() or complete_groups(
      lambda i: self._placements[i].values(), len(self)
    )

  def _uniform_groups(self) -> list | None:
    """Every archive one rank of one layout: one group, found in time O(archives)."""
    ranks = [sig[1] for sig in self._signatures]
    if any(r is None for r in ranks) or sorted(ranks) != list(range(len(self))):
      return None
    sources = tuple(sorted(range(len(self)), key=ranks.__getitem__))
    if not self._is_uniform(sources):
      return None
    return [(pid, p.shape, sources) for pid, p in sorted(self._placements[sources[0]].items())]

  def locate_runs(
    self, groups: Any, archive: np.ndarray, group: np.ndarray, subtree: np.ndarray, dtype: np.dtype
  ) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """Where each run's history buffer lies: every history buffer in memory is a
    source of its own, ``(archive, param, subtree)``, read from element 0."""
    del dtype
    if not len(archive):
      return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    n_groups, n_subtrees = len(groups), int(subtree.max()) + 1
    code = (archive * n_groups + group) * n_subtrees + subtree
    unique, inverse = np.unique(code, return_inverse=True)
    a, rest = np.divmod(unique, n_groups * n_subtrees)
    g, m = np.divmod(rest, n_subtrees)
    pids = groups.params
    keys = [(ai, pids[gi], mi) for ai, gi, mi in zip(a.tolist(), g.tolist(), m.tolist())]
    return inverse.reshape(-1), np.zeros(len(code), np.int64), keys

  def packing(self, archive: int) -> list[tuple[str, int, Any]]:
    """``(param, mirror, buffer)`` of the archive's history buffers in packing order."""
    a = self.parts_by_archive[archive]
    return _copyplan.packing_order({pid: a.history(pid) for pid in a.param_set()})

  def buffer(self, key: tuple[int, str, int]) -> Any:
    archive, pid, subtree = key
    return self.parts_by_archive[archive].subtrees[subtree].entries.get(pid)

  def buffers(self, keys: Sequence[tuple[int, str, int]]) -> list[Any]:
    """``buffer`` of each key."""
    parts = self.parts_by_archive
    return [parts[a].subtrees[m].entries.get(pid) for a, pid, m in keys]

  def host_views(self, keys: Sequence[tuple[int, str, int]]) -> list[np.ndarray]:
    """``host_view`` of each key."""
    return self._homes.host_views(keys)

  def host_view(self, key: tuple[int, str, int]) -> np.ndarray:
    """A buffer's bytes as a flat unsigned numpy view, made once per source set."""
    return self._homes.host_view(key)

  @property
  def host_copies(self) -> bool:
    """Whether a buffer's host view is a copy made at every read (a numpy array
    not in C order): programs over host views are then made per call."""
    return self._homes.copies

  def on_accelerator(self, keys: Sequence[tuple[int, str, int]]) -> bool:
    """Whether any of these buffers lives on a GPU/TPU (each looked at once)."""
    return self._homes.on_accelerator(keys)

  def on_accelerator_archives(self, archives: Iterable[int]) -> bool:
    """Whether any buffer of these archives lives on a GPU/TPU."""
    return self._homes.on_accelerator_archives(archives)

  def uniform(self, sources: tuple) -> bool:
    """Whether archive ``r`` of ``sources`` holds rank ``r`` of every parameter, all
    with one structure, buffer shapes, placements and clock."""
    with self._lock:
      return self._is_uniform(sources)

  def stacked(
    self, archives: tuple[int, ...], dtype: np.dtype, *, make: bool = True
  ) -> _stacks.Stack | None:
    """The ``dtype`` history buffers of ``archives`` (uniform, see :meth:`uniform`)
    as the rows of one 2-D unsigned array (``stacks.Stacks.get``): None when a
    buffer cannot be viewed on the host, or (``make=False``) when it was not
    made yet."""
    return self._stacks.get(self, archives, np.dtype(dtype), make)

  def _packing_of(self, archive: int, dtype: np.dtype) -> list[tuple[str, int]]:
    return [(pid, m) for pid, m, buf in self.packing(archive) if np.dtype(buf.dtype) == dtype]


def _numbered(keys: Sequence[Any]) -> list[Any]:
  """Equal keys get one number. A key that cannot be hashed (a placement with a
  list for its shape or dtype, refused later by name) is its own class."""
  numbers: dict[Any, int] = {}
  out: list[Any] = []
  for i, key in enumerate(keys):
    try:
      out.append(numbers.setdefault(key, len(numbers)))
    except TypeError:
      out.append(("unhashable", i))
  return out


def _check_one_tree(layout_ids: list[Any], parts: list[_structure.StateParts]) -> None:
  """``archivecheck.check_one_tree`` of one archive per layout (numbered: no key is
  hashed again, which would cost time in archives times params)."""
  firsts: dict[Any, int] = {}
  for i, layout in enumerate(layout_ids):
    firsts.setdefault(layout, i)
  if len(firsts) > 1:
    _archivecheck.check_one_tree((i, parts[i]) for i in firsts.values())


def _signature(
  state_parts: _structure.StateParts, placements: dict
) -> tuple[Any, int | None, int | None]:
  """(layout key, the archive's one rank or None, its one world size or None).

  State parts of one tree structure share their skeleton and mirror structures
  (``_structure.OUTLINES``), so comparing those is cheap.
  """
  values = [x for m in state_parts.subtrees for x in m.entries.values()]
  try:
    buffers = tuple([(x.shape, x.dtype) for x in values])
  except AttributeError:  # MASKED entries, or a buffer that is no array
    buffers = tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in values)
  structure = (
    state_parts.skeleton,
    tuple(m.treedef for m in state_parts.subtrees),
    tuple(m.order for m in state_parts.subtrees),
  )
  entries = tuple(
    (p.param, p.shape, p.world_size, p.dtype, bool(p.trainable)) for p in placements.values()
  )
  ranks = {p.rank for p in placements.values()}
  worlds = {p.world_size for p in placements.values()}
  return (
    (structure, buffers, entries),
    ranks.pop() if len(ranks) == 1 else None,
    worlds.pop() if len(worlds) == 1 else None,
  )


class SourceCache:
  """``RecordSources`` by the identities of their records and jax's x64 mode, dropped
  when one dies and made afresh when a record no longer holds what it was taken
  apart with (``RecordSources.current``).

  What validation accepts depends on the x64 mode (a float64 history buffer is
  copied exactly only with x64 on), so sources validated under one mode are
  never reused under the other: a call after the mode changed validates afresh
  and refuses what a first call would.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._entries: dict[tuple[Any, ...], tuple[tuple, RecordSources]] = {}

  def get(self, records: Sequence[Any]) -> RecordSources:
    key = (bool(jax.config.jax_enable_x64), *map(id, records))
    with self._lock:
      hit = self._entries.get(key)
    if (
      hit is not None
      and all(ref() is r for ref, r in zip(hit[0], records))
      and hit[1].current(records)
    ):
      return hit[1]
    with no_gc():
      sources = RecordSources(records)
    refs = tuple(weakref.ref(r) for r in records)
    with self._lock:
      old = self._entries.get(key)
      # The same live records, taken apart again (a clock changed): their
      # finalizers for this key are already registered, and a record that
      # dies drops the entry once, whatever it holds by then.
      again = old is not None and all(ref() is r for ref, r in zip(old[0], records))
      self._entries[key] = (refs, sources)
    if not again:
      for r in records:
        weakref.finalize(r, self._drop, key)
    return sources

  def _drop(self, key: tuple[Any, ...]) -> None:
    with self._lock:
      self._entries.pop(key, None)

  def __len__(self) -> int:
    return len(self._entries)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


CACHE = SourceCache()


def record_sources(records: Sequence[Any]) -> RecordSources:
  """The validated sources of ``records`` (from :data:`CACHE` when they were seen)."""
  if isinstance(records, (ShardRecord, str, bytes)) or not isinstance(records, Iterable):
    raise PlacementError(f"records must be a list of ShardRecord, got {type(records).__name__}")
  records = list(records)
  if not records:
    raise PlacementError("no archives supplied")
  if not all(isinstance(r, ShardRecord) for r in records):
    return RecordSources(records)  # refuses the stranger with the archive's index
  return CACHE.get(records)

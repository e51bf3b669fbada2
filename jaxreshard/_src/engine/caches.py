"""The caches a source object owns: validated facts by value, values made per object.

A source object makes one ``FactsCache`` in its ``__init__``, so the facts live
exactly as long as the sources they describe; ``RecentByObject`` keeps what is
made from one of our own immutable tables while the table is reused.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from jaxreshard._src.core import validate as _validate

__all__ = ["FactsCache", "RecentByObject", "sources_key"]


def sources_key(sources: tuple) -> tuple | None:
  """A value key of a migration's source tuple: its entries and their types (so that
  ``(True, 1)`` is not taken for ``(1, 1)``); None for entries that cannot be hashed."""
  key = (sources, tuple(map(type, sources)))
  try:
    hash(key)
  except TypeError:
    return None
  return key


class RecentByObject:
  """Values made from objects, by the objects' identities, the most recent ``maxsize``.

  Each entry holds its object, so that its ``id`` is not reused while the entry
  lives. For what is made from one of our own immutable tables (a cached
  plan's run tables): made once per table while the table is reused.
  """

  def __init__(self, maxsize: int = 32):
    self.maxsize = maxsize
    self._lock = threading.Lock()
    self._entries: collections.OrderedDict[int, tuple[Any, Any]] = collections.OrderedDict()

  def get(self, obj: Any, make: Any) -> Any:
    with self._lock:
      hit = self._entries.get(id(obj))
      if hit is not None and hit[0] is obj:
        self._entries.move_to_end(id(obj))
        return hit[1]
    value = make()
    with self._lock:
      self._entries[id(obj)] = (obj, value)
      while len(self._entries) > self.maxsize:
        self._entries.popitem(last=False)
    return value


class FactsCache:
  """Validated groups of one source set, by value; owned by the source object.

  A source object makes one in its ``__init__``: the facts live exactly as long
  as the sources they describe. Keys are values, never identities: a migration's
  ``(param, sources)``, and under it the facts shared by every equal tuple.
  """

  # Source tuples whose value key is remembered by identity, at most this many.
  MAX_TUPLES = 4096

  def __init__(self):
    self._by_key: dict[tuple, _validate.SourceFacts] = {}
    self._memo: dict[tuple, Any] = {}
    self._keys: dict[int, tuple[tuple, int | None]] = {}
    self._numbers: dict[tuple, int] = {}
    # The facts of each source tuple's value by param, and by tuple object
    # (kept with its table, so that its ``id`` is not reused meanwhile).
    self._by_number: dict[int, dict[str, _validate.SourceFacts]] = {}
    self._known: dict[int, tuple[tuple, dict[str, _validate.SourceFacts]]] = {}

  def key(self, sources: tuple) -> int | None:
    """A number per value of ``sources_key(sources)``, found once per tuple object.

    A plan's migrations of one group share one tuple of W archive indices;
    hashing it once per (target rank, param) pair would cost time in W per
    pair, so later keys hold its number, not the tuple. The tuple is kept
    with its number, so its ``id`` is not reused while the entry lives; the
    table of tuples is emptied when it reaches ``MAX_TUPLES``.
    """
    hit = self._keys.get(id(sources))
    if hit is not None and hit[0] is sources:
      return hit[1]
    value = sources_key(sources)
    number = None if value is None else self._numbers.setdefault(value, len(self._numbers))
    if len(self._keys) >= self.MAX_TUPLES:
      self._keys.clear()
    self._keys[id(sources)] = (sources, number)
    return number

  def facts(self, pid: str, sources: tuple, src: Any) -> _validate.SourceFacts:
    """The facts of ``(pid, sources)``, validated once per value."""
    key = self.key(sources)
    facts = None if key is None else self._by_key.get((pid, key))
    if facts is not None:
      return facts
    _validate.check_source_indices(pid, sources, len(src))
    value = tuple(int(s) for s in sources)
    facts = self.memo(("facts", pid, value), lambda: _validate.source_facts(pid, value, src))
    if key is not None:
      self._by_key[(pid, key)] = facts
    return facts

  def known(self, pid: str, sources: tuple) -> _validate.SourceFacts | None:
    """Facts ``remember`` holds for this tuple object's value, found without a lock
    (the tables are only ever added to) and without hashing the tuple."""
    hit = self._known.get(id(sources))
    if hit is not None and hit[0] is sources:
      return hit[1].get(pid)
    return None

  def remember(self, pid: str, sources: tuple, facts: _validate.SourceFacts) -> None:
    """Files validated facts under the value of ``sources`` and its tuple object."""
    number = self.key(sources)
    if number is None:
      return
    if len(self._known) >= self.MAX_TUPLES:
      self._known.clear()
    known = self._known.get(id(sources))
    if known is None or known[0] is not sources:
      known = self._known[id(sources)] = (sources, self._by_number.setdefault(number, {}))
    known[1][pid] = facts

  def memo(self, key: tuple, make: Any) -> Any:
    """The value remembered under ``key``, made by ``make()`` on first use."""
    value = self._memo.get(key)
    if value is None:
      value = self._memo[key] = make()
    return value

"""The migrations ``plan`` made for one source set, recognised when they come back.

``plan`` of one (world size, rank) hands out the same frozen ``Migration``
objects every time it is asked. A list made of exactly those objects (checked
by identity, in one C-level comparison: ``placement.same_migrations``) is one
that ``plan`` made, so
validating it repeats nothing: every rank of a world size shares one
:class:`~jaxreshard._src.core.groups.Family` whose rows were validated with
the first rank's list, and a rank's table is that family at its rank.
A plan the cache no longer holds (it keeps a bounded number of migrations,
and a world of thousands of ranks with thousands of params exceeds it) is
recognised by its fields instead: every migration's param, shape and sources
are the very objects ``plan`` makes every migration of, and its rank and world
size one int each, checked a field at a time in C. Anything else (a list edited
by hand, equal migrations made elsewhere) is validated in full.

A source object owns one :class:`PlanCache`; it lives as long as the sources.
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxreshard._src.core import groups as _groups
from jaxreshard._src.core.placement import Migration, same_migrations, same_migrations_each

__all__ = ["PlanCache"]

_FIELDS = tuple(map(operator.attrgetter, ("param", "shape", "sources", "rank", "world_size")))


class PlanCache:
  """Plans of one source set by (world size, rank), and the families they validate to."""

  # Migrations held at most; the oldest plans are dropped beyond it (a later
  # plan of theirs makes new migrations, validated once more).
  MAX_MIGRATIONS = 1 << 22

  def __init__(self):
    self._lock = threading.Lock()
    self._plans: collections.OrderedDict[tuple[int, int], tuple[Migration, ...]] = (
      collections.OrderedDict()
    )
    self._held = 0
    # The key of each plan by the identity of its first migration (held by the plan).
    self._by_first: dict[int, tuple[int, int]] = {}
    # Each plan's migrations as a list too, to compare a list handed back with.
    self._lists: dict[tuple[int, int], list[Migration]] = {}
    self._families: dict[int, _groups.Family] = {}
    # The groups every plan is made of, as columns of the objects each migration
    # holds (param, shape, sources); None before the first plan, False once plans
    # were made of two lists of groups (nothing is then recognised by its fields).
    self._columns: tuple[list, list, list] | bool | None = None
    self._groups: list | None = None

  def migrations(
    self, groups: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]], world: int, rank: int
  ) -> list[Migration]:
    """A new list of the plan's migrations of complete ``groups`` to target ``rank``
    of ``world`` (ints, checked by the caller), made once per (world, rank)."""
    key = (world, rank)
    with self._lock:
      plan = self._plans.get(key)
      if plan is not None:
        self._plans.move_to_end(key)
        return list(plan)
    groups = groups if isinstance(groups, list) else list(groups)
    plan = tuple(Migration.checked(pid, shape, rank, world, src) for pid, shape, src in groups)
    with self._lock:
      if self._columns is None:
        self._groups = groups
        self._columns = tuple(map(list, zip(*groups))) if groups else False
      elif self._columns is not False and self._groups is not groups:
        self._columns = False
      if key in self._plans:  # made meanwhile by another thread: keep that one
        return list(self._plans[key])
      self._plans[key] = plan
      self._lists[key] = list(plan)
      self._held += len(plan)
      if plan:
        self._by_first[id(plan[0])] = key
      while self._held > self.MAX_MIGRATIONS and len(self._plans) > 1:
        old_key, old = self._plans.popitem(last=False)
        self._lists.pop(old_key, None)
        self._held -= len(old)
        if old:
          self._by_first.pop(id(old[0]), None)
    return list(plan)

  def match(
    self, migrations: Sequence[Any]
  ) -> tuple[tuple[int, int], tuple[Migration, ...]] | None:
    """``((world, rank), plan)`` when ``migrations`` holds exactly the plan's objects,
    in order; None otherwise."""
    if not isinstance(migrations, (list, tuple)) or not migrations:
      return None
    first = migrations[0]
    # Reads need no lock: entries are only ever added or removed whole.
    key = self._by_first.get(id(first))
    plan = None if key is None else self._plans.get(key)
    if plan is None or plan[0] is not first or len(plan) != len(migrations):
      return None
    # One C-level comparison for a list or tuple; element by element where it
    # cannot tell (another container, or a comparison it could not trust).
    same = plan if type(migrations) is tuple else self._lists.get(key)
    if same is not None and same_migrations(migrations, same):
      return key, plan
    if any(map(operator.is_not, migrations, plan)):
      return None
    return key, plan

  def validated_each(
    self, plans: Sequence[Any], validate: Callable[[Any], _groups.Groups]
  ) -> list[_groups.Groups] | None:
    """The validated tables of ``plans`` when every one is a plan this cache made
    (a list of exactly the objects of one it holds, or of one it dropped: see
    ``made_again``), else None (validate them one by one).

    ``validate(migrations)`` validates one list in full: it runs for the first
    rank of a world size no family holds yet.
    """
    keys, compared, lists = [], [], []
    by_first, held = self._by_first, self._lists
    for migrations in plans:
      if type(migrations) is not list or not migrations:
        return None
      key = by_first.get(id(migrations[0]))
      same = None if key is None else held.get(key)
      if same is not None and same[0] is migrations[0]:
        compared.append(migrations)
        lists.append(same)
      else:
        key = self.made_again(migrations)
        if key is None:
          return None
      keys.append(key)
    if not same_migrations_each(compared, lists):
      return None
    out = []
    for (world, rank), migrations in zip(keys, plans):
      plan = self._plans.get((world, rank))
      if plan is None or plan[0] is not migrations[0]:  # dropped, or made again
        plan = migrations
      family = self._families.get(world)
      if family is None:
        table = validate(migrations)
        with self._lock:
          family = self._families.setdefault(world, _groups.Family(table, world))
      out.append(family.table(plan, rank))
    return out

  def validated(
    self, migrations: Sequence[Any], validate: Callable[[], _groups.Groups]
  ) -> _groups.Groups | None:
    """The validated table of a plan this cache made, or None for any other list.

    ``validate()`` validates ``migrations`` in full; it runs for the first rank
    of a world size, and its refusals are raised as they are.
    """
    hit = self.match(migrations)
    if hit is None:
      key = self.made_again(migrations)
      if key is None:
        return None
      hit = key, migrations
    (world, rank), plan = hit
    family = self._families.get(world)
    if family is None:
      table = validate()
      with self._lock:
        family = self._families.setdefault(world, _groups.Family(table, world))
    return family.table(plan, rank)

  def made_again(self, migrations: Sequence[Any]) -> tuple[int, int] | None:
    """``(world, rank)`` of a list or tuple that holds, in order, one ``Migration``
    per group every plan is made of, whose param, shape and sources are that
    group's very objects and whose rank and world size are one int each, a valid
    target: what ``plan`` makes of these groups for that rank (made again after
    the cache dropped it, or kept by the caller since). None for anything else.

    Its validation is then that of every plan of the world: fields that are the
    same objects, immutable, validate alike. Checked a field at a time, each with
    one C-level comparison of identities.
    """
    columns = self._columns
    if not columns or type(migrations) not in (list, tuple):
      return None
    n = len(columns[0])
    if len(migrations) != n or set(map(type, migrations)) != {Migration}:
      return None
    rank, world = migrations[0].rank, migrations[0].world_size
    if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
      return None
    expected = (*columns, itertools.repeat(rank, n), itertools.repeat(world, n))
    for field, objects in zip(_FIELDS, expected):
      if not all(map(operator.is_, map(field, migrations), objects)):
        return None
    return world, rank

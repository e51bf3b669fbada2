"""Refusals of archives as wholes: a record of the one record version there is, and
archives of one state whose params trees are trees of one state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.errors import PlacementError

__all__ = ["check_is_record", "check_one_tree", "check_records_iterable", "check_version"]


def _params_of(record: ShardRecord, limit: int = 3) -> str:
  """``params 'a', 'b', ... (N in all)``: names a whole archive's parameters briefly."""
  ids = [getattr(p, "param", p) for p in record.placements]
  if not ids:
    return "no params listed"
  shown = ", ".join(repr(i) for i in ids[:limit])
  more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
  return f"param {shown}" if len(ids) == 1 else f"params {shown}{more}"


def check_is_record(record: Any, where: str) -> None:
  if not isinstance(record, ShardRecord):
    raise PlacementError(f"{where}: expected a ShardRecord, got {type(record).__name__}")


def check_records_iterable(records: Any, what: str) -> None:
  """Refuses by name what is not an iterable of records (one record, a number, a str)."""
  if isinstance(records, (str, bytes, ShardRecord)) or not isinstance(records, Iterable):
    raise PlacementError(
      f"{what}: records must be an iterable of ShardRecords (a list: one per rank),"
      f" got {type(records).__name__}"
    )


def check_version(index: int, record: Any) -> None:
  """A ``ShardRecord`` of the one record version there is."""
  check_is_record(record, f"archive {index}")
  # The int 1 itself: True and 1.0 equal it but are not a record version.
  if type(record.version) is not int or record.version != RECORD_VERSION:
    raise PlacementError(
      f"{_params_of(record)}: archive {index} has record version {record.version!r},"
      f" which is not supported (only version {RECORD_VERSION} exists)"
    )


def check_one_tree(
  layouts: Iterable[tuple[int, _structure.StateParts]], seen: dict | None = None
) -> None:
  """Archives that hold the same params in each param-mirroring subtree hold them in
  the same tree: a list and a tuple, or a tree with and one without an empty node
  (``None``, ``{}``), are two states, whichever of them a target would take its tree
  from. ``layouts``: one (archive, state parts) per distinct layout; ``seen``: what
  earlier calls were given, for a caller that meets layouts one at a time.

  Archives of different param sets (groups) make one params tree too: a param
  of one is never a leaf where another's params lie under it (``experts`` and
  ``experts/w``), which no target could hold.

  Raises:
    PlacementError: naming two such archives and the subtree where they differ,
      or the leaf and the param under it.
  """
  seen = {} if seen is None else seen
  tree_of = seen.setdefault(_PARAMS_TREE, _ParamsTree())
  for archive, parts in layouts:
    key = tuple(frozenset(m.order) for m in parts.subtrees)
    tree_of.add(archive, frozenset().union(*key), parts)
    trees = tuple(m.treedef for m in parts.subtrees)
    first = seen.setdefault(key, (archive, trees))
    if first[1] != trees:
      at = next(i for i, (a, b) in enumerate(zip(first[1], trees)) if a != b)
      where = parts.subtrees[at].prefix
      raise PlacementError(
        f"archives {first[0]} and {archive} hold the same params in other trees at state"
        f" path {_path(where)} ({str(first[1][at])[:150]} vs {str(trees[at])[:150]}):"
        " they are not archives of one state"
      )


# The key under which ``check_one_tree``'s ``seen`` keeps the params tree met so far.
_PARAMS_TREE = "params tree"


class _ParamsTree:
  """The ids of every distinct param set met, and every key path above one of them
  (ids join keys with ``/``; a ``/`` inside a key is escaped, so every ``/`` ends
  an ancestor): a new set is checked against them in time linear in its ids."""

  def __init__(self):
    self.sets: set[frozenset] = set()
    self.ids: dict[str, int] = {}  # id -> an archive holding it
    self.above: dict[str, tuple[str, int]] = {}  # ancestor -> (an id under it, its archive)
    self.one_leaf: int | None = None  # an archive whose params tree is one array
    self.first: tuple[int, frozenset] | None = None  # the one set met, not indexed yet
    self.first_archive: int | None = None

  def add(self, archive: int, ids: frozenset, parts: Any) -> None:
    if ids in self.sets:
      return
    # A params tree that is one array (the id "" at the root, not a key "") holds
    # no other param: no other set can join it.
    leaf = any(jax.tree_util.treedef_is_leaf(m.treedef) for m in parts.subtrees)
    if self.sets and (leaf or self.one_leaf is not None):
      other = self.one_leaf if self.one_leaf is not None else self.first_archive
      one, many = (archive, other) if leaf else (other, archive)
      raise PlacementError(
        f"archive {one}'s params tree is one array, and archive {many} holds other"
        " params: they are not archives of one state"
      )
    self.sets.add(ids)
    if leaf:
      self.one_leaf = archive
    # One set alone is one tree: its ids are indexed only once a second set comes.
    if len(self.sets) == 1:
      self.first, self.first_archive = (archive, ids), archive
      return
    if self.first is not None:
      self._index(*self.first)
      self.first = None
    self._index(archive, ids)

  def _index(self, archive: int, ids: frozenset) -> None:
    for pid in ids:
      if pid in self.above and pid not in self.ids:
        deep, b = self.above[pid]
        raise _nesting(pid, archive, deep, b)
      for i, c in enumerate(pid):
        if c == "/" and pid[:i] in self.ids and pid[:i] not in ids:
          raise _nesting(pid[:i], self.ids[pid[:i]], pid, archive)
    for pid in ids:
      self.ids.setdefault(pid, archive)
      for i, c in enumerate(pid):
        if c == "/":
          self.above.setdefault(pid[:i], (pid, archive))


def _nesting(leaf: str, a: int, deep: str, b: int) -> PlacementError:
  return PlacementError(
    f"param {leaf!r} is a leaf of archive {a}'s params tree, where archive {b}"
    f" holds param {deep!r} under it: they are not archives of one state"
  )


def _path(prefix: tuple) -> str:
  return jax.tree_util.keystr(prefix) or "(the root)"

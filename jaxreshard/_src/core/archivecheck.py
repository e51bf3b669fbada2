"""Refusals of archives as wholes: a record of the one record version there is, and
archives of one state whose params trees are trees of one state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

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

  Archives of different param sets (groups) make one params tree too, each
  param at its own key path: a param of one is never a leaf where another's
  params lie under it (``experts`` and ``experts/w``); a node of one is the
  same container as the other's at that path (never a list or a tuple beside
  a dict, nor an empty node, ``None`` or ``{}``, where the other has a param),
  and two dicts at one path hold keys of one kind, in an order jax
  sorts (never ``0`` beside ``"x"``). A target merging them could hold neither.

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
    self.first: tuple[int, frozenset, Any] | None = None  # the one set met, not indexed yet
    self.first_archive: int | None = None
    self.nodes = _Nodes()  # every node of the sets' params trees

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
      self.first, self.first_archive = (archive, ids, parts), archive
      return
    if self.first is not None:
      self._index(*self.first[:2])
      self.nodes.add(self.first[0], self.first[2])
      self.first = None
    self._index(archive, ids)
    self.nodes.add(archive, parts)

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


def _tree_nodes(parts: Any) -> dict[tuple, tuple[str, tuple, tuple]]:
  """Each node of an archive's params trees (its leaves are param ids, of the kind
  "param"): its key path in the params tree -> (its kind, its keys when a dict, its
  path in the state)."""
  out: dict[tuple, tuple[str, tuple, tuple]] = {}
  for m in parts.subtrees:
    stack = [(jax.tree_util.tree_unflatten(m.treedef, list(m.order)), ())]
    while stack:
      x, path = stack.pop()
      t = type(x)
      if t is str:  # a param id: no other set holds a node there, not even an empty one
        out.setdefault(path, ("param", (), m.prefix + path))
        continue
      if isinstance(x, tuple) and hasattr(t, "_fields"):
        kind, children = (
          f"NamedTuple {t.__name__}",
          [(GetAttrKey(f), c) for f, c in zip(t._fields, x)],
        )
      elif t is list or t is tuple:
        kind, children = f"{t.__name__}", [(SequenceKey(i), c) for i, c in enumerate(x)]
      elif x is None:
        kind, children = "None", []
      else:  # a dict or flax's FrozenDict: the only other nodes a state holds
        kind, children = t.__name__, [(DictKey(k), x[k]) for k in x]
      keys = tuple(x) if children and type(children[0][0]) is DictKey else ()
      out.setdefault(path, (kind, keys, m.prefix + path))
      stack.extend((c, path + (k,)) for k, c in children)
  return out


class _Nodes:
  """The nodes of every param set's params tree met so far, by key path: each node's
  kind, the keys of a dict (all sets' together) and the archive it came from."""

  def __init__(self):
    # path -> (kind, its keys in order met, the same as a set, first archive)
    self.nodes: dict[tuple, tuple[str, list, set, int]] = {}

  def add(self, archive: int, parts: Any) -> None:
    for path, (kind, keys, where) in _tree_nodes(parts).items():
      seen = self.nodes.get(path)
      if seen is None:
        self.nodes[path] = (kind, list(keys), set(keys), archive)
        continue
      if _same_kind(seen[0]) != _same_kind(kind):
        raise PlacementError(
          f"archive {seen[3]} holds a {seen[0]} at state path {_path(where)} and archive"
          f" {archive} a {kind}: no one params tree holds the params of both, each at its"
          " own key path, so they are not archives of one state"
        )
      new = [k for k in keys if k not in seen[2]]
      if new:
        _check_one_kind(seen[1], new, seen[3], archive, where)
        seen[1].extend(new)
        seen[2].update(new)


def _same_kind(kind: str) -> str:
  """A node kind as the merged tree holds it: every mapping (a dict, flax's
  FrozenDict, an OrderedDict) is a dict there, nested by its keys."""
  return "dict" if kind in ("dict", "FrozenDict", "OrderedDict") else kind


def _check_one_kind(old: list, new: list, a: int, b: int, where: tuple) -> None:
  """Keys of one dict from two archives: of one kind, in an order jax sorts."""
  try:
    if len({type(k) for k in old + new}) == 1:
      sorted(old + new)
      return
  except TypeError:
    pass
  j, k = _clash(old, new)
  raise PlacementError(
    f"the dict at state path {_path(where)} holds key {j!r} in archive {a} and key"
    f" {k!r} in archive {b}, keys of two kinds or in no order jax sorts: no one dict"
    " holds both, so they are not archives of one state"
  )


def _clash(old: list, new: list) -> tuple[Any, Any]:
  """Two keys, one of each list, that no one dict of jax holds (some two do)."""
  for k in new:
    for j in old:
      if type(j) is not type(k):
        return j, k
      try:
        sorted([j, k])
      except TypeError:
        return j, k
  return old[0], new[0]  # each pair sorts, but not all of them together


def _path(prefix: tuple) -> str:
  return jax.tree_util.keystr(prefix) or "(the root)"

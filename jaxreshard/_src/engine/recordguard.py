"""Whether remembered records still hold what they held when they were taken apart.

A list of records is taken apart once and remembered while its records live
(``sources.SourceCache``): later calls answer from what was learnt then (each
buffer's place, the validated structure, the clock classes), reading only the
bytes of the history buffers again. A record changed since must not leave a
later call answering from that: a buffer or a clock scalar replaced in a dict or
list of its state (``state[0].mu["w"] = zeros``, optax's own idiom
``state.hyperparams["learning_rate"] = x``), a key added, removed or moved, a
field of the frozen record set anyway. Such a record is taken apart afresh, and
refused or used exactly as a first call would.

:class:`RecordGuard` keeps each record's fields, and every container of each
state that can change in place with what it held, read before the records are
taken apart (a change made while they are, from another thread, is seen by the
next call); :meth:`RecordGuard.holds` compares them:

- dicts of exactly ``dict`` (a params tree of dicts in every history mirror,
  often one per param: by far the most numerous) by CPython's version tag, which
  the interpreter moves at every change of such a dict: one read per dict,
  whatever its size, all of them in one call of the compiled library
  (``native.first_changed_word``) where it is built. The tag is used only where a
  check of this interpreter, made once, finds it moved by every kind of change;
  elsewhere, and for every subclass of dict (an ``OrderedDict`` reordered by
  ``move_to_end`` keeps its tag), each dict is compared by its keys in order and
  the identity of each value;
- lists item by item, by identity;
- any other pytree node that is neither a tuple (NamedTuple states) nor a frozen
  dataclass, by its children, flattened again, and its tree definition.

A clock scalar that is a numpy array is compared with the bytes the taking apart
copied of it, read-only or not: numpy lets a caller write a 0-d array in place,
and one that is read-only now can be written through its base or another view,
or made writable again. History buffers are not compared: every call reads their
current bytes. A jax array deleted since (a history buffer or a clock scalar) is
not looked for: a look at each would cost ~0.25 us per array per call (6.9 ms
a call at 4,096 records of ``inject_hyperparams``' seven clock scalars, measured
on a 2-core VM).

Frozen objects changed through ``object.__setattr__`` below the record (its
``ParamPlacement`` entries), and a tuple's class reassigned, are not looked at:
that would cost a look per placement per call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import operator
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import masks as _masks
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.exec import native as _native

__all__ = ["RecordGuard", "dict_tags"]

# The record's fields as its ``__dict__`` holds them (with what a deferred record
# makes its placements and state of). The guard reads each field as taking the
# record apart does: a deferred record's placements and state are made here.
_FIELDS = ("version", "placements", "state", "roles", "checkpoint_id", _record.PARTS)
_STATE = _FIELDS.index("state")
# Objects that are leaves of every tree, skipped without a look at the registry
# (jax's array type joins them when first met: making one here would start jax's
# backend at import, before ``jax.distributed.initialize`` or a fork).
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, str, type(None)})
# A dict's version tag lies after its reference count, its type and its length.
_TAG_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p) + ctypes.sizeof(ctypes.c_ssize_t)
_LEN_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)


def _tag(d: dict) -> int:
  return ctypes.c_uint64.from_address(id(d) + _TAG_OFFSET).value


@functools.cache
def dict_tags() -> bool:
  """Whether this interpreter's dicts carry a version tag where it is read, moved by
  every kind of change: CPython's layout (its length read where the tag's
  neighbour is), and a tag that changes at each of these changes."""
  if sys.implementation.name != "cpython" or hasattr(sys, "getobjects"):
    return False  # another interpreter, or a debug build's larger object header
  try:
    for n in (0, 1, 5, 1000):
      d = dict.fromkeys(range(n))
      if ctypes.c_ssize_t.from_address(id(d) + _LEN_OFFSET).value != n:
        return False
    d: dict = {"a": 1, "b": 2}
    changes = [
      lambda: d.__setitem__("c", 3),
      lambda: d.__setitem__("a", object()),
      lambda: d.__delitem__("b"),
      lambda: d.pop("c"),
      lambda: d.update({"e": 5}),
      lambda: d.setdefault("f", 6),
      lambda: d.__ior__({"g": 7}),
      lambda: d.popitem(),
      lambda: dict.__init__(d, {"h": 8}),
      lambda: d.clear(),
      lambda: d.__setitem__("i", 9),
    ]
    seen = {_tag(d)}
    for change in changes:
      before = _tag(d)
      if _tag(d) != before:
        return False  # not stable while nothing changes
      change()
      after = _tag(d)
      if after in seen:
        return False
      seen.add(after)
    return True
  except Exception:  # pylint: disable=broad-exception-caught
    return False


def _frozen(node: Any) -> bool:
  params = getattr(type(node), "__dataclass_params__", None)
  return dataclasses.is_dataclass(node) and params is not None and params.frozen


def _children(node: Any) -> tuple[list, Any] | None:
  """One level of a pytree node (its children and tree definition), or None for a leaf."""
  children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
  if len(children) == 1 and children[0] is node:
    return None
  return children, treedef


def _scalar_paths(parts: _structure.StateParts) -> list[tuple[tuple[Any, ...], int]]:
  """The key path of each clock scalar of ``parts`` in the record's state, with its
  place in ``parts.skeleton_leaves``."""
  n = len(parts.skeleton_leaves)
  tree = jax.tree_util.tree_unflatten(parts.skeleton, list(range(n)))
  scalar = [not isinstance(x, _structure.ParamsSubtreeSlot) for x in parts.skeleton_leaves]
  return [(path, i) for path, i in jax.tree_util.tree_flatten_with_path(tree)[0] if scalar[i]]


class RecordGuard:
  """What some records held before they were taken apart, to compare with later.

  Made before the records are taken apart (each container's tag or contents read
  before what it holds is looked at), and told the clock scalars the taking apart
  copied (:meth:`note_scalars`): a record changed at any time after a container
  was looked at, while it was taken apart included, no longer holds what the guard
  keeps, and the next call takes it apart afresh.
  """

  def __init__(self, records: Sequence[Any]):
    self._fields = [tuple(getattr(r, k, None) for k in _FIELDS) for r in records]
    self._tags = dict_tags()
    native = self._tags and _native.available()
    tagged: list[dict] = []  # dicts of exactly ``dict``, compared by their tags
    where: list[np.ndarray] = []
    expected: list[Any] = []
    full: list[tuple[dict, list, list]] = []  # other dicts, by keys and values
    lists: list[tuple[list, list]] = []
    nodes: list[tuple[Any, list, Any]] = []
    seen: set[int] = set()
    leaves = set(_LEAF_TYPES)

    def read_tags(dicts: list[dict]) -> None:
      """Keeps ``dicts``, each with its tag as read now."""
      tagged.extend(dicts)
      if native:
        at = np.fromiter(map(id, dicts), np.int64, len(dicts)) + _TAG_OFFSET
        where.append(at)
        expected.append(_native.read_words(at))
      else:
        expected.extend(map(_tag, dicts))

    # Where tags are read, each record's own dict is compared by its tag too (any
    # field set moves it), in place of its fields one by one; an attribute the
    # record caches on itself later (its ``placement`` index) moves it once.
    self._record_dicts = [r.__dict__ for r in records] if self._tags else None
    if self._record_dicts:
      seen.update(map(id, self._record_dicts))
      read_tags(self._record_dicts)
    level = [fields[_STATE] for fields in self._fields]
    while level:
      # This level's containers, each once; each dict's tag is read before its
      # values are, so that a change made after they were looked at moves it.
      fresh = []
      for node in level:
        if type(node) in leaves or id(node) in seen:
          continue
        seen.add(id(node))
        fresh.append(node)
      plain = [node for node in fresh if type(node) is dict]
      if self._tags and plain:
        read_tags(plain)
      level = []
      for node in fresh:
        if isinstance(node, dict):
          values = list(node.values())
          if not (self._tags and type(node) is dict):
            full.append((node, list(node), values))
        elif isinstance(node, tuple):
          values = node
        elif isinstance(node, list):
          values = list(node)
          lists.append((node, values))
        elif isinstance(node, (jax.Array, np.generic)):
          leaves.add(type(node))
          continue
        else:
          one = _children(node)
          if one is None:
            continue
          values = one[0]
          if not _frozen(node):
            nodes.append((node, *one))
        level.extend(v for v in values if type(v) not in leaves)
    self._tagged = tagged
    # Where each tag lies and the tags, compared in one C call; else one by one.
    self._where = self._expected = None
    if native and where:
      self._where = np.concatenate(where)
      self._expected = np.concatenate(expected)
    elif not native:
      self._expected = expected
    self._full, self._lists, self._nodes = full, lists, nodes
    self._scalars: list[tuple[np.ndarray, Any, tuple, bytes]] = []

  @classmethod
  def before(cls, records: Sequence[Any]) -> RecordGuard | None:
    """A guard of ``records`` made before they are taken apart, or None for records
    it cannot look at (taking them apart refuses them)."""
    try:
      return cls(records)
    except Exception:  # pylint: disable=broad-exception-caught
      return None

  def note_scalars(self, parts: Sequence[_structure.StateParts]) -> RecordGuard:
    """Keeps the records' numpy clock scalars, each with the bytes ``parts`` copied of
    it (a write since is seen; one array several records share, with each copy).
    Returns this guard."""
    scalars: list[tuple[np.ndarray, Any, tuple, bytes]] = []
    paths_of: dict[Any, list[tuple[tuple[Any, ...], int]]] = {}  # by skeleton: archives share them
    for fields, p in zip(self._fields, parts):
      paths = paths_of.get(p.skeleton)
      if paths is None:
        paths = paths_of[p.skeleton] = _scalar_paths(p)
      for path, i in paths:
        x = _masks.node_at(fields[_STATE], path)
        if isinstance(x, np.ndarray):
          copy = p.skeleton_leaves[i]
          if isinstance(copy, np.ndarray):
            scalars.append((x, copy.dtype, copy.shape, copy.tobytes()))
          else:  # not what was taken apart: never the same
            scalars.append((x, None, None, b""))
    self._scalars = scalars
    return self

  def __len__(self) -> int:
    """How many containers and numpy clock scalars are compared."""
    return sum(map(len, (self._tagged, self._full, self._lists, self._nodes, self._scalars)))

  def holds(self, records: Sequence[Any]) -> bool:
    """Whether ``records`` (the records taken apart, in order) still hold every field,
    container and numpy clock scalar's bytes they held."""
    try:
      if len(records) != len(self._fields):
        return False
      if self._record_dicts is not None:  # their tags are compared below
        if not all(map(operator.is_, map(vars, records), self._record_dicts)):
          return False
      else:
        for r, fields in zip(records, self._fields):
          d = r.__dict__
          if not all(map(operator.is_, map(d.get, _FIELDS), fields)):
            return False
      if self._where is not None:
        if _native.first_changed_word(self._where, self._expected) != -1:
          return False
      elif self._tags and self._tagged:
        if not all(map(operator.eq, map(_tag, self._tagged), self._expected)):
          return False
      for d, keys, values in self._full:
        if len(d) != len(values) or not all(map(operator.is_, d.values(), values)):
          return False
        if list(d) != keys:
          return False
      for items, values in self._lists:
        if len(items) != len(values) or not all(map(operator.is_, items, values)):
          return False
      for node, children, treedef in self._nodes:
        now = _children(node)
        if now is None or now[1] != treedef or len(now[0]) != len(children):
          return False
        if not all(map(operator.is_, now[0], children)):
          return False
      return all(x.dtype == d and x.shape == s and x.tobytes() == b for x, d, s, b in self._scalars)
    except Exception:  # a container that now refuses to be read: not the same
      return False

"""Whether remembered records still hold what they held when they were taken apart.

A list of records is taken apart once and remembered while its records live
(``sources.SourceCache``): later calls answer from what was learnt then (each
buffer's place, the validated structure, the clock classes), reading only the
bytes of the history buffers again. A record changed since must not leave a
later call answering from that: a buffer or a clock scalar replaced in a dict or
list of its state (``state[0].mu["w"] = zeros``, optax's own idiom
``state.hyperparams["learning_rate"] = x``), a key added or removed, a field of
the frozen record set anyway. Such a record is taken apart afresh, and refused
or used exactly as a first call would.

:class:`RecordGuard` keeps each record's fields, and every container of each
state that can change in place with what it held; :meth:`RecordGuard.holds`
compares them:

- dicts (a params tree of dicts in every history mirror, often one per param:
  by far the most numerous) by CPython's version tag, which the interpreter moves
  at every change of a dict: one read per dict, whatever its size, all of them in
  one call of the compiled library (``native.first_changed_word``) where it is built. The
  tag is used only where a check of this interpreter, made once, finds it moved
  by every kind of change; elsewhere each dict is compared by its keys and the
  identity of each value;
- lists item by item, by identity;
- any other pytree node that is neither a tuple (NamedTuple states) nor a frozen
  dataclass, by its children, flattened again, and its tree definition.

A clock scalar that is a numpy array is compared by its bytes too, read-only or
not: numpy lets a caller write a 0-d array in place, and one that is read-only
now can be written through its base or another view, or made writable again.
History buffers are not compared: every call reads their current bytes.
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
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.exec import native as _native

__all__ = ["RecordGuard", "dict_tags"]

# The record's fields as its ``__dict__`` holds them: a deferred record's
# placements and state are absent until first read, and are not made here.
_FIELDS = ("version", "placements", "state", "roles")
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


def _scalar_paths(parts: _structure.StateParts) -> list[tuple[Any, ...]]:
  """The key path of each clock scalar of ``parts``, in the record's state."""
  n = len(parts.skeleton_leaves)
  tree = jax.tree_util.tree_unflatten(parts.skeleton, list(range(n)))
  scalar = [not isinstance(x, _structure.ParamsSubtreeSlot) for x in parts.skeleton_leaves]
  return [path for path, i in jax.tree_util.tree_flatten_with_path(tree)[0] if scalar[i]]


class RecordGuard:
  """What some records held when they were taken apart, to compare with later."""

  def __init__(self, records: Sequence[Any], parts: Sequence[_structure.StateParts]):
    self._fields = [tuple(r.__dict__.get(k) for k in _FIELDS) for r in records]
    self._tags = dict_tags()
    dicts: dict[int, Any] = {}
    lists: dict[int, tuple[list, list]] = {}
    nodes: dict[int, tuple[Any, list, Any]] = {}
    seen: set[int] = set()
    leaves = set(_LEAF_TYPES)
    for fields in self._fields:
      pending = [fields[_FIELDS.index("state")]]
      while pending:
        node = pending.pop()
        if type(node) in leaves or id(node) in seen:
          continue
        seen.add(id(node))
        if isinstance(node, dict):
          values = list(node.values())
          dicts[id(node)] = (node, None) if self._tags else (node, list(node), values)
        elif isinstance(node, tuple):
          values = node
        elif isinstance(node, list):
          values = list(node)
          lists[id(node)] = (node, values)
        elif isinstance(node, (jax.Array, np.generic)):
          leaves.add(type(node))
          continue
        else:
          one = _children(node)
          if one is None:
            continue
          values = one[0]
          if not _frozen(node):
            nodes[id(node)] = (node, *one)
        pending.extend(v for v in values if type(v) not in leaves)
    self._dicts = list(dicts.values())
    # Where each dict's tag lies, and the tags, read for all of them in one C call.
    self._where = self._expected = None
    if self._tags and _native.available():
      self._where = np.array([id(d) + _TAG_OFFSET for d, _ in self._dicts], np.int64)
      self._expected = _native.read_words(self._where)
    elif self._tags:
      self._dicts = [(d, _tag(d)) for d, _ in self._dicts]
    self._lists = list(lists.values())
    self._nodes = list(nodes.values())
    # The records' own clock scalars that are numpy arrays (the parts hold copies),
    # with their bytes.
    scalars: dict[int, tuple[np.ndarray, Any, tuple, bytes]] = {}
    paths_of: dict[Any, list[tuple[Any, ...]]] = {}  # by skeleton: archives share them
    for fields, p in zip(self._fields, parts):
      paths = paths_of.get(p.skeleton)
      if paths is None:
        paths = paths_of[p.skeleton] = _scalar_paths(p)
      for path in paths:
        x = _masks.node_at(fields[_FIELDS.index("state")], path)
        if isinstance(x, np.ndarray):
          scalars[id(x)] = (x, x.dtype, x.shape, x.tobytes())
    self._scalars = list(scalars.values())

  def __len__(self) -> int:
    """How many containers and numpy clock scalars are compared."""
    return len(self._dicts) + len(self._lists) + len(self._nodes) + len(self._scalars)

  def holds(self, records: Sequence[Any]) -> bool:
    """Whether ``records`` (the records taken apart, in order) still hold every field,
    container and numpy clock scalar's bytes they held."""
    try:
      if len(records) != len(self._fields):
        return False
      for r, fields in zip(records, self._fields):
        d = r.__dict__
        if not all(map(operator.is_, map(d.get, _FIELDS), fields)):
          return False
      if self._where is not None:
        if _native.first_changed_word(self._where, self._expected) != -1:
          return False
      elif self._tags:
        if not all(_tag(d) == tag for d, tag in self._dicts):
          return False
      else:
        for d, keys, values in self._dicts:
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

"""Whether remembered records still hold the clock scalars they were validated with.

A list of records is taken apart once and remembered while its records live. A
clock scalar replaced in a mutable container of a record's state (optax's own
idiom: ``state.hyperparams["learning_rate"] = x``) must not leave a later call
with the scalar taken apart before. ``ClockGuard`` keeps, for every clock
scalar's key path, each step whose container can be changed in place (a dict, a
list, an object with settable attributes) and the object it held; ``holds()``
compares them by identity, a few C-level lookups per hyperparameter. Steps
through tuples (NamedTuple states) and frozen dataclasses cannot change and cost
nothing, so an Adam or SGD state's ``count`` is never looked at again. A clock
scalar that is a numpy array is compared by its bytes too, read-only or not:
numpy lets a caller write a 0-d array in place, and one that is read-only now
can be written through its base or another view, or made writable again.

History buffers are not guarded (a look-up per leaf per call); a write into one is
seen anyway, since every call reads the buffers' current bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import structure as _structure

__all__ = ["ClockGuard"]

_MISSING = object()


def _immutable(node: Any) -> bool:
  if isinstance(node, tuple):
    return True
  params = getattr(type(node), "__dataclass_params__", None)
  return dataclasses.is_dataclass(node) and params is not None and params.frozen


def _scalar_paths(parts: _structure.StateParts) -> list[tuple[Any, ...]]:
  """The key path of each clock scalar of ``parts``, in the record's state."""
  n = len(parts.skeleton_leaves)
  tree = jax.tree_util.tree_unflatten(parts.skeleton, list(range(n)))
  scalar = [not isinstance(x, _structure.ParamsSubtreeSlot) for x in parts.skeleton_leaves]
  return [path for path, i in jax.tree_util.tree_flatten_with_path(tree)[0] if scalar[i]]


def _step(node: Any, entry: Any) -> tuple[str, Any, Any]:
  """(how, key, child) of one key-path entry below ``node``; how is "item", "attr"
  or "" (an entry that cannot be looked up by key: not guarded)."""
  try:
    if isinstance(entry, jax.tree_util.DictKey):
      return "item", entry.key, node[entry.key]
    if isinstance(entry, jax.tree_util.SequenceKey):
      return "item", entry.idx, node[entry.idx]
    if isinstance(entry, jax.tree_util.GetAttrKey):
      return "attr", entry.name, getattr(node, entry.name)
  except Exception:  # a container that flattens but does not index: not guarded
    pass
  return "", None, _MISSING


class ClockGuard:
  """The mutable steps to every clock scalar of some records, what they held, and the
  bytes of the clock scalars that are numpy arrays."""

  def __init__(self, records: Sequence[Any], parts: Sequence[_structure.StateParts]):
    items: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}
    attrs: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    values: dict[int, tuple[np.ndarray, Any, tuple, bytes]] = {}  # numpy scalars
    paths_of: dict[Any, list[tuple[Any, ...]]] = {}  # by skeleton: archives share them
    for record, p in zip(records, parts):
      paths = paths_of.get(p.skeleton)
      if paths is None:
        paths = paths_of[p.skeleton] = _scalar_paths(p)
      state = record.state
      for path in paths:
        node = state
        for entry in path:
          how, key, child = _step(node, entry)
          if child is _MISSING:
            break
          if not _immutable(node):
            # Keyed by the container's identity: the entry holds the container.
            (items if how == "item" else attrs)[(id(node), key)] = (node, key, child)
          node = child
        else:  # ``node`` is the record's own scalar
          if isinstance(node, np.ndarray):
            values[id(node)] = (node, node.dtype, node.shape, node.tobytes())
    self._items = tuple(items.values())
    self._attrs = tuple(attrs.values())
    self._values = tuple(values.values())

  def __len__(self) -> int:
    return len(self._items) + len(self._attrs) + len(self._values)

  def holds(self) -> bool:
    """Whether every guarded container still holds the object it held, and every
    numpy scalar its bytes."""
    try:
      return (
        all(node[key] is child for node, key, child in self._items)
        and all(getattr(node, key) is child for node, key, child in self._attrs)
        and all(x.dtype == d and x.shape == s and x.tobytes() == b for x, d, s, b in self._values)
      )
    except Exception:  # a key removed, a container that now refuses: not the same
      return False

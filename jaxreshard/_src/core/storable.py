"""The trees a checkpoint can store: one rule for a save and for every call in memory.

A checkpoint stores a state's tree node by node (``checkpoint.encoding`` writes
what :func:`node` says of each node), and reads back only what it could have
written. A state whose tree it cannot store exactly is refused by a save, and by
every call in memory too (:func:`check_structure`), so that a state that reshards
in memory can always be saved and loaded. A tree is storable when:

* every node is None, a leaf, a list, a tuple, a dict, flax's ``FrozenDict``, an
  ``OrderedDict`` (optax's ``named_chain``) or a NamedTuple: no other registered
  pytree node (a dataclass, a ``defaultdict``);
* no node lies more than ``MAX_TREE_DEPTH`` keys below the root;
* each dict's keys are all ``str``, all ``int`` or all tuples of those and of
  such tuples nested at most ``MAX_KEY_DEPTH`` deep (exactly these types: a bool,
  a numpy integer, a float or None is no key), in an order jax can sort;
* at most ``MAX_KEYS_PER_HASH`` int or tuple keys of one dict share a hash (a
  reader refuses more as keys chosen to collide);
* each NamedTuple's class name and fields are ASCII identifiers of at most 200
  characters and no keyword, and no two NamedTuple classes of one state share a
  module, a name and fields (a reader could not tell them apart).

Checks in memory are of tree *structures*, once per structure (:data:`CHECKED`).
jax takes structures whose dict keys are equal as equal (``True``, ``1.0`` and
``np.int64(1)`` as ``1``; ``np.str_("a")`` and a str subclass's ``"a"`` as ``"a"``),
so a structure checked before vouches only for a tree whose keys are all of exactly
those types (:func:`exact_keys`).
"""

from __future__ import annotations

import collections
import itertools
import keyword
import operator
import re
import sys
import threading
from typing import Any

import jax
import numpy as np

from jaxreshard._src.errors import ReshardError

__all__ = [
  "CHECKED",
  "IDENTIFIER",
  "MAX_KEY_DEPTH",
  "MAX_KEYS_PER_HASH",
  "MAX_TREE_DEPTH",
  "UnstorableTree",
  "check_structure",
  "check_tree",
  "exact_keys",
  "key_code",
  "most_sharing_a_hash",
  "names_ok",
  "node",
]

# No node of a stored tree lies more keys than this below its root.
MAX_TREE_DEPTH = 200
# A dict key inside a tuple key nests at most this deep.
MAX_KEY_DEPTH = 16
# At most this many keys of one dict may share a hash (-1 and -2 share one in CPython).
MAX_KEYS_PER_HASH = 8
# A NamedTuple's class name and each of its fields.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}\Z")

_LEAF = jax.tree_util.tree_structure(0)


class UnstorableTree(ReshardError):
  """A state tree no checkpoint can hold, naming the node (its key path)."""


def key_code(key: Any, depth: int = 0) -> list | None:
  """A dict key's JSON: ``["s", str]``, ``["i", int]`` or ``["u", [codes]]`` for a
  tuple; None for a key of no code."""
  t = type(key)
  if t is str:
    return ["s", key]
  if t is int:
    return ["i", key]
  if t is tuple and depth < MAX_KEY_DEPTH:
    codes = [key_code(k, depth + 1) for k in key]
    return None if None in codes else ["u", codes]
  return None


def most_sharing_a_hash(keys: list) -> int:
  """How many of a dict's int or tuple keys share one hash, when more than
  ``MAX_KEYS_PER_HASH`` keys could (0 otherwise). A str's hash is seeded per
  process, so no file can choose it; an int's is the int modulo 2**61 - 1, and a
  tuple's follows from its items'."""
  if len(keys) <= MAX_KEYS_PER_HASH or type(keys[0]) is str:
    return 0
  hashes = np.fromiter(map(hash, keys), np.int64, len(keys))
  return int(np.unique(hashes, return_counts=True)[1].max())


def names_ok(name: Any, fields: Any) -> bool:
  """Whether a NamedTuple of this class name and fields can be re-created on reading."""
  return (
    isinstance(name, str)
    and bool(IDENTIFIER.match(name))
    and not keyword.iskeyword(name)
    and isinstance(fields, (list, tuple))
    and all(isinstance(f, str) and IDENTIFIER.match(f) and not keyword.iskeyword(f) for f in fields)
    and len(set(fields)) == len(fields)
  )


def _where(path: tuple) -> str:
  """A node's key path, its middle left out past 8 keys."""
  if len(path) <= 8:
    return f"state node at {path}"
  head, tail = ", ".join(map(repr, path[:4])), ", ".join(map(repr, path[-2:]))
  return f"state node at ({head}, ...{len(path) - 6} keys..., {tail})"


def _is_frozen_dict(x: Any) -> bool:
  # Only flax's own class, and only when flax is loaded (nothing is imported here).
  core = sys.modules.get("flax.core.frozen_dict")
  return core is not None and type(x) is getattr(core, "FrozenDict", None)


def _refused_keys(path: tuple, keys: list) -> UnstorableTree:
  """The refusal of a dict's keys, naming one that breaks the rule where one does
  (the first whose kind is not the first key's, or that has no code) and its
  type; tuple keys that cannot be sorted together name none."""
  first = type(keys[0]) if keys else None
  bad = [k for k in keys if type(k) is not first or key_code(k) is None][:1]
  named = "".join(f" (key {repr(k)[:80]}, of type {type(k).__name__})" for k in bad)
  return UnstorableTree(
    f"{_where(path)}: dict keys must be all str, all int or all tuples of"
    f" str, int and such tuples to be stored{named}"
  )


def _sorted_codes(x: dict, path: tuple) -> tuple[list, list]:
  """A dict's keys in jax's order (sorted), and their codes."""
  try:
    keys = sorted(x)
  except TypeError:
    raise _refused_keys(path, list(x)) from None
  return keys, _codes(keys, path)


def _codes(keys: list, path: tuple) -> list:
  """The codes of one mapping's keys, in the order given: all of one kind, each
  with a code, at most ``MAX_KEYS_PER_HASH`` of them sharing a hash."""
  if len({type(k) for k in keys}) > 1:
    raise _refused_keys(path, keys)
  codes = [key_code(k) for k in keys]
  if None in codes:
    raise _refused_keys(path, keys)
  most = most_sharing_a_hash(keys)
  if most > MAX_KEYS_PER_HASH:
    raise UnstorableTree(
      f"{_where(path)}: {most} keys of the dict share one hash (at most"
      f" {MAX_KEYS_PER_HASH}); a checkpoint holding them would not load"
    )
  return codes


def node(x: Any, path: tuple, classes: dict) -> tuple[str, Any, list]:
  """One node of a state's tree, as a checkpoint stores it: ``(kind, what, children)``.

  ``kind`` is ``"none"``, ``"leaf"``, ``"l"`` or ``"t"`` (list, tuple), ``"d"`` or
  ``"f"`` (dict, FrozenDict: ``what`` their keys' codes, in jax's order), ``"o"``
  (an OrderedDict: its keys' codes in its own order, which jax keeps), or ``"n"``
  (a NamedTuple: ``what`` its class, recorded in ``classes`` by (module, name,
  fields)); ``children`` are ``(key, child)`` pairs in jax's order.

  Raises:
    UnstorableTree: the node breaks a rule of the module's docstring.
  """
  if len(path) > MAX_TREE_DEPTH:
    raise UnstorableTree(
      f"{_where(path)}: the state tree is nested deeper than {MAX_TREE_DEPTH}, more than"
      " a checkpoint holds"
    )
  if x is None:
    return "none", None, []
  if isinstance(x, tuple) and hasattr(type(x), "_fields"):
    cls = type(x)
    fields = tuple(cls._fields)
    if not names_ok(cls.__name__, fields):
      raise UnstorableTree(
        f"{_where(path)}: NamedTuple {cls.__name__[:80]} with fields {list(fields)}: a checkpoint"
        " holds only names and fields that are ASCII identifiers of at most 200"
        " characters"
      )
    key = (cls.__module__, cls.__name__, fields)
    if classes.setdefault(key, cls) is not cls:
      raise UnstorableTree(
        f"{_where(path)}: two NamedTuple classes {cls.__module__}.{cls.__qualname__} with"
        f" fields {list(fields)} in one state, which a checkpoint cannot tell apart"
      )
    return "n", cls, list(zip(fields, x))
  t = type(x)
  if t is tuple or t is list:
    return ("t" if t is tuple else "l"), None, list(enumerate(x))
  frozen = _is_frozen_dict(x)
  if t is dict or frozen:
    keys, codes = _sorted_codes(x, path)
    return ("f" if frozen else "d"), codes, [(k, x[k]) for k in keys]
  if t is collections.OrderedDict:  # optax's named_chain: jax keeps its keys' order
    keys = list(x)
    codes = _codes(keys, path)
    return "o", codes, [(k, x[k]) for k in keys]
  if jax.tree_util.tree_structure(x) == _LEAF:
    return "leaf", None, []
  raise UnstorableTree(
    f"{_where(path)} is a {t.__module__}.{t.__qualname__}, a pytree node type jaxreshard"
    " cannot store (NamedTuple, dict, OrderedDict, flax's FrozenDict, list, tuple and None"
    " can be)"
  )


def check_tree(tree: Any) -> None:
  """Refuses a tree a checkpoint cannot store (:func:`node` of every node).

  Raises:
    UnstorableTree: naming the first such node, in jax's order.
  """
  if _plainly_storable(tree):
    return
  classes: dict = {}
  stack = [(tree, ())]
  while stack:
    x, path = stack.pop()
    _, _, children = node(x, path, classes)
    stack.extend((c, path + (k,)) for k, c in reversed(children))


def _plainly_storable(tree: Any) -> bool:
  """Whether ``tree`` (its leaves ints, as ``check_structure`` makes it) is made only of
  what every state holds and :func:`node` takes: None, dicts of str keys, lists,
  tuples, NamedTuples of valid names (one class per name and fields), within the
  depth. False sends it through :func:`node`, which names what it refuses."""
  classes: dict = {}
  stack = [(tree, 0)]
  while stack:
    x, depth = stack.pop()
    if depth > MAX_TREE_DEPTH:
      return False
    t = type(x)
    if t is int or x is None:
      continue
    if t is dict:
      if not all(type(k) is str for k in x):
        return False
      children = x.values()
    elif t is list or t is tuple:
      children = x
    elif isinstance(x, tuple) and hasattr(t, "_fields"):
      key = (t.__module__, t.__name__, tuple(t._fields))
      if classes.setdefault(key, t) is not t or not names_ok(t.__name__, t._fields):
        return False
      children = x
    else:
      return False
    stack.extend((c, depth + 1) for c in children)
  return True


_EXACT_KINDS = frozenset((str, int, tuple))


def exact_keys(tree: Any) -> bool:
  """Whether every key of every dict, OrderedDict and FrozenDict in ``tree`` is
  exactly a str, an int or a tuple of those (:func:`key_code`). Two such trees of
  equal jax structures are the same tree, keys and their types alike.

  Walked a level at a time, each level's nodes picked by type in C, not one by one.
  """
  frozen = getattr(sys.modules.get("flax.core.frozen_dict"), "FrozenDict", None)
  level = [tree]
  while level:
    types = list(map(type, level))
    below: list = []
    for t in set(types):
      of_t = map(operator.is_, types, itertools.repeat(t))
      if t is dict or t is collections.OrderedDict or t is frozen:
        nodes = list(itertools.compress(level, of_t))
        keys = list(itertools.chain.from_iterable(nodes))
        kinds = set(map(type, keys))
        if not kinds <= _EXACT_KINDS:
          return False
        if tuple in kinds and any(type(k) is tuple and key_code(k) is None for k in keys):
          return False
        below.extend(itertools.chain.from_iterable(map(t.values, nodes)))
      elif t is tuple or t is list or (issubclass(t, tuple) and hasattr(t, "_fields")):
        below.extend(itertools.chain.from_iterable(itertools.compress(level, of_t)))
    level = below
  return True


class _Checked:
  """Tree structures known storable, the most recent ``maxsize``; a structure is
  walked once (refused ones again at each call). A known structure vouches for a
  tree only when the tree's keys are exact (:func:`exact_keys`); a tree of other
  keys is walked, and refused."""

  def __init__(self, maxsize: int = 64):
    self.maxsize = maxsize
    self._lock = threading.Lock()
    self._known: dict[Any, None] = {}

  def check(self, treedef: Any, tree: Any = None) -> None:
    with self._lock:
      known = treedef in self._known
    if known and exact_keys(_indices(treedef) if tree is None else tree):
      return
    check_tree(_indices(treedef))
    with self._lock:
      if len(self._known) >= self.maxsize:
        self._known.pop(next(iter(self._known)))
      self._known[treedef] = None


def _indices(treedef: Any) -> Any:
  """The tree of ``treedef`` with its leaves' indices as leaves."""
  return jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))


CHECKED = _Checked()


def check_structure(treedef: Any, tree: Any = None) -> None:
  """:func:`check_tree` of a tree structure, walked once per structure.

  ``tree``, when given, is a tree of that structure (its keys are looked at when
  the structure is known; None looks at the structure's own).

  Raises:
    UnstorableTree: a structure no checkpoint can hold.
  """
  CHECKED.check(treedef, tree)

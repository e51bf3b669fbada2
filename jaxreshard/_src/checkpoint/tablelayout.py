"""A layout of a table index (format version 4): the state taken apart, its trees
decoded only when a state is built (see ``layout`` for what a layout answers).

The index's JSON holds the layout's *skeleton* (the state's tree with each optimizer
subtree, a *mirror*, replaced by a slot) and its table each mirror's params tree (the
param id at each position, in flatten order, and the tree's encoding, or nothing for
nested dicts of the ids' keys) and leaves (each position's buffer dtype, or masked,
and slots). Planning reads those arrays alone (``layout.Columns``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint.layout import ArchiveLayout, LeafInfo, _ScalarSlot, columns
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError

__all__ = ["Structure", "TableLayout", "canonical_text"]

_BAD_ESCAPE = re.compile("%(?!25|2F)")


def _nested(ids: Sequence[str]) -> Any:
  """``_structure.nested`` of ids numbered in order, split at ``/`` when no id escapes a
  key (the common case), one key at a time otherwise."""
  if any("%" in p for p in ids) or list(ids) == [""]:
    return _structure.nested(ids, dict(zip(ids, range(len(ids)))))
  root: dict = {}
  for i, pid in enumerate(ids):
    *parents, last = pid.split("/")
    node = root
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = i
  return root


class _Entries(Mapping):
  """A table mirror's ``param id -> LeafInfo or MASKED``, made when first read: building
  a state needs only the mirror's order and tree."""

  def __init__(self, ids, codes, slots, dtypes):
    self._args = (ids, codes, slots, dtypes)

  @functools.cached_property
  def _dict(self) -> dict[str, Any]:
    ids, codes, slots, dtypes = self._args
    return {
      pid: _structure.MASKED if c < 0 else LeafInfo(pid, (n,), dtypes[c])
      for pid, c, n in zip(ids, codes.tolist(), slots.tolist())
    }

  def __getitem__(self, key):
    return self._dict[key]

  def __iter__(self):
    return iter(self._dict)

  def __len__(self):
    return len(self._args[0])


class _TreeCache:
  """Decoded params trees by their content (tree text, the tuple of ids; ids may hold
  any character, so never a joined string of them): a process restoring one
  layout again (another rank, another step of the run) decodes its trees once."""

  def __init__(self, maxsize: int = 16):
    self.maxsize, self.lock, self.trees = maxsize, threading.Lock(), {}

  def get(self, key: tuple, make: Any) -> Any:
    with self.lock:
      hit = self.trees.get(key)
    if hit is None:
      hit = make()
      with self.lock:
        if len(self.trees) >= self.maxsize:
          self.trees.pop(next(iter(self.trees)))
        self.trees[key] = hit
    return hit


_TREES = _TreeCache()


@dataclasses.dataclass(frozen=True)
class Structure:
  """A params tree of a table layout: the id at each position and the tree's encoding
  (None: nested dicts of the ids' keys)."""

  ids: np.ndarray  # indices into the index's names, in flatten order
  tree: bytes  # encoded JSON (ASCII), or b"" for nested dicts


class TableLayout(ArchiveLayout):
  """A layout of format version 4: the skeleton decoded when the index is read, the
  mirrors' trees when a state is first built.

  Args:
    entry: the layout's JSON: ``{"skeleton": tree, "slots": [{"s": k} | {"m": j}],
      "mirrors": [structure of each mirror]}``.
    structures: the layout's params trees (``Structure``).
    mirrors: per mirror, per position of its structure: ``(codes, slots)`` arrays.
    names, dtypes: the index's.
    where: names the layout in refusals.
  """

  def __init__(
    self,
    entry: Any,
    structures: Sequence[Structure],
    mirrors: Sequence[tuple[np.ndarray, np.ndarray]],
    names: Sequence[str],
    dtypes: Sequence[np.dtype],
    where: str,
  ):
    self.where, self.names, self.dtypes = where, names, dtypes
    fmt.expect(entry, dict, where)
    if set(entry) != {"skeleton", "slots", "mirrors"}:
      raise ArchiveError(f"{where}: expected skeleton, slots and mirrors")
    self.entry = entry
    slots = fmt.expect(entry["slots"], list, where)
    refs = fmt.expect(entry["mirrors"], list, where)
    self.skeleton_slots: list[Any] = []
    n_scalars = n_mirrors = 0
    for i, x in enumerate(slots):
      if isinstance(x, dict) and set(x) == {"s"} and x["s"] == n_scalars and type(x["s"]) is int:
        self.skeleton_slots.append(_ScalarSlot(n_scalars))
        n_scalars += 1
      elif isinstance(x, dict) and set(x) == {"m"} and x["m"] == n_mirrors and type(x["m"]) is int:
        self.skeleton_slots.append(_structure.ParamsSubtreeSlot(n_mirrors))
        n_mirrors += 1
      else:
        raise ArchiveError(
          f"{where}, slot {i}: {fmt.short(x)}; clock scalars and mirrors must be numbered in order"
        )
    if n_mirrors != len(refs) or n_mirrors != len(mirrors):
      raise ArchiveError(
        f"{where}: its skeleton has {n_mirrors} mirrors but it lists {len(refs)}"
        f" and its table {len(mirrors)}"
      )
    self.structure_of = []
    for j, s in enumerate(refs):
      if type(s) is not int or not 0 <= s < len(structures):
        raise ArchiveError(f"{where}, mirror {j}: structure {fmt.short(s)} does not exist")
      if len(mirrors[j][0]) != len(structures[s].ids):
        raise ArchiveError(
          f"{where}, mirror {j}: {len(mirrors[j][0])} leaves for the"
          f" {len(structures[s].ids)} positions of its params tree"
        )
      self.structure_of.append(s)
    self.n_scalars = n_scalars
    self.structures = structures
    self.mirror_leaves = mirrors
    self.columns, self.sizes = columns(
      [(structures[s].ids, c, n) for s, (c, n) in zip(self.structure_of, mirrors)], dtypes, where
    )

  @functools.cached_property
  def _skeleton(self) -> tuple[Any, tuple[Any, ...], list[tuple[Any, ...]]]:
    """(treedef, leaves, path of each mirror) of the skeleton."""
    slots = self.skeleton_slots
    tree = fmt.decode_tree(self.entry["skeleton"], slots, self.where)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = tuple(x for _, x in with_path)
    if len(leaves) != len(slots) or any(a is not b for a, b in zip(leaves, slots)):
      raise ArchiveError(f"{self.where}: the skeleton's leaves are not numbered in flatten order")
    prefixes = [p for p, x in with_path if isinstance(x, _structure.ParamsSubtreeSlot)]
    return treedef, leaves, prefixes

  @functools.cached_property
  def skeleton_key(self) -> tuple[Any, ...]:
    treedef, leaves, _ = self._skeleton
    return (
      treedef,
      tuple(x.index if isinstance(x, _structure.ParamsSubtreeSlot) else None for x in leaves),
    )

  @functools.cached_property
  def _trees(self) -> dict[int, tuple[Any, tuple[str, ...]]]:
    """``(treedef, ids in flatten order)`` of each structure a mirror uses."""
    out = {}
    for s in sorted(set(self.structure_of)):
      st = self.structures[s]
      ids = tuple(self.names[i] for i in st.ids.tolist())
      out[s] = _TREES.get((st.tree, ids), lambda: self._decode(s, ids))
    return out

  def _decode(self, s: int, ids: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    st = self.structures[s]
    where = f"{self.where}, structure {s}"
    n = len(ids)
    if not st.tree:
      try:
        tree = _nested(ids) if n else {}
      except (TypeError, KeyError):
        tree = None
      got = None if tree is None else jax.tree_util.tree_flatten(tree)
      # An id names its keys exactly when every ``%`` in it starts an escape.
      if got is None or got[0] != list(range(n)) or _BAD_ESCAPE.search("\0".join(ids)):
        raise ArchiveError(f"{where}: its ids do not form a tree of nested dicts")
      return got[1], ids
    value = fmt.loads(st.tree.decode("ascii"), where)
    tree = fmt.decode_tree(value, list(range(n)), where)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if [x for _, x in with_path] != list(range(n)) or [
      _structure.path_id(p) for p, _ in with_path
    ] != list(ids):
      raise ArchiveError(f"{where}: its tree's key paths are not its ids in flatten order")
    return treedef, ids

  @functools.cached_property
  def state_parts(self) -> _structure.StateParts:
    treedef, leaves, prefixes = self._skeleton
    subtrees = []
    for j, s in enumerate(self.structure_of):
      sub_def, ids = self._trees[s]
      codes, slots = self.mirror_leaves[j]
      entries = _Entries(ids, codes, slots, self.dtypes)
      subtrees.append(_structure.ParamsSubtree(prefixes[j], sub_def, ids, entries))
    return _structure.StateParts(treedef, leaves, tuple(subtrees))

  @functools.cached_property
  def roles(self) -> tuple[str | None, ...]:
    """Per leaf of the state (flatten order): its param, or None for a clock scalar."""
    parts = self.state_parts
    out: list[str | None] = []
    for x in parts.skeleton_leaves:
      if isinstance(x, _structure.ParamsSubtreeSlot):
        codes = self.mirror_leaves[x.index][0].tolist()
        out.extend(p for p, c in zip(parts.subtrees[x.index].order, codes) if c >= 0)
      else:
        out.append(None)
    return tuple(out)

  def state(self, scalars: Sequence[Any], buffers: dict[tuple[str, int], Any]) -> Any:
    """The archive's state: clock scalars and history buffers put in the tree."""
    parts = self.state_parts
    leaves = []
    for x in parts.skeleton_leaves:
      if isinstance(x, _ScalarSlot):
        leaves.append(scalars[x.index])
        continue
      sub = parts.subtrees[x.index]
      codes = self.mirror_leaves[x.index][0].tolist()
      values = [
        optax.MaskedNode() if c < 0 else buffers[(p, x.index)] for p, c in zip(sub.order, codes)
      ]
      leaves.append(jax.tree_util.tree_unflatten(sub.treedef, values))
    return jax.tree_util.tree_unflatten(parts.skeleton, leaves)

  @functools.cached_property
  def digest_text(self) -> str:
    """The layout's canonical JSON, whose sha256 every archive.json of it records."""
    names = [d.name for d in self.dtypes]
    return canonical_text(
      self.entry,
      [
        (self.names_of(s), self.structures[s].tree.decode("ascii") or None)
        for s in self.structure_of
      ],
      [
        ([names[c] if c >= 0 else None for c in codes.tolist()], slots.tolist())
        for codes, slots in self.mirror_leaves
      ],
    )

  def names_of(self, s: int) -> list[str]:
    return [self.names[i] for i in self.structures[s].ids.tolist()]


def canonical_text(entry: dict, structures: list, mirrors: list) -> str:
  """A table layout as one canonical JSON text (compact, keys sorted, ASCII): ``[entry,
  [[ids, tree text or null] of each mirror's params tree], [[dtypes, slots] per mirror]]``."""
  return json.dumps(
    [entry, [list(s) for s in structures], [list(m) for m in mirrors]],
    separators=(",", ":"),
    sort_keys=True,
  )

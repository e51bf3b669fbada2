"""A state layout of the checkpoint index: the optax state's tree, its clock scalars and
its history buffers.

Each history buffer is ``(param, dtype, slots)`` in one optimizer subtree (a
*mirror* of the params: Adam's ``mu``, ``nu``); the layout knows where each lies
in the archive's packed buffer of its dtype (*packing order*: params sorted by
id, then the mirrors in order). A layout is read in one of two encodings:

* ``JsonLayout`` (format version 3): the whole state's tree in the index's
  JSON, its leaves numbered, each a clock scalar's slot or a history buffer;
  decoded when the index is read.
* ``TableLayout`` (format version 4): the state taken apart as
  ``_structure.StateParts`` does it: a small *skeleton* (the tree with each
  mirror replaced by a slot) in the JSON, and per mirror its params tree
  (the ids in flatten order) and per position the buffer's dtype and slots,
  in the index's binary table. Planning reads those arrays alone; the trees
  are decoded only when a state is built.

Both give the same arrays (``Columns``) to planning and the same ``StateParts``
to whatever builds a state.
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
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError

__all__ = ["ArchiveLayout", "Columns", "JsonLayout", "LeafInfo", "TableLayout"]

# Codes of a param's entry in one mirror (``Columns.hist``): absent, or masked;
# a buffer's code is its dtype's (>= 0).
ABSENT, MASKED = -2, -1
_BAD_ESCAPE = re.compile("%(?!25|2F)")


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """A history buffer of a layout: shape ``(slots,)`` and dtype, no data."""

  param: str
  shape: tuple[int]
  dtype: np.dtype

  @property
  def size(self) -> int:
    return self.shape[0]


@dataclasses.dataclass(frozen=True)
class _ScalarSlot:
  index: int


@dataclasses.dataclass(frozen=True)
class Columns:
  """A layout as arrays: its history buffers and, per param, its history.

  Attributes:
    name, mirror, dtype, slots, offset: per history buffer, in packing order:
      its param (index into the index's names), mirror, dtype (index into the
      index's dtypes), slots and first element in its dtype's packed buffer.
    names: the params the layout holds a history for (indices into the
      index's names, sorted), one row each of:
    hist: ``(rows, mirrors)`` int64: ``ABSENT``, ``MASKED`` or the buffer's dtype;
    hist_slots: ``(rows, mirrors)`` int64: the buffer's slots (0 where none).
  """

  name: np.ndarray
  mirror: np.ndarray
  dtype: np.ndarray
  slots: np.ndarray
  offset: np.ndarray
  names: np.ndarray
  hist: np.ndarray
  hist_slots: np.ndarray

  def rows_of(self, names: np.ndarray) -> np.ndarray:
    """The row of each name in ``names`` (-1 where the layout holds no history for it)."""
    at = np.minimum(np.searchsorted(self.names, names), max(len(self.names) - 1, 0))
    hit = (self.names[at] == names) if len(self.names) else np.zeros(len(names), bool)
    return np.where(hit, at, -1)


def columns(
  mirrors: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], dtypes: Sequence[np.dtype]
) -> tuple[Columns, dict[np.dtype, int]]:
  """``Columns`` and the packed size of each dtype, from per-mirror ``(names, codes,
  slots)`` arrays (one entry per position of the mirror; code ``MASKED`` for none)."""
  n_m = len(mirrors)
  name = np.concatenate([m[0] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  code = np.concatenate([m[1] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  slots = np.concatenate([m[2] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  mirror = np.repeat(np.arange(n_m, dtype=np.int64), [len(m[0]) for m in mirrors])
  names = np.unique(name)
  row = np.searchsorted(names, name)
  hist = np.full((len(names), n_m), ABSENT, np.int64)
  hist_slots = np.zeros((len(names), n_m), np.int64)
  hist[row, mirror] = code
  hist_slots[row, mirror] = np.where(code >= 0, slots, 0)
  buf = np.flatnonzero(code >= 0)
  order = buf[np.lexsort((mirror[buf], name[buf]))]  # packing order: by param, then mirror
  b_code, b_slots = code[order], slots[order]
  offset = np.zeros(len(order), np.int64)
  sizes: dict[np.dtype, int] = {}
  # Dtypes in the order their first buffer comes in the packing order.
  _, first = np.unique(b_code, return_index=True)
  for c in b_code[np.sort(first)].tolist():
    sel = b_code == c
    s = b_slots[sel]
    offset[sel] = np.cumsum(s) - s
    sizes[dtypes[c]] = int(s.sum())
  return Columns(
    name[order], mirror[order], b_code, b_slots, offset, names, hist, hist_slots
  ), sizes


class ArchiveLayout:
  """One state layout of the index: its arrays (``columns``, ``sizes``) and, made when
  first asked, its state parts, roles, histories and packing offsets by key.

  Subclasses give ``state_parts``, ``roles``, ``n_scalars`` and ``state``.
  """

  where: str
  n_scalars: int
  columns: Columns
  sizes: dict[np.dtype, int]
  names: Sequence[str]  # the index's param ids (``columns`` index into them)
  dtypes: Sequence[np.dtype]  # the index's dtypes (likewise)

  @functools.cached_property
  def n_mirrors(self) -> int:
    return self.columns.hist.shape[1]

  @functools.cached_property
  def skeleton_key(self) -> tuple[Any, ...]:
    """The state's structure and where each mirror sits (``_validate.skeleton_key``)."""
    p = self.state_parts
    return (
      p.skeleton,
      tuple(
        x.index if isinstance(x, _structure.ParamsSubtreeSlot) else None for x in p.skeleton_leaves
      ),
    )

  @functools.cached_property
  def offset_table(self) -> np.ndarray:
    """``(rows, mirrors)``: the packed offset of each param's buffer in each mirror, by
    ``columns`` row (-1 where it has none)."""
    c = self.columns
    table = np.full(c.hist.shape, -1, np.int64)
    table[c.rows_of(c.name), c.mirror] = c.offset
    return table

  @functools.cached_property
  def offsets(self) -> dict[tuple[str, int], tuple[np.dtype, int, int]]:
    """``(param, mirror) -> (dtype, first element, slots)`` of every history buffer."""
    c, names, dtypes = self.columns, self.names, self.dtypes
    return {
      (names[n], m): (dtypes[d], o, s)
      for n, m, d, o, s in zip(
        c.name.tolist(), c.mirror.tolist(), c.dtype.tolist(), c.offset.tolist(), c.slots.tolist()
      )
    }

  @functools.cached_property
  def histories(self) -> dict[str, tuple[Any, ...]]:
    """``state_parts.history`` of every param the layout holds, made in one pass."""
    n = len(self.state_parts.subtrees)
    table: dict[str, list[Any]] = {}
    for m, subtree in enumerate(self.state_parts.subtrees):
      for pid, info in subtree.entries.items():
        row = table.get(pid)
        if row is None:
          row = table[pid] = [None] * n
        row[m] = info
    return {pid: tuple(row) for pid, row in table.items()}

  def history(self, pid: str) -> tuple[Any, ...]:
    """Per subtree: the param's ``LeafInfo``, MASKED, or None where it is absent."""
    hit = self.histories.get(pid)
    return hit if hit is not None else (None,) * self.n_mirrors

  def infos(self) -> dict[tuple[str, int], LeafInfo]:
    """Every history buffer of the layout, by (param, mirror)."""
    return {
      (pid, m): info
      for m, subtree in enumerate(self.state_parts.subtrees)
      for pid, info in subtree.entries.items()
      if isinstance(info, LeafInfo)
    }

  def template(self, clock_id: int, scalars: Sequence[Any]) -> _structure.StateParts:
    """The state parts of an archive with this layout and clock (for building targets)."""
    templates = self.__dict__.setdefault("_templates", {})
    t = templates.get(clock_id)
    if t is None:
      # The layout's own parts with each clock scalar's slot replaced by its value:
      # scalars are leaves (arrays and numbers), so the tree is the one decoding the
      # layout with them in place would give, without decoding it again.
      p = self.state_parts
      skeleton_leaves = tuple(
        scalars[x.index] if isinstance(x, _ScalarSlot) else x for x in p.skeleton_leaves
      )
      t = templates[clock_id] = _structure.StateParts(p.skeleton, skeleton_leaves, p.subtrees)
    return t


def mirror_columns(
  state_parts: _structure.StateParts, name_of: dict[str, int], code_of: dict[np.dtype, int]
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Per mirror of ``state_parts`` (entries ``LeafInfo`` or MASKED): ``(names, codes,
  slots)`` of its positions, for ``columns``."""
  out = []
  for subtree in state_parts.subtrees:
    infos = [subtree.entries[p] for p in subtree.order]
    out.append(
      (
        np.fromiter((name_of[p] for p in subtree.order), np.int64, len(infos)),
        np.fromiter(
          (MASKED if x is _structure.MASKED else code_of[x.dtype] for x in infos),
          np.int64,
          len(infos),
        ),
        np.fromiter((0 if x is _structure.MASKED else x.size for x in infos), np.int64, len(infos)),
      )
    )
  return out


class JsonLayout(ArchiveLayout):
  """A layout of format version 3: the whole tree, decoded when the index is read."""

  def __init__(self, tree: Any, leaves: list[Any], where: str):
    self.tree = tree
    self.where = where
    self.leaves = leaves  # LeafInfo or _ScalarSlot, in tree-leaf order
    self.roles = tuple(x.param if isinstance(x, LeafInfo) else None for x in leaves)
    self.n_scalars = sum(isinstance(x, _ScalarSlot) for x in leaves)
    placeholder = fmt.decode_tree(tree, leaves, where)
    try:
      self.state_parts = _structure.state_parts(placeholder, self.roles)
    except _structure.StatePartsError as e:
      raise ArchiveError(f"{where}: {e}") from None
    # (param, mirror) of each history leaf, by the leaf's identity.
    self._keys = {
      id(info): (pid, mi)
      for mi, subtree in enumerate(self.state_parts.subtrees)
      for pid, info in subtree.entries.items()
      if isinstance(info, LeafInfo)
    }

  def attach(self, names: Sequence[str], name_of: dict, dtypes: Sequence[np.dtype]) -> None:
    """Its arrays, once the index's names and dtypes are known."""
    self.names, self.dtypes = names, dtypes
    code_of = {d: i for i, d in enumerate(dtypes)}
    self.columns, self.sizes = columns(mirror_columns(self.state_parts, name_of, code_of), dtypes)

  def state(self, scalars: Sequence[Any], buffers: dict[tuple[str, int], Any]) -> Any:
    """The archive's state: clock scalars and history buffers put in the tree."""
    leaves = [
      scalars[x.index] if isinstance(x, _ScalarSlot) else buffers[self._keys[id(x)]]
      for x in self.leaves
    ]
    return fmt.decode_tree(self.tree, leaves, self.where)


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
  """Decoded params trees by their content (tree text, ids): a process restoring one
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
      [(structures[s].ids, c, n) for s, (c, n) in zip(self.structure_of, mirrors)], dtypes
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
      out[s] = _TREES.get((st.tree, "\0".join(ids)), lambda: self._decode(s, ids))
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

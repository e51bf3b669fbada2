"""A state layout of the checkpoint index: the optax state's tree, its clock scalars and
its history buffers.

Each history buffer is ``(param, dtype, slots)`` in one optimizer subtree (a
*mirror* of the params: Adam's ``mu``, ``nu``); the layout knows where each lies
in the archive's packed buffer of its dtype (*packing order*: params sorted by
id, then the mirrors in order). A layout is read in one of two encodings:

* ``JsonLayout`` (format version 3): the whole state's tree in the index's
  JSON, its leaves numbered, each a clock scalar's slot or a history buffer;
  decoded when the index is read.
* ``tablelayout.TableLayout`` (format version 4): the state taken apart as
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
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import masks as _masks
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError

__all__ = ["ArchiveLayout", "Columns", "JsonLayout", "LeafInfo"]

# Codes of a param's entry in one mirror (``Columns.hist``): absent, or masked;
# a buffer's code is its dtype's (>= 0).
ABSENT, MASKED = -2, -1


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
  mirrors: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
  dtypes: Sequence[np.dtype],
  where: str,
) -> tuple[Columns, dict[np.dtype, int]]:
  """``Columns`` and the packed size of each dtype, from per-mirror ``(names, codes,
  slots)`` arrays (one entry per position of the mirror; code ``MASKED`` for none).

  A dtype whose buffers add up past ``fmt.MAX_EXTENT`` slots is refused: its
  packed buffer is an array too, and its offsets would wrap around int64.
  """
  n_m = len(mirrors)
  name = np.concatenate([m[0] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  code = np.concatenate([m[1] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  slots = np.concatenate([m[2] for m in mirrors]) if n_m else np.zeros(0, np.int64)
  mirror = np.repeat(np.arange(n_m, dtype=np.int64), [len(m[0]) for m in mirrors])
  names = _copyplan.unique_ints(name)
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
    if len(s) * int(s.max(initial=0)) > fmt.MAX_EXTENT and sum(s.tolist()) > fmt.MAX_EXTENT:
      raise ArchiveError(
        f"{where}: the {np.dtype(dtypes[c]).name} buffers of a layout add up to"
        f" {sum(s.tolist())} elements, past {fmt.MAX_EXTENT}"
      )
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
    if hit is None:
      hit = (None,) * self.n_mirrors
    # A param under a MaskedNode that stands for its subtree (``masks``' rule).
    return _masks.fill(hit, self.state_parts.subtrees, pid) if None in hit else hit

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
  """A layout of format version 3: the whole tree, decoded when the index is read,
  and taken apart (:meth:`take_apart`) once the params its archives list are known:
  they, and no other, find its mirrors of ``MaskedNode`` places alone, as an
  archive's own listing does in memory."""

  def __init__(self, tree: Any, leaves: list[Any], where: str):
    self.tree = tree
    self.where = where
    self.leaves = leaves  # LeafInfo or _ScalarSlot, in tree-leaf order
    self.roles = tuple(x.param if isinstance(x, LeafInfo) else None for x in leaves)
    self.n_scalars = sum(isinstance(x, _ScalarSlot) for x in leaves)
    self._placeholder = fmt.decode_tree(tree, leaves, where)

  def take_apart(self, listed: Collection[str]) -> None:
    """Its state parts, ``listed`` being the params of the archives that use it."""
    try:
      self.state_parts = _structure.state_parts(self._placeholder, self.roles, listed)
    except _structure.StatePartsError as e:
      raise ArchiveError(f"{self.where}: {e}") from None
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
    self.columns, self.sizes = columns(
      mirror_columns(self.state_parts, name_of, code_of), dtypes, self.where
    )

  def state(self, scalars: Sequence[Any], buffers: dict[tuple[str, int], Any]) -> Any:
    """The archive's state: clock scalars and history buffers put in the tree."""
    leaves = [
      scalars[x.index] if isinstance(x, _ScalarSlot) else buffers[self._keys[id(x)]]
      for x in self.leaves
    ]
    return fmt.decode_tree(self.tree, leaves, self.where)

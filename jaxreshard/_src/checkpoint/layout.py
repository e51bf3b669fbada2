"""A state layout of the checkpoint index: the optax state's tree with numbered leaves.

Each leaf is a clock scalar's slot or a history buffer's ``(param, dtype, slots)``;
the layout knows its roles, its state parts and where each history buffer lies
in the archive's packed buffer of its dtype (packing order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError

__all__ = ["ArchiveLayout", "LeafInfo"]


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


class ArchiveLayout:
  """One state layout of the index: tree, roles, history buffers, packing offsets."""

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
    self.offsets: dict[tuple[str, int], tuple[np.dtype, int, int]] = {}
    self.sizes: dict[np.dtype, int] = {}
    for pid, m, info in _copyplan.packing_order(
      {p: self.state_parts.history(p) for p in self.state_parts.param_set()}
    ):
      start = self.sizes.get(info.dtype, 0)
      self.offsets[(pid, m)] = (info.dtype, start, info.size)
      self.sizes[info.dtype] = start + info.size
    self._templates: dict[int, _structure.StateParts] = {}
    # (param, mirror) of each history leaf, by the leaf's identity.
    self._keys = {
      id(info): (pid, mi)
      for mi, subtree in enumerate(self.state_parts.subtrees)
      for pid, info in subtree.entries.items()
      if isinstance(info, LeafInfo)
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
    return hit if hit is not None else (None,) * len(self.state_parts.subtrees)

  def state(self, scalars: Sequence[Any], buffers: dict[tuple[str, int], Any]) -> Any:
    """The archive's state: clock scalars and history buffers put in the tree."""
    leaves = [
      scalars[x.index] if isinstance(x, _ScalarSlot) else buffers[self._keys[id(x)]]
      for x in self.leaves
    ]
    return fmt.decode_tree(self.tree, leaves, self.where)

  def infos(self) -> dict[tuple[str, int], LeafInfo]:
    """Every history buffer of the layout, by (param, mirror)."""
    return {
      key: info
      for info in self.leaves
      if isinstance(info, LeafInfo)
      for key in (self._keys[id(info)],)
    }

  def template(self, clock_id: int, scalars: Sequence[Any]) -> _structure.StateParts:
    """The state parts of an archive with this layout and clock (for building targets)."""
    t = self._templates.get(clock_id)
    if t is None:
      # The layout's own parts with each clock scalar's slot replaced by its value:
      # scalars are leaves (arrays and numbers), so the tree is the one decoding the
      # layout with them in place would give, without decoding it again.
      p = self.state_parts
      skeleton_leaves = tuple(
        scalars[x.index] if isinstance(x, _ScalarSlot) else x for x in p.skeleton_leaves
      )
      t = self._templates[clock_id] = _structure.StateParts(p.skeleton, skeleton_leaves, p.subtrees)
    return t

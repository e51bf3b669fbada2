"""A target rank's record made from its packed buffers: one view per leaf, one unflatten.

Every target rank of one layout has the same state structure: the template
archive's skeleton and clock scalars, with each history buffer at a fixed
offset of its dtype's packed buffer. :class:`Assembly` works that structure
out once (the tree structure, where each leaf comes from, the roles, the
placement columns), so a rank's state is a view per history buffer and one
``unflatten``, and its placements one constructor call per parameter. A
:class:`RankParts` holds one rank's buffers and makes both when its deferred
record is first read (``ShardRecord.deferred``).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.gcpause import no_gc
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord, deferred_parts

__all__ = ["Assembly", "RankParts", "current_parts", "deferred_record", "uniform_parts"]


class _Slot:
  """Stands for history buffer ``index`` (layout order) while the structure is worked out."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index


class Assembly:
  """The state structure of every target rank of one layout, and its placement columns.

  Attributes:
    roles: per leaf of the target state, the param id of a history buffer or
      None for a clock scalar (a record's ``roles``).
    dtypes: the packed buffers, in layout order.
    nbytes: the bytes of a target rank's history buffers.
  """

  def __init__(
    self, template: _structure.StateParts, facts: Sequence[Any], layout: Any, keys: Any = None
  ):
    """
    Args:
      template: the state parts whose skeleton and scalars every target takes.
      facts: the validated source facts of each row (parameter), in layout order.
      layout: the target's ``TargetLayout``.
      keys: ``structure.mirror_trees`` of the facts' groups (see ``build_state``).
    """
    built = [list(f.history) for f in facts]
    params = [f.param for f in facts]
    self.dtypes = tuple(layout.slots)
    # Per dtype, each history buffer's first and end element in its packed buffer:
    # lists of ints, which the cyclic collector does not track (slices it would).
    self._spans: list[tuple[np.dtype, list[int], list[int]]] = []
    self.nbytes = sum(np.dtype(d).itemsize * int(n) for d, n in layout.sizes.items())
    param_of: list[str] = []  # per history buffer, in layout order
    size_of: list[int] = []  # per history buffer: its view's elements and dtype
    dtype_of: list[np.dtype] = []
    # Per dtype, each buffer's place, slots, mirror, param row and element count.
    self._geometry: list[tuple[np.dtype, np.ndarray, ...]] = []
    counts = np.asarray([math.prod(f.shape) for f in facts], np.int64)
    for dtype in layout.slots:
      group, subtree, offset, size = layout.columns[dtype]
      self._spans.append((dtype, offset.tolist(), (offset + size).tolist()))
      self._geometry.append((dtype, offset, size, subtree, group, counts[group]))
      rows = group.tolist()
      for row, mirror, k in zip(rows, subtree.tolist(), itertools.count(len(param_of))):
        built[row][mirror] = _Slot(k)
      param_of.extend(map(params.__getitem__, rows))
      size_of.extend(size.tolist())
      dtype_of.extend(itertools.repeat(np.dtype(dtype), len(rows)))
    state = _structure.build_state(template, dict(zip(params, built)), keys=keys)
    leaves, self._treedef = jax.tree_util.tree_flatten(state)
    # Per leaf, its history buffer (layout order), or -1 for a clock scalar.
    buffer = np.fromiter(
      (x.index if type(x) is _Slot else -1 for x in leaves), np.int64, len(leaves)
    )
    is_buffer = buffer >= 0
    at_scalar = np.flatnonzero(~is_buffer).tolist()
    self._scalars = [leaves[i] for i in at_scalar]
    # Where each leaf comes from in a pool of the scalars, then every view.
    order = np.where(is_buffer, len(at_scalar) + buffer, np.cumsum(~is_buffer) - 1).tolist()
    self._order = tuple(order)
    self._pick = operator.itemgetter(*order) if len(order) > 1 else None
    self.roles = tuple(map((*param_of, None).__getitem__, buffer.tolist()))
    # What each leaf of a state made by ``state`` is: the positions of the history
    # views and the elements and dtype of each (one-dimensional, contiguous), and
    # (position, template scalar) of every numpy clock scalar (the leaves a caller
    # can change in place without replacing them).
    at_buffer = np.flatnonzero(is_buffer)
    which = buffer[at_buffer].tolist()
    self._views = (
      at_buffer.tolist(),
      list(map(size_of.__getitem__, which)),
      list(map(dtype_of.__getitem__, which)),
    )
    self._arrays = [(i, leaves[i]) for i in at_scalar if isinstance(leaves[i], np.ndarray)]
    self.params = tuple(f.param for f in facts)
    self._shapes = tuple(f.shape for f in facts)
    self._dtypes = tuple(f.dtype for f in facts)
    self._trainable = tuple(f.trainable for f in facts)

  def state(self, buffers: dict[np.dtype, np.ndarray]) -> tuple[Any, tuple[Any, ...]]:
    """The target state whose history buffers are views of ``buffers`` (one per
    dtype), and its leaves."""
    pool = list(map(_structure.own_scalar, self._scalars))
    for dtype, starts, stops in self._spans:
      pool.extend(map(buffers[dtype].__getitem__, map(slice, starts, stops)))
    if self._pick is not None:
      leaves = self._pick(pool)
    else:
      leaves = tuple(pool[i] for i in self._order)
    return self._treedef.unflatten(leaves), leaves

  @property
  def geometry(self) -> list[tuple[np.dtype, np.ndarray, ...]]:
    """Per dtype: each history buffer's offset, slots, mirror, param row and element
    count (int64 arrays, layout order)."""
    return self._geometry

  def made(self, state: Any, leaves: Sequence[Any]) -> bool:
    """Whether ``state``, made by ``state`` with ``leaves``, still is what it was made:
    the same tree structure and leaf objects, each history view with its shape,
    dtype and strides, each numpy clock scalar with its template's dtype, shape and
    bits. A caller may change any of these in place (a dict's key or a container's
    type, a view's ``shape``, ``dtype`` or ``strides``, ``count[...] = 7``) and the
    packed buffers then no longer say what the record holds."""
    now, treedef = jax.tree_util.tree_flatten(state)
    if treedef != self._treedef or len(now) != len(leaves):
      return False
    if not all(map(operator.is_, now, leaves)):
      return False
    for i, n, dtype in zip(*self._views):
      x = now[i]
      if x.shape != (n,) or x.dtype != dtype or x.strides != (dtype.itemsize,):
        return False
    for i, t in self._arrays:
      x = now[i]
      if x.dtype != t.dtype or x.shape != t.shape or x.tobytes() != t.tobytes():
        return False
    return True

  def nonzero_padding(
    self, buffers: dict[np.dtype, np.ndarray], rank: int, world: int
  ) -> tuple[str, tuple[int, ...], int, int] | None:
    """The first element with nonzero bits in the padding of target ``rank`` of
    ``world``'s packed ``buffers``, as (param, its shape, mirror, local index); None
    when every padding element is zero. Only buffers of flat-shard slots
    (``ceil(count / world)``) have padding; the work is one pass over it.
    """
    for dtype, offset, size, subtree, group, count in self._geometry:
      flat = size == -(-count // world)
      owned = np.clip(count - rank * size, 0, size)
      padded = np.flatnonzero(flat & (owned < size))
      if not padded.size:
        continue
      length = size[padded] - owned[padded]
      ends = np.cumsum(length)
      first = offset[padded] + owned[padded]
      # Every padding element's index, run after run: one gather, one scan.
      at = np.repeat(first - (ends - length), length) + np.arange(int(ends[-1]))
      bits = buffers[dtype].view(f"u{np.dtype(dtype).itemsize}")
      hit = np.flatnonzero(bits[at])
      if hit.size:
        j = int(hit[0])
        k = int(np.searchsorted(ends, j, side="right"))
        b = int(padded[k])
        local = int(owned[b]) + j - int(ends[k] - length[k])
        row = int(group[b])
        return self.params[row], self._shapes[row], int(subtree[b]), local
    return None

  def placements(self, ranks: Any, worlds: Any) -> tuple[ParamPlacement, ...]:
    """The placements of a target rank: ``ranks`` and ``worlds`` are one int each, or
    one per row."""
    n = len(self.params)
    ranks = itertools.repeat(ranks, n) if isinstance(ranks, int) else ranks
    worlds = itertools.repeat(worlds, n) if isinstance(worlds, int) else worlds
    return tuple(
      map(
        ParamPlacement.checked,
        self.params,
        self._shapes,
        ranks,
        worlds,
        self._dtypes,
        self._trainable,
      )
    )


class RankParts:
  """One target rank's packed buffers and what its deferred record is made with."""

  __slots__ = ("assembly", "buffers", "ranks", "worlds", "made", "shown", "given")

  def __init__(
    self,
    assembly: Assembly,
    buffers: dict[np.dtype, np.ndarray],
    ranks: Any,
    worlds: Any,
    placements: Any = None,
  ):
    self.assembly = assembly
    self.buffers = buffers
    self.ranks = ranks
    self.worlds = worlds
    self.made = placements
    self.shown: tuple[Any, tuple[Any, ...]] | None = None  # the state made, and its leaves
    self.given: Any = None  # the placements made

  def state(self) -> Any:
    # A view and a few containers per leaf, no reference cycles: the cyclic
    # collector is paused, as around the copy itself, or the allocations
    # trigger collections that walk every live object.
    with no_gc():
      state, leaves = self.assembly.state(self.buffers)
    self.shown = (state, leaves)
    return state

  def holds(self, state: Any) -> bool:
    """Whether ``state`` (its record's, once read) still holds the leaves made from
    the packed buffers: its containers are the caller's, who may put another
    buffer in one of them, and the packed buffers then no longer say what the
    record holds (``Assembly.made``)."""
    shown = self.shown
    if shown is None or shown[0] is not state:
      return False
    return self.assembly.made(state, shown[1])

  def placements(self) -> tuple[ParamPlacement, ...]:
    # One frozen object per parameter, no reference cycles: paused as for ``state``.
    with no_gc():
      if self.made is None:
        given = self.assembly.placements(self.ranks, self.worlds)
      else:
        given = self.made() if callable(self.made) else self.made
    self.given = given
    return given


def current_parts(record: ShardRecord) -> RankParts | None:
  """A deferred record's parts, when its packed buffers are what it holds: its state
  not read yet, or read and holding the leaves made from them (``holds``)."""
  parts = deferred_parts(record)
  if type(parts) is not RankParts:
    return None
  fields = record.__dict__
  placements = fields.get("placements")
  if placements is not None and placements is not parts.given:
    return None  # set by other means than a first read (the record is frozen)
  state = fields.get("state")
  return parts if state is None or parts.holds(state) else None


def _uniform(x: Any) -> int | None:
  """The one rank (or world size) of every row, or None when rows differ."""
  if type(x) is int:
    return x
  if isinstance(x, list) and x and type(x[0]) is int and x.count(x[0]) == len(x):
    return x[0]
  return None


def uniform_parts(record: Any) -> tuple[RankParts, int, int] | None:
  """A deferred record's parts, rank and world size, when every row has one of each."""
  if type(record) is not ShardRecord:
    return None
  parts = current_parts(record)
  if parts is None or record.__dict__.get("roles") is not parts.assembly.roles:
    return None
  rank, world = _uniform(parts.ranks), _uniform(parts.worlds)
  if rank is None or world is None:
    return None
  return parts, rank, world


def deferred_record(
  assembly: Assembly,
  buffers: dict[np.dtype, np.ndarray],
  ranks: Any,
  worlds: Any,
  placements: Any = None,
) -> ShardRecord:
  """A target record over ``buffers``, its placements and state made when first read.

  Args:
    assembly: the structure of the target's layout.
    buffers: the packed buffer of each of ``assembly.dtypes``.
    ranks, worlds: the target rank and world size: one int each, or a list
      with one per row.
    placements: the placements, when they were made already (frozen, they may be
      shared by every record of the rank), or what makes them when first read
      (a function of no arguments; it may return the rank's shared ones).
  """
  return ShardRecord.deferred(
    RECORD_VERSION, assembly.roles, RankParts(assembly, buffers, ranks, worlds, placements)
  )

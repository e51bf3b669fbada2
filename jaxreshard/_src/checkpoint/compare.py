"""Two checkpoints compared, whatever their layouts: ``jaxreshard verify``'s answer.

Identity is the digests' (``digestdiff.compare_digests``): the same structure,
clock scalars and every history buffer's bits. When a buffer's bits differ
(and both sides hold it with one dtype and size), its elements are compared
too, so that the answer says how: how many elements differ, the first one
with both values, and the largest absolute and relative difference
(relative to CHECKPOINT's value, the reference).

Elements are compared rank by rank: both checkpoints are resharded, one
target rank at a time, onto one common world size (the larger of theirs), so
rank ``r`` of each covers the same elements and memory holds two target
ranks at once, never a whole state.

A tolerance (``rtol``, ``atol``) accepts history buffers that differ by
rounding: an element is within it when ``|a - b| <= atol + rtol * |a|`` (NaN
only matches NaN, an infinity only itself). Jitted updates on different
devices or world sizes agree only to rounding, so two runs' states may be
equal within tolerance yet never bit-identical. Everything else (structure,
clock scalars, shapes, dtypes) is compared exactly, tolerance or not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import digestdiff as _digestdiff
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import values as _values
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["BufferDiff", "Comparison", "buffer_diffs", "compare_checkpoints"]


@dataclasses.dataclass(frozen=True)
class BufferDiff:
  """How one history buffer of two checkpoints differs, element by element.

  Attributes:
    param, buffer: which buffer (param id, index among its history buffers).
    dtype, count: its dtype and number of logical elements.
    differing: elements whose bits differ.
    first: the first such element's flat index, and ``a != b`` as text.
    max_abs, max_rel: the largest ``|a - b|`` and ``|a - b| / |a|`` over its
      elements (``inf`` where a NaN meets a number, or ``a`` is 0 and ``b`` is not).
    outside: elements outside the tolerance (all differing ones without one).
  """

  param: str
  buffer: int
  dtype: str
  count: int
  differing: int
  first: tuple[int, str] | None
  max_abs: float
  max_rel: float
  outside: int

  def text(self) -> str:
    """``param 'w' buffer 1: bits differ in 3 of 77 elements, first [5]: 0.5 != 0.25; ...``."""
    where = f"first [{self.first[0]}]: {self.first[1]}; " if self.first else ""
    return (
      f"param {self.param!r} buffer {self.buffer}: bits differ in {self.differing} of"
      f" {self.count} elements, {where}max abs diff {self.max_abs:.3g},"
      f" max rel diff {self.max_rel:.3g}"
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Two checkpoints compared: the differences, and how the buffers that differ do.

  Attributes:
    differences: ``(kind, text)`` of every difference, in ``compare_digests``'
      order; kind is ``problem``, ``structure``, ``scalar``, ``param`` or
      ``buffer``, and a buffer's text is its ``BufferDiff.text()``.
    buffers: the ``BufferDiff`` of each buffer whose bits differ and whose
      elements could be compared.
    tolerance: ``(rtol, atol)``, or None for bits only.
    digest, out_digest: both checkpoints' digests.
  """

  differences: tuple[tuple[str, str], ...]
  buffers: tuple[BufferDiff, ...]
  tolerance: tuple[float, float] | None
  digest: _digest.Digest
  out_digest: _digest.Digest

  @property
  def identical(self) -> bool:
    return not self.differences

  @property
  def within_tolerance(self) -> bool:
    """Every difference is a compared buffer, each element within the tolerance."""
    compared = {(b.param, b.buffer) for b in self.buffers}
    return (
      self.tolerance is not None
      and all(kind == "buffer" for kind, _ in self.differences)
      and len(compared) == len(self.differences)
      and all(b.outside == 0 for b in self.buffers)
    )


def compare_checkpoints(
  a: _digest.Digest,
  b: _digest.Digest,
  paths: tuple[Any, Any],
  *,
  names: tuple[str, str] | None = None,
  rtol: float | None = None,
  atol: float | None = None,
) -> Comparison:
  """Compares two checkpoints' digests, then the elements of every buffer whose bits differ.

  Args:
    a, b: the digests of the checkpoints at ``paths`` (CHECKPOINT, the
      reference, and OUT).
    paths: both checkpoint directories.
    names: what the differences call them (default: ``paths``).
    rtol, atol: a tolerance for history buffers (either may be given; the
      other is 0); None for bits only.
  """
  tolerance = None if rtol is None and atol is None else (float(rtol or 0), float(atol or 0))
  names = names or (str(paths[0]), str(paths[1]))
  found = _digestdiff.differences(a, b, names=names)
  keys = [key for kind, key, _ in found if kind == "buffer" and _comparable(a, b, key)]
  stats = buffer_diffs(paths, keys, a, tolerance) if keys else {}
  out = tuple(
    (kind, stats[key].text() if kind == "buffer" and key in stats else text)
    for kind, key, text in found
  )
  return Comparison(out, tuple(stats[k] for k in keys), tolerance, a, b)


def _comparable(a: _digest.Digest, b: _digest.Digest, key: tuple[str, int]) -> bool:
  pa, pb = a.params[key[0]], b.params[key[0]]
  if (pa.shape, pa.dtype) != (pb.shape, pb.dtype):
    return False
  ba, bb = pa.buffers[key[1]], pb.buffers[key[1]]
  return (ba.dtype, ba.count) == (bb.dtype, bb.count)


def _world(ckpt: _reader.Checkpoint) -> int:
  return max([g.world_size for g in ckpt.groups if g.ranks] or [1])


def buffer_diffs(
  paths: tuple[Any, Any],
  keys: Iterable[tuple[str, int]],
  a: _digest.Digest,
  tolerance: tuple[float, float] | None = None,
) -> dict[tuple[str, int], BufferDiff]:
  """Each buffer ``(param, index)`` of two checkpoints compared element by element.

  Both are restored one common target rank at a time (see the module doc).
  """
  keys = list(keys)
  ca, cb = (_reader.open_checkpoint(str(p)) for p in paths)
  world = max(_world(ca), _world(cb))
  acc = {k: _Stats(a.params[k[0]].buffers[k[1]].count, tolerance) for k in keys}
  for rank in range(world):
    ra, rb = (
      _restore.restore_ranks(str(p), [rank], world_size=world, checkpoint=c)[0]
      for p, c in ((paths[0], ca), (paths[1], cb))
    )
    ha, hb = _histories(ra), _histories(rb)
    for pid, m in keys:
      g = FlatShard(a.params[pid].shape, rank, world)
      acc[(pid, m)].add(g.start, ha[pid][m][: g.owned], hb[pid][m][: g.owned])
  return {k: acc[k].result(k, a.params[k[0]].buffers[k[1]].dtype) for k in keys}


def _histories(record: Any) -> dict[str, list[np.ndarray]]:
  parts = _structure.state_parts(
    record.state, _structure.roles_of(record), [p.param for p in record.placements]
  )
  return {
    pid: [np.asarray(h) for h in parts.history(pid) if h is not None and h is not _structure.MASKED]
    for pid in parts.param_set()
  }


class _Stats:
  """One buffer's running comparison, fed rank by rank."""

  def __init__(self, count: int, tolerance: tuple[float, float] | None):
    self.count, self.tolerance = count, tolerance
    self.differing = self.outside = 0
    self.first: tuple[int, str] | None = None
    self.max_abs = self.max_rel = 0.0

  def add(self, start: int, x: np.ndarray, y: np.ndarray) -> None:
    differ = _bitview.bits(x) != _bitview.bits(y)
    n = int(np.count_nonzero(differ))
    if not n:
      return
    self.differing += n
    if self.first is None:
      i = int(np.flatnonzero(differ)[0])
      self.first = (start + i, _values.pair_text(x[i], y[i]))
    xs, ys = x[differ], y[differ]
    wide = np.complex128 if np.iscomplexobj(xs) else np.float64
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
      # (ml_dtypes warns of a bfloat16 NaN cast to float64 as an invalid value.)
      xs, ys = xs.astype(wide), ys.astype(wide)
      diff = np.abs(xs - ys)
      same = (xs == ys) | (np.isnan(xs) & np.isnan(ys))  # -0.0 vs 0.0, NaN payloads, inf
      diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
      rel = np.where(diff == 0, 0.0, diff / np.abs(xs))
      rel = np.where(np.isnan(rel), np.inf, rel)
    self.max_abs = max(self.max_abs, float(diff.max()))
    self.max_rel = max(self.max_rel, float(rel.max()))
    if self.tolerance is None:
      self.outside += n
    else:
      rtol, atol = self.tolerance
      # Values that are the same (NaN against NaN, whatever their payloads) are inside
      # every tolerance; an infinite difference (an infinity or NaN against anything
      # but itself) is outside every one, even where ``rtol * |x|`` is infinite too.
      with np.errstate(invalid="ignore", over="ignore"):
        inside = same | (np.isfinite(diff) & (diff <= atol + rtol * np.abs(xs)))
      self.outside += int(np.count_nonzero(~inside))

  def result(self, key: tuple[str, int], dtype: str) -> BufferDiff:
    return BufferDiff(
      key[0], key[1], dtype, self.count, self.differing, self.first,
      self.max_abs, self.max_rel, self.outside,
    )  # fmt: skip

"""The digest of deferred records: later ranks of a layout hashed from their packed buffers.

A deferred record (``reshard``'s on the host, ``load_records``'s) holds one
packed buffer per dtype and the :class:`Assembly` that says where each history
buffer lies in them; every rank of one assembly and world size has the same
structure, clock, params and buffer geometry. The first such record is
digested param by param, as any record (every check ``digest_records`` makes);
what it gave is kept here, and every later rank of that assembly is digested
from its rank and buffers alone: the same checks of each param's metadata and
rank, and each buffer's owned elements fed to its stream, with no per-param
object made. A rank whose padding is not zero bits is digested param by param,
so that its problems are worded as ever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxreshard._src.core.assembly import uniform_parts
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["PackedRanks"]


@dataclasses.dataclass
class _Known:
  """What the first digested rank of one assembly and world size gave."""

  assembly: Any  # held, so that its id is not reused while this entry lives
  structure: str
  clock: Any
  names: list[str]  # the clock scalars' names
  pids: list[str]  # placement order
  keys: list[tuple]  # per pid, its metadata as ``add_placement`` keys it
  # Per pid, its buffers in ``add_placement``'s order: (m, dtype, offset, size, count).
  buffers: list[list[tuple[int, np.dtype, int, int, int]]]
  mirrors: tuple  # its param-mirroring subtrees, as ``add_rank_zero`` takes them


class PackedRanks:
  """The layouts ``digest_records`` has learnt from deferred records, for one call."""

  def __init__(self):
    self._known: dict[tuple[int, int], _Known] = {}

  def learn(
    self, acc: Any, record: Any, structure: Callable[[], tuple[str, Any, list]], mirrors: tuple
  ) -> None:
    """Keeps what ``record``, just digested param by param with no problem, gave ``acc``,
    when it is a deferred record whose buffers all have flat-shard slots (``structure``:
    its structure text, clock key and clock scalar names, made when needed; ``mirrors``:
    its param-mirroring subtrees)."""
    found = uniform_parts(record)
    if found is None:
      return
    parts, rank, world = found
    a = parts.assembly
    if (id(a), world) in self._known:
      return
    by_row: dict[int, list[tuple[int, np.dtype, int, int, int]]] = {}
    for dtype, offset, size, subtree, group, count in a.geometry:
      if not (size == -(-count // world)).all():
        return  # not flat shards: param by param, which says so
      for o, n, m, g, c in zip(
        offset.tolist(), size.tolist(), subtree.tolist(), group.tolist(), count.tolist()
      ):
        by_row.setdefault(g, []).append((m, np.dtype(dtype), o, n, c))
    row_of = {pid: i for i, pid in enumerate(a.params)}
    pids = [p.param for p in record.placements]
    if sorted(row_of) != sorted(pids) or len(pids) != len(row_of):
      return
    buffers = []
    for pid in pids:
      mine = sorted(by_row.get(row_of[pid], ()))  # mirror order: add_placement's ``m``
      buffers.append([(j, d, o, n, c) for j, (_, d, o, n, c) in enumerate(mine)])
    keys = [acc.meta[pid] for pid in pids]
    text, clock, names = structure()
    self._known[(id(a), world)] = _Known(a, text, clock, names, pids, keys, buffers, mirrors)

  def add(self, acc: Any, index: int, record: Any) -> bool:
    """Digests archive ``index`` from its rank and buffers alone, as ``digest_records``
    would param by param; False when ``record`` is not a deferred record of a known
    layout with zero padding (the caller digests it param by param)."""
    found = uniform_parts(record)
    if found is None:
      return False
    parts, rank, world = found
    known = self._known.get((id(parts.assembly), world))
    if known is None or known.assembly is not parts.assembly or not 0 <= rank < world:
      return False
    buffers = parts.buffers
    if parts.assembly.nonzero_padding(buffers, rank, world) is not None:
      return False
    bits = {d: _bitview.bits(b) for d, b in buffers.items()}
    acc.check_structure(index, known.structure, known.clock, known.names)
    if rank == 0:
      acc.add_rank_zero(known.pids, known.mirrors)
    meta, seen_ranks, problems, streams = acc.meta, acc.seen_ranks, acc.problems, acc.streams
    for pid, key, mine in zip(known.pids, known.keys, known.buffers):
      if meta.setdefault(pid, key) != key:
        problems.append(
          f"param {pid!r}: archive {index} disagrees with another archive on its shape,"
          f" dtype, trainability, world size, history or key path"
        )
        continue
      seen = seen_ranks.setdefault(pid, set())
      if rank in seen:
        problems.append(f"param {pid!r}: rank {rank} appears in more than one archive")
        continue
      seen.add(rank)
      for m, dtype, offset, size, count in mine:
        stream = streams.get((pid, m))
        if stream is None:
          stream = streams[(pid, m)] = acc.new_stream(dtype)
        elif stream.dtype != dtype:
          problems.append(
            f"param {pid!r} buffer {m} (archive {index}, rank {rank}): dtype {dtype.name}"
            f" differs from another rank's {stream.dtype.name}"
          )
          continue
        owned = min(max(count - rank * size, 0), size)
        stream.feed(rank, bits[dtype][offset : offset + owned])
    return True

"""The index's param entries, and the archives, ranks and world sizes that hold each.

A param entry is one parameter as the index lists it: ``[id, logical shape,
storage dtype, trainable]``. The writer registers each archive's placements
here as it is written; the index's ``params`` and ``groups``, and the
placements digest each ``archive.json`` records, are made from them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import numpy as np

from jaxreshard._src.checkpoint import tableindex as _tableindex
from jaxreshard._src.checkpoint.index import _param_term, _placements_digest
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import ParamPlacement

__all__ = ["ParamEntries"]


class ParamEntries:
  """Param entries in the order first seen, and their members ``(archive, rank, W)``.

  ``table``: whether the index keeps its layouts in a binary table, which lists
  param entries sorted by their JSON text and digests an archive's placements
  from those texts (``tableindex``); otherwise from each entry's term.
  """

  def __init__(self, table: bool):
    self.table = table
    self.params: list[list] = []
    self._params: dict[tuple, int] = {}
    self._entry_text: list[str] = []  # param entry -> its compact JSON (a table's)
    self._terms: list[int] = []  # param entry -> its term in a placement digest
    self._members: dict[int, list[tuple[int, int, int]]] = {}  # param entry -> (archive, rank, W)
    self._bucket_digests: dict[tuple, str] = {}  # a table's digests of sets of param entries

  def add(self, index: int, placements: Iterable[ParamPlacement]) -> str:
    """Registers archive ``index``'s placements; returns its placements digest."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for p in placements:
      FlatShard(p.shape, p.rank, p.world_size)  # a placement the format can describe
      key = (p.param, p.shape, p.dtype, bool(p.trainable))
      e = self._params.setdefault(key, len(self._params))
      if e == len(self.params):
        self.params.append([p.param, list(p.shape), np.dtype(p.dtype).name, bool(p.trainable)])
        if self.table:
          self._entry_text.append(json.dumps(self.params[e], separators=(",", ":")))
        else:
          self._terms.append(_param_term(self.params[e]))
      self._members.setdefault(e, []).append((index, p.rank, p.world_size))
      buckets.setdefault((p.world_size, p.rank), []).append(e)
    return self._placements_digest(buckets)

  def _placements_digest(self, buckets: dict[tuple[int, int], list[int]]) -> str:
    """The placements digest of one archive's param entries at each (W, rank)."""
    if not self.table:
      return _placements_digest(
        {key: sum(self._terms[e] for e in es) for key, es in buckets.items()}
      )
    hashes = {}
    for key, es in buckets.items():
      # A table lists param entries sorted by their JSON text: a bucket's are hashed so.
      ident = tuple(sorted(es))
      h = self._bucket_digests.get(ident)
      if h is None:
        texts = sorted(self._entry_text[e] for e in es)
        h = hashlib.sha256(f"[{','.join(texts)}]".encode("ascii")).hexdigest()
        self._bucket_digests[ident] = h
      hashes[key] = h
    return _tableindex.placements_digest(hashes)

  def groups(self) -> list[dict]:
    """Param entries split the same way, merged into one group."""
    merged: dict[tuple, list[int]] = {}
    for e, members in self._members.items():
      worlds = {w for _, _, w in members}
      for w in sorted(worlds):
        ranks = tuple((a, r) for a, r, ww in members if ww == w)
        merged.setdefault((w, ranks), []).append(e)
    return [
      {"world_size": w, "params": sorted(es), "ranks": [list(x) for x in ranks]}
      for (w, ranks), es in merged.items()
    ]

  def listed(self) -> tuple[list[list], list[dict]]:
    """The index's ``params`` and ``groups``: with a table, the entries sorted by
    their JSON text (and the groups' entries renumbered so); else in the order
    first seen."""
    if not self.table:
      return self.params, self.groups()
    order = sorted(range(len(self.params)), key=self._entry_text.__getitem__)
    new = {e: i for i, e in enumerate(order)}
    groups = [{**g, "params": sorted(new[e] for e in g["params"])} for g in self.groups()]
    return [self.params[e] for e in order], groups

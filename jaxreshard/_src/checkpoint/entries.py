"""The index's param entries, and the archives, ranks and world sizes that hold each.

A param entry is one parameter as the index lists it: ``[id, logical shape,
storage dtype, trainable]``. The writer registers each archive's placements
here as it is written; the index's ``params`` and ``groups``, and the
placements digest each ``archive.json`` records, are made from them.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import tableindex as _tableindex
from jaxreshard._src.checkpoint.index import _param_term, _placements_digest
from jaxreshard._src.core.placement import ParamPlacement

__all__ = ["ParamEntries"]


class ParamEntries:
  """Param entries in the order first seen, and the archives that hold them.

  Each archive registers one block per ``(world size, rank)`` it holds params
  at: the set of param entries there. Ranks of one layout hold the same set,
  which is kept once (``block``) and digested once, so registering a rank
  whose set is known costs nothing per param.

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
    self._sets: dict[tuple[int, ...], int] = {}  # a set of param entries -> its block id
    self._set_list: list[tuple[int, ...]] = []  # block id -> its param entries
    self._set_digests: dict[int, Any] = {}  # block id -> its term sum, or a table's sha256
    self._blocks: list[tuple[int, int, int, int]] = []  # (archive, block id, rank, W), in order
    # The blocks the last ``add`` registered: ((W, rank), block id) each.
    self.last: list[tuple[tuple[int, int], int]] = []

  def add(self, index: int, placements: Iterable[ParamPlacement]) -> str:
    """Registers archive ``index``'s placements; returns its placements digest.

    Each placement's geometry (shape, rank, world size) is one the format can
    describe: the writer's history checks (``historycheck``) vouch for it first.
    """
    buckets: dict[tuple[int, int], list[int]] = {}
    for p in placements:
      key = (p.param, p.shape, p.dtype, bool(p.trainable))
      e = self._params.setdefault(key, len(self._params))
      if e == len(self.params):
        self.params.append([p.param, list(p.shape), np.dtype(p.dtype).name, bool(p.trainable)])
        if self.table:
          self._entry_text.append(json.dumps(self.params[e], separators=(",", ":")))
        else:
          self._terms.append(_param_term(self.params[e]))
      # As Python ints: a numpy integer (np.int32(1)) is a rank every path takes
      # (``FlatShard`` reads it with ``operator.index``), but no JSON value.
      buckets.setdefault((operator.index(p.world_size), operator.index(p.rank)), []).append(e)
    self.last = []
    for key, es in buckets.items():
      block = self._sets.setdefault(tuple(es), len(self._sets))
      if block == len(self._set_list):
        self._set_list.append(tuple(es))
      self.last.append((key, block))
    for (w, r), block in self.last:
      self._blocks.append((index, block, r, w))
    return self._placements_digest(self.last)

  def add_block(self, index: int, block: int, rank: int, world: int) -> str:
    """Registers archive ``index`` as holding the known set ``block`` (one of ``last``'s)
    at ``rank`` of ``world``, and nothing else; returns its placements digest."""
    self._blocks.append((index, block, rank, world))
    return self._placements_digest([((world, rank), block)])

  def _placements_digest(self, buckets: list[tuple[tuple[int, int], int]]) -> str:
    """The placements digest of one archive's blocks of param entries at each (W, rank)."""
    if not self.table:
      return _placements_digest({key: self._set_digest(block) for key, block in buckets})
    return _tableindex.placements_digest({key: self._set_digest(block) for key, block in buckets})

  def _set_digest(self, block: int) -> Any:
    """A block's sum of param terms or, with a table, the sha256 of the JSON list of
    its param entries sorted by their JSON text (as a table lists them)."""
    d = self._set_digests.get(block)
    if d is None:
      es = self._set_list[block]
      if not self.table:
        d = sum(self._terms[e] for e in es)
      else:
        texts = sorted(self._entry_text[e] for e in es)
        d = hashlib.sha256(f"[{','.join(texts)}]".encode("ascii")).hexdigest()
      self._set_digests[block] = d
    return d

  def groups(self) -> list[dict]:
    """Param entries split the same way (the same ranks of each world size, in the
    order registered), merged into one group; groups in the order of their first
    entry, and a param's world sizes in increasing order."""
    # Entries held by the same blocks are split the same way: one class each.
    held_by: list[list[int]] = [[] for _ in self.params]
    for block, es in enumerate(self._set_list):
      for e in es:
        held_by[e].append(block)
    classes: dict[tuple[int, ...], int] = {}
    class_of = [classes.setdefault(tuple(b), len(classes)) for b in held_by]
    classes_of_block: dict[int, list[int]] = {}
    for blocks, c in classes.items():
      for block in blocks:
        classes_of_block.setdefault(block, []).append(c)
    members: list[list[tuple[int, int, int]]] = [[] for _ in classes]
    for a, block, r, w in self._blocks:
      for c in classes_of_block.get(block, ()):
        members[c].append((a, r, w))
    splits: dict[tuple, int] = {}  # (W, ranks) -> its group's number
    split_of: list[list[int]] = []  # class -> its splits, world sizes increasing
    for ms in members:
      split_of.append(
        [
          splits.setdefault((w, tuple((a, r) for a, r, ww in ms if ww == w)), len(splits))
          for w in sorted({w for _, _, w in ms})
        ]
      )
    merged: dict[int, list[int]] = {}
    for e, c in enumerate(class_of):
      for k in split_of[c]:
        merged.setdefault(k, []).append(e)
    keys = list(splits)
    return [
      {"world_size": keys[k][0], "params": es, "ranks": [list(x) for x in keys[k][1]]}
      for k, es in merged.items()
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

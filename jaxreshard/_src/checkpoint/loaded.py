"""Whole archives as deferred records: what ``load_records`` returns for uniform groups.

An archive that holds one rank of one uniform group (every archive of the group
has one layout, one clock and the group's slots) packs its history buffers as a
target rank of that group packs them: params sorted by id, then mirrors in
order, each buffer the group's flat-shard slots. Its record is then the
group's :class:`Assembly` over the archive's packed buffers, read whole: its
placements and state are made when first read, and a save writes its buffers
as they are, with the index entries of the first archive of that assembly (the
writer's ``DeferredLayouts``). Other archives are read leaf by leaf
(``Checkpoint.plain_record``); both give the same record.

One :class:`LoadedArchives` may serve several checkpoints (a merge's parts): an
assembly whose state structure, clock scalars, params and packing equal, in
full, one made before is that one, so that every part's archives are written
as one layout.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import clockjson as _clockjson
from jaxreshard._src.checkpoint import groupfacts as _groupfacts
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.assembly import Assembly, deferred_record
from jaxreshard._src.core.record import ShardRecord

__all__ = ["LoadedArchives"]


class LoadedArchives:
  """The assemblies whole archives are loaded with: one per checkpoint, group and clock,
  and one per distinct content. A ``Checkpoint`` owns one (``Checkpoint.loaded``); a
  merge owns one for all its parts."""

  def __init__(self):
    # (checkpoint, group, clock) -> a weak reference to the checkpoint (its id may be
    # reused once it is gone; a checkpoint owns this object, which must not keep it
    # alive) and its assembly, or None where the archives do not pack as a target rank.
    self._made: dict[tuple[int, int, int], tuple[Any, Assembly | None]] = {}
    self._content: dict[Any, list[tuple[tuple, Assembly]]] = {}  # by a cheap key
    # (index content digest, group, archive) -> the assembly made for it, or None: an
    # index of the same content gives the same one (a merge's one-rank parts).
    self._by_index: dict[tuple[str, int, int], Assembly | None] = {}

  def record(self, ckpt: Any, archive: int) -> ShardRecord | None:
    """Archive ``archive`` of ``ckpt`` read whole, as a deferred record; None when it
    does not pack as its group's target rank (read leaf by leaf then)."""
    member = ckpt.member[archive]
    if len(member) != 1:
      return None
    gi, rank = member[0]
    if not ckpt.memo.is_uniform(ckpt, gi):
      return None
    key = (id(ckpt), gi, ckpt.archive_clock[archive])
    hit = self._made.get(key)
    if hit is None or hit[0]() is not ckpt:
      hit = self._made[key] = (weakref.ref(ckpt), self._assembly(ckpt, gi, archive))
    assembly = hit[1]
    if assembly is None:
      return None
    world = ckpt.groups[gi].world_size
    archives = ckpt.archives
    buffers = {d: archives.read_buffer(archive, d) for d in assembly.dtypes}
    if assembly.nonzero_padding(buffers, rank, world) is not None:
      for d, data in buffers.items():  # the archive's own refusal, with its words
        archives.check_padding_of(archive, d, data)
    return deferred_record(assembly, buffers, rank, world)

  def _assembly(self, ckpt: Any, gi: int, archive: int) -> Assembly | None:
    """The assembly of group ``gi`` with ``archive``'s clock, when the archive's layout
    packs exactly as that assembly's target layout does; an equal one made before
    when there is one.

    It is made of the index alone, never of a rank: an index of the same content
    (``Index.content``) gives the same answer for the same group and archive."""
    content = ckpt.index.content
    if content is None:
      return self._made_assembly(ckpt, gi, archive)
    key = (content, gi, archive)
    if key not in self._by_index:
      self._by_index[key] = self._made_assembly(ckpt, gi, archive)
    return self._by_index[key]

  def _made_assembly(self, ckpt: Any, gi: int, archive: int) -> Assembly | None:
    group = ckpt.groups[gi]
    table = _groupfacts.group_facts(ckpt, gi, tuple(a for a, _ in group.ranks))
    if len(table) != len(group.params):
      return None  # a param fails a check: read leaf by leaf, which refuses it
    facts = [table[k] for k in sorted(table)]
    slots = np.fromiter((f.source.slots for f in facts), np.int64, len(facts))
    target = _copyplan.packed_layout(slots, facts)
    layout = ckpt.layout(archive)
    if not _packs_as(layout, facts, target) or not _sorted_dicts(getattr(layout, "tree", None)):
      return None
    template = ckpt.template(archive)
    # Groups of other params never share a bucket: an expert layout's thousands of
    # groups, alike in size, would each be compared with every one made before.
    cheap = (group.world_size, tuple(f.param for f in facts), tuple(target.sizes.items()))
    content = _content(template, facts, target)
    for seen, made in self._content.get(cheap, ()):
      if seen == content:
        return made
    made = Assembly(template, facts, target)
    self._content.setdefault(cheap, []).append((content, made))
    return made


def _packs_as(layout: Any, facts: list, target: _copyplan.TargetLayout) -> bool:
  """``layout`` (an archive's) holds every history buffer where ``target`` puts it."""
  if not all(target.sizes.values()) or dict(layout.sizes) != target.sizes:
    return False
  offsets = layout.offsets
  if len(offsets) != sum(len(s) for s in target.slots.values()):
    return False
  for dtype, slots_of in target.slots.items():
    for s in slots_of:
      if offsets.get((facts[s.group].param, s.subtree)) != (dtype, s.offset, s.size):
        return False
  return True


def _sorted_dicts(tree: Any) -> bool:
  """Every dict of an encoded state tree (a version-3 layout's) lists its keys in the
  order jax flattens them (sorted), as every index the writer makes does. An index
  that lists them in another order is read as it says, leaf by leaf: an assembly's
  state is unflattened, which sorts them."""
  todo = [tree]
  while todo:
    node = todo.pop()
    if type(node) is not list or not node or type(node[-1]) is not list:
      continue
    if node[0] in ("d", "f") and len(node) == 3 and type(node[1]) is list:
      keys = [k[1] if type(k) is list and len(k) == 2 else k for k in node[1]]
      try:
        if keys != sorted(keys):
          return False
      except TypeError:
        return False
    todo.extend(node[-1])
  return True


def _content(template: _structure.StateParts, facts: list, target: Any) -> tuple:
  """Everything an assembly is made of, comparable with ``==``: the state's skeleton
  and mirrors, each clock scalar as the index encodes it (type, dtype, weak type,
  bits), every param's facts and the packing."""
  scalars = [
    ["mirror", x.index]
    if isinstance(x, _structure.ParamsSubtreeSlot)
    else _clockjson.encode_scalar(x, "a clock scalar")
    for x in template.skeleton_leaves
  ]
  return (
    template.skeleton,
    json.dumps(scalars, sort_keys=True),
    template.subtrees,
    tuple((f.param, f.shape, f.dtype, f.trainable, f.history, f.buffer_dtypes) for f in facts),
    target.slots,
  )

"""Partial checkpoints (some ranks of one reshard's target) and their merge.

A reshard run once per target rank (or per host) writes one partial
checkpoint each. Every part's index names its source (``_reader.Source``):
the checkpoint it was resharded from, the target world size and the target's
layout. Parts merge into one checkpoint only when they are parts of one
reshard: one source checkpoint, one world size, one layout, one optimizer
clock, and disjoint ranks that together are all of them. Anything else is
refused before a byte is written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import locate as _locate
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import values as _values
from jaxreshard._src.checkpoint.loaded import LoadedArchives
from jaxreshard._src.checkpoint.reader import Checkpoint, Source
from jaxreshard._src.checkpoint.store import save_records
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, PlacementError

__all__ = ["MergePlan", "archive_ranks", "merge_parts", "merge_plan", "refuse_partial"]


def archive_ranks(ckpt: Checkpoint) -> tuple[set[int], dict[int, int]]:
  """The world sizes of a checkpoint's groups, and the one rank each archive holds.

  Raises:
    PlacementError: an archive holding different ranks of different groups
      (not the output of a reshard, so not a part to merge).
  """
  worlds: set[int] = set()
  rank_of: dict[int, int] = {}
  for g in ckpt.groups:
    worlds.add(g.world_size)
    for a, r in g.ranks:
      if rank_of.setdefault(a, r) != r:
        raise PlacementError(
          f"{ckpt.directory}: archive {a} holds rank {rank_of[a]}"
          f" of one group and rank {r} of another"
        )
  return worlds, rank_of


def refuse_partial(path: Any, ckpt: Checkpoint) -> None:
  """Refuses a part of a reshard's output (some ranks of its one world size), plainly.
  A checkpoint that names no source is no part to merge: its missing ranks are
  refused as every restore refuses them."""
  if ckpt.source is None:
    return
  try:
    worlds, rank_of = archive_ranks(ckpt)
  except PlacementError:
    return  # not a reshard's output: complete_groups says what is wrong
  held = sorted(set(rank_of.values()))
  if (
    len(worlds) == 1
    and len(held) == len(rank_of) == len(ckpt)
    and held != list(range(next(iter(worlds))))
  ):
    raise PlacementError(
      f"{path} is a partial checkpoint: ranks {held[:64]} of {next(iter(worlds))};"
      " combine the parts with `jaxreshard merge OUT PART...` first"
    )


@dataclasses.dataclass(frozen=True)
class MergePlan:
  """Every rank's (part, archive), in rank order, and the source the parts share."""

  order: tuple[tuple[Checkpoint, int], ...]
  source: Source

  @property
  def world_size(self) -> int:
    return len(self.order)


@dataclasses.dataclass(frozen=True)
class _Part:
  path: Any
  ckpt: Checkpoint
  world: int
  rank_of: dict[int, int]
  source: Source


def _open_part(path: Any, layouts: dict[tuple[str, int], str]) -> _Part:
  """A part checked on its own: archives present, one world size, a source it matches.

  ``layouts``: ``(index content, archive) -> its target layout``, of the archives of
  the parts opened before. An archive's target layout is made of its index alone
  (params, groups, layout), never of a rank, so an index of the same content
  (``Index.content``) has the same one.
  """
  ckpt = _reader.open_checkpoint(path)
  for i in range(len(ckpt)):  # present, and belonging to this part
    ckpt.archive_meta(i)
    ckpt.check_archive(i)
  worlds, rank_of = archive_ranks(ckpt)
  if len(worlds) != 1:
    raise PlacementError(
      f"{path} holds world sizes {sorted(worlds)}; merge combines parts of one world size"
    )
  if ckpt.source is None:
    raise PlacementError(
      f"{path} names no checkpoint it was resharded from (not an output of"
      " `jaxreshard reshard`); merge combines parts of one reshard"
    )
  content = ckpt.index.content
  for a in range(len(ckpt)):
    layout = None if content is None else layouts.get((content, a))
    if layout is None:
      layout = _reader.target_layout(ckpt.placements(a), ckpt.layout(a).state_parts)
      if content is not None:
        layouts[content, a] = layout
    if layout != ckpt.source.layout:
      raise ArchiveError(f"{path}: archive {a} does not have the target layout its index declares")
  return _Part(path, ckpt, next(iter(worlds)), rank_of, ckpt.source)


def _params(ckpt: Checkpoint) -> dict[str, tuple]:
  return {e.param: (e.shape, e.dtype.name, e.trainable) for e in ckpt.params}


def _layout_mismatch(part: _Part, first: _Part) -> str:
  """Words naming where ``part``'s target layout differs from ``first``'s ('' if nowhere)."""
  if part.source.layout == first.source.layout:
    return ""
  mine, theirs = _params(part.ckpt), _params(first.ckpt)
  if sorted(mine) != sorted(theirs):
    return f"{part.path} holds other parameters than {first.path}"
  for pid in sorted(mine):
    if mine[pid] != theirs[pid]:
      (shape, dtype, train), (shape0, dtype0, train0) = mine[pid], theirs[pid]
      what = lambda s, d, t: f"shape {s}, dtype {d}{'' if t else ', frozen'}"
      return (
        f"{part.path} has param {repr(pid)} of"
        f" {what(shape, dtype, train)} but {first.path} of"
        f" {what(shape0, dtype0, train0)}"
      )
  return f"{part.path} has other history buffers (optimizer state dtypes) than {first.path}"


def _clock_key(ckpt: Checkpoint, archive: int = 0) -> tuple[Any, ...]:
  """An archive's ``_clock.clock_key``: its optimizer structure and clock scalars."""
  return _clock.clock_key(ckpt.skeleton(archive), ckpt.scalars(archive))


def _clock_mismatch(part: _Part, archive: int, first: _Part) -> str:
  """Words the refusal of ``part``'s archive whose clock differs from ``first``'s ('' if not)."""
  where = _clock.clock_difference(_clock_key(first.ckpt), _clock_key(part.ckpt, archive))
  if where is None:
    return ""
  if where == _clock.STRUCTURE:
    return (
      f"{part.path} holds its optimizer state in another tree than {first.path}"
      f" ({_structure_difference(part, archive, first)}); parts of different steps are"
      " never merged"
    )
  mine = _digest.clock_scalars(part.ckpt.metadata_record(archive))[where]
  theirs = _digest.clock_scalars(first.ckpt.metadata_record(0))[where]
  return (
    f"{part.path} has {mine[0]} = {_values.clock_text(mine[1])} but {first.path} has"
    f" {theirs[0]} = {_values.clock_text(theirs[1])}; parts of different steps are never"
    " merged"
  )


def _structure_difference(part: _Part, archive: int, first: _Part) -> str:
  """What differs between two archives' state trees, in words: a clock scalar one of
  them holds and the other not, else the tree around the same clock scalars."""
  mine = [p for p, _ in _digest.clock_scalars(part.ckpt.metadata_record(archive))]
  theirs = [p for p, _ in _digest.clock_scalars(first.ckpt.metadata_record(0))]
  only_mine = [p for p in mine if p not in set(theirs)]
  only_theirs = [p for p in theirs if p not in set(mine)]
  if only_mine:
    return f"clock scalar {only_mine[0]} is in {part.path} only"
  if only_theirs:
    return f"clock scalar {only_theirs[0]} is in {first.path} only"
  return f"the same clock scalars ({len(mine)}), in other nodes of the state tree"


def _same_directory(a: Any, b: Any) -> bool:
  """Whether two parts' paths name one directory (two spellings of it included)."""
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def merge_plan(
  parts: Sequence[Any], *, step: int | None = None, item: str | None = None
) -> MergePlan:
  """Checks that ``parts`` are every rank of one reshard; their archives in rank order.

  Each part is found as ``locate`` finds a checkpoint (every command's rule):
  a checkpoint directory, or an orbax step or run directory holding a
  jaxreshard item; ``step`` and ``item`` choose in every part, as they do there.

  Parts must name one source checkpoint, hold one world size and one target
  layout (every param's id, shape, dtype, trainability and history buffer
  dtypes), have the same optimizer clock (structure and every scalar's bits),
  and hold disjoint ranks that together are all of them.

  Raises:
    PlacementError: parts that are not every rank of one reshard, named with
      what differs (for two saves: both checkpoint identities).
    ArchiveError: a part that is not a valid checkpoint, or in which ``locate``
      finds none (or not the step or item asked for).
  """
  if not parts:
    raise PlacementError("merge needs at least one part")
  layouts: dict[tuple[str, int], str] = {}
  opened = [_open_part(_locate.locate(p, step=step, item=item).path, layouts) for p in parts]
  first = opened[0]
  owner: dict[int, tuple[_Part, int]] = {}
  for part in opened:
    if part.world != first.world:
      raise PlacementError(
        f"{part.path} has world size {part.world} but"
        f" {first.path} has {first.world}; merge combines parts of"
        " one world size"
      )
    mismatch = _layout_mismatch(part, first)
    if mismatch:
      raise PlacementError(f"{mismatch}; parts of different target layouts are never merged")
    for a in range(len(part.ckpt)):
      mismatch = _clock_mismatch(part, a, first)
      if mismatch:
        raise PlacementError(mismatch)
    if part.source.checkpoint != first.source.checkpoint:
      raise PlacementError(
        f"{part.path} was resharded from checkpoint {part.source.checkpoint} but"
        f" {first.path} from checkpoint {first.source.checkpoint}; parts of two"
        " different saves are never merged"
      )
    for a, r in sorted(part.rank_of.items()):
      if r in owner and _same_directory(owner[r][0].path, part.path):
        first_given = owner[r][0].path
        twice = (
          f"{part.path} is" if first_given == part.path else f"{first_given} and {part.path} are"
        )
        raise PlacementError(f"{twice} one part given twice; parts must hold disjoint ranks")
      if r in owner:
        raise PlacementError(
          f"rank {r} of {first.world} is in both {owner[r][0].path}"
          f" and {part.path}; parts must hold disjoint ranks"
        )
      owner[r] = (part, a)
  missing = sorted(set(range(first.world)) - set(owner))
  if missing:
    raise PlacementError(
      f"ranks {missing[:64]} of {first.world} are in none of the parts; merge needs every rank"
    )
  order = tuple((owner[r][0].ckpt, owner[r][1]) for r in range(first.world))
  return MergePlan(order, first.source)


def merge_parts(
  out: Any,
  parts: Sequence[Any],
  *,
  step: int | None = None,
  item: str | None = None,
  progress: Any = None,
) -> MergePlan:
  """Writes the parts of one reshard (``merge_plan``) as one checkpoint at ``out``.

  Parts (and ``step``, ``item``) are found as ``merge_plan`` finds them;
  ``progress`` is ``save_records``' callback, told after each archive.
  Archives are copied in rank order, one at a time, into a new checkpoint with
  its own identity, naming the parts' source. Nothing is written unless every
  part is checked; a failed write leaves nothing at ``out``.

  Raises:
    ArchiveExistsError: ``out`` exists.
    PlacementError, ArchiveError: see ``merge_plan``.
  """
  if os.path.lexists(os.fspath(out)):
    raise ArchiveExistsError(f"{out} already exists; jaxreshard never overwrites a checkpoint")
  merged = merge_plan(parts, step=step, item=item)

  # One set of assemblies for every part: the parts' archives share one layout, and
  # each is written from its packed buffers after the first.
  loaded = LoadedArchives()

  def records() -> Iterator[Any]:
    for ckpt, a in merged.order:
      yield ckpt.record(a, loaded)

  save_records(out, _reader.SourcedRecords(records(), merged.source), progress=progress)
  return merged

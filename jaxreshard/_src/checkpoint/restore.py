"""Restore target ranks straight from a checkpoint, reading only what they need.

The pipeline is the one ``reshard`` runs; the checkpoint answers validation
from its index (no archive is read to plan), and the fetch step reads, for
each source archive that overlaps the target, only the chunks of its packed
buffers that the planned runs touch, straight into the target's buffers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import pads as _pads
from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint.reader import (
  STAGING_BYTES,
  Checkpoint,
  allocate,
  open_checkpoint,
  state_id,
)
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.placement import Migration
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import reshard as _reshard
from jaxreshard._src.errors import ArchiveError, PlacementError
from jaxreshard._src.progress import ProgressCallback, Reporter, check_callback

__all__ = ["disk_fetch", "restore", "restore_ranks"]

# A restore holds the buffer files it checked open for its reads, up to this many;
# any more are opened again when read (a process's descriptors are bounded).
HELD_FILES = 256


def restore(
  directory: os.PathLike | str,
  *,
  world_size: int,
  rank: int,
  progress: ProgressCallback | None = None,
) -> ShardRecord:
  """One target rank's archive, built from a checkpoint on disk.

  Reads the checkpoint's index (the whole layout: placements, clocks), then
  only the archives that overlap the target rank, and inside those only the
  chunks covering the overlapping ranges, straight into the target's buffers.

  Args:
    directory: a checkpoint written by ``save_records``.
    world_size: the target world size (every parameter).
    rank: the target rank.
    progress: called with a :class:`jaxreshard.Progress` once the rank is
      built; it is also logged at DEBUG, the restore at INFO, to the
      ``"jaxreshard"`` logger.

  Returns:
    The same record as ``reshard(load_records(directory), plan(..., world_size=world_size,
    rank=rank))``.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: every refusal of ``reshard`` (``PlacementError``,
      ``ShapeError``) and every archive fault of ``load_records``.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
    >>> target = restore(path, world_size=3, rank=1)
    >>> target.placements[0].rank, target.state[0].mu["w"].shape
    (1, (4,))
  """
  return restore_reported("restore", directory, [rank], world_size=world_size, progress=progress)[0]


def restore_ranks(
  directory: os.PathLike | str,
  ranks: Sequence[int],
  *,
  world_size: int,
  checkpoint: Checkpoint | None = None,
  progress: ProgressCallback | None = None,
) -> list[ShardRecord]:
  """Several target ranks of one layout; the index is read and checked once.

  Args:
    directory: a checkpoint written by ``save_records``.
    ranks: target ranks to build, in the order returned.
    world_size: the target world size of every parameter.
    checkpoint: ``open_checkpoint(directory)``, when the caller already has it
      (its validated groups and archive metadata are reused).
    progress: called with a :class:`jaxreshard.Progress` after each target
      rank is built; each rank is also logged at DEBUG, the call at INFO, to
      the ``"jaxreshard"`` logger.

  Returns:
    One ``ShardRecord`` per entry of ``ranks``.

  Raises:
    FileNotFoundError, ReshardError: as ``restore``; every target rank is
      validated before any archive is read.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
    >>> seen = []
    >>> targets = jr.restore_ranks(path, [0, 1, 2], world_size=3, progress=seen.append)
    >>> [(p.rank, p.done_bytes, p.total_bytes) for p in seen]   # mu and nu, float32
    [(0, 32, 80), (1, 64, 80), (2, 80, 80)]
  """
  return restore_reported(
    "restore_ranks",
    directory,
    ranks,
    world_size=world_size,
    checkpoint=checkpoint,
    progress=progress,
  )


def _check_same_place(ckpt: Checkpoint, directory: Any, what: str) -> None:
  """``checkpoint=`` must be ``open_checkpoint(directory)``: one opened elsewhere
  would give another checkpoint's bits under ``directory``'s name."""
  here, there = os.fspath(directory), os.fspath(ckpt.directory)
  try:
    same = os.path.samefile(here, there)
  except OSError:
    same = os.path.abspath(here) == os.path.abspath(there)
  if not same:
    raise ArchiveError(
      f"{what}: checkpoint= is the checkpoint opened at {there}, not the one at {here}"
      " (pass open_checkpoint of the directory restored)"
    )


def restore_reported(
  what: str,
  directory: Any,
  ranks: Sequence[int],
  *,
  world_size: int,
  checkpoint: Checkpoint | None = None,
  progress: ProgressCallback | None = None,
) -> list[ShardRecord]:
  """``restore_ranks``, reporting as the public call ``what``."""
  check_callback(progress)
  try:
    ranks = list(ranks)
  except TypeError:
    raise PlacementError(
      f"{what}: ranks must be a list of target ranks (ints), not {type(ranks).__name__}"
    ) from None
  ckpt = checkpoint if checkpoint is not None else open_checkpoint(directory)
  if checkpoint is not None:
    _check_same_place(ckpt, directory, what)
  with _pipeline.no_gc():  # no reference cycles are made; see no_gc
    reg = _regular.regular(ckpt)
    if reg is not None:
      targets = [_regular.check_target(world_size, r) for r in ranks]
      validated = [_regular.rank_groups(reg, w, r, ckpt.memo.families) for r, w in targets]
      sizes = [int(((g.stop - g.start) * reg.itemsize).sum()) for g in validated]
    else:
      plans = [
        _reshard.plan_groups(ckpt.complete_groups(), world_size=world_size, rank=r) for r in ranks
      ]
      validated = [_validated(ckpt, migrations) for migrations in plans]
      sizes = [copied_bytes(groups) for groups in validated]
    reporter = Reporter(
      what,
      progress,
      where=ckpt.directory,
      total=len(validated),
      total_bytes=sum(sizes),
      unit="rank",
    )
    out: list[ShardRecord] = []
    for at in batches(sizes):
      batch = validated[at.start : at.stop]
      built = None
      if len(batch) > 1:
        padding, described = _pads.Trailing(), set()
        for g in batch:
          padding.update(all_padding_sources(g, ckpt.index.name_of))
          described.update(described_sources(ckpt, g, g.rank, g.world))
        fetch = disk_fetch(ckpt, padding=padding, described=sorted(described))
        built = _pipeline.build_batch(ckpt, batch, fetch)
      if built is None:
        built = [_pipeline.build(ckpt, g, disk_fetch(ckpt, g)) for g in batch]
      for rank, nbytes, record in zip(ranks[at.start : at.stop], sizes[at.start : at.stop], built):
        out.append(record)
        reporter.step(nbytes, rank=rank)
  reporter.finish()
  return _record.stamped(out, state_id(ckpt))


# Target ranks are fetched together (``pipeline.build_batch``) up to this many bytes:
# each source buffer is then read once for them all, with at most this much held.
BATCH_BYTES = 64 << 20


def batches(sizes: Sequence[int], limit: int | None = None) -> list[range]:
  """Consecutive ranges of ranks, each of at most ``limit`` (``BATCH_BYTES``) bytes,
  or one rank."""
  limit = BATCH_BYTES if limit is None else limit
  out, start, held = [], 0, 0
  for i, n in enumerate(sizes):
    if i > start and held + n > limit:
      out.append(range(start, i))
      start, held = i, 0
    held += n
  if start < len(sizes):
    out.append(range(start, len(sizes)))
  return out


def _validated(ckpt: Checkpoint, migrations: Sequence[Migration]) -> list[_validate.SourceGroup]:
  groups = _pipeline.validate(ckpt, migrations)
  if not groups:
    raise PlacementError("no migrations: a target rank needs at least one parameter")
  return groups


def checked_archives(ckpt: Checkpoint, world_size: int, rank: int) -> set[int]:
  """The archives a restore of target ``rank`` checks without copying from them, from
  the index alone: those whose all-padding buffers it checks (``all_padding_sources``)
  and those whose ``archive.json`` it checks (``described_sources``)."""
  with _pipeline.no_gc():
    reg = _regular.regular(ckpt)
    if reg is not None:
      r, w = _regular.check_target(world_size, rank)
      groups = _regular.rank_groups(reg, w, r, ckpt.memo.families)
    else:
      migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=world_size, rank=rank)
      groups = _validated(ckpt, migrations)
    padding = {a for a, *_ in all_padding_sources(groups, ckpt.index.name_of).by_file()}
    return padding | set(described_sources(ckpt, groups, groups.rank, groups.world))


def validated_whole(ckpt: Checkpoint) -> Any:
  """The validated groups of every parameter, as one rank of world size 1 holds them.

  Validating that rank runs, from the index alone, every refusal a restore of
  the checkpoint makes (groups, clocks, histories, dtypes), with its messages.
  """
  with _pipeline.no_gc():
    reg = _regular.regular(ckpt)
    if reg is not None and len(reg.entry):
      return _regular.rank_groups(reg, 1, 0)  # validated from the index's arrays
    migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=1, rank=0)
    return _pipeline.validate(ckpt, migrations)


def copied_bytes(groups: Any) -> int:
  """The history bytes a target rank copies from its sources: owned elements, no padding."""
  # Groups share a handful of histories: the bytes per element are summed once for each.
  per_element: dict[tuple, int] = {}
  itemsize = np.empty(len(groups), np.int64)
  for i, f in enumerate(groups.facts):
    key = (f.history, f.buffer_dtypes)
    n = per_element.get(key)
    if n is None:
      n = per_element[key] = sum(np.dtype(d).itemsize for _, d in _copyplan.history_buffers(f))
    itemsize[i] = n
  return int(((groups.stop - groups.start) * itemsize).sum())


def described_sources(ckpt: Checkpoint, groups: Any, part: Any, parts: Any) -> list[int]:
  """The archives whose ``archive.json`` a reader of share ``part`` of ``parts`` checks
  (``check_described``) whether or not it reads a byte of them.

  A record takes its params' placements and its skeleton and clock scalars from the
  index; each archive's signed ``archive.json`` vouches for what the index says of
  that archive. A reader checks the first archive of each group (the templates the
  skeleton and clock come from) and its share of each group's source ranks,
  ``[part * W // parts, (part + 1) * W // parts)`` rounded up, at least one rank: a
  target rank of its world, or a process among all; and every archive no group
  lists (one that lists no param: no reader's share). Together they check every
  archive, those without bytes (a frozen group's, a state of clock scalars alone,
  one listing no param) and those an edited index would have no byte read from
  included. ``part`` and ``parts`` are ints or per-row arrays.
  """
  ungrouped = list(ckpt.index.ungrouped)
  if not len(groups):
    return ungrouped
  w = np.asarray(groups.src_world, np.int64)
  part, parts = np.broadcast_to(part, w.shape), np.broadcast_to(parts, w.shape)
  lo = np.minimum(part * w // parts, w - 1)
  hi = np.minimum(w, np.maximum(lo + 1, -(-((part + 1) * w) // parts)))
  n = hi - lo + 1  # and source rank 0
  row = np.repeat(np.arange(len(w)), n)
  at = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
  k = np.where(at == 0, 0, np.repeat(lo, n) + at - 1)
  shares = groups.archives(row, k)
  if ungrouped:
    shares = np.concatenate([shares, ungrouped])
  return _copyplan.unique_ints(shares).tolist()


def all_padding_sources(groups: Sequence[_validate.SourceGroup], name_of: dict) -> _pads.Trailing:
  """The all-padding source buffers a target rank checks (``copyplan.padding_ranks``:
  those whose slots meet its own, and its share of those past the target world's
  padded buffer). ``name_of``: the index's param numbers.

  Together the target ranks of a layout check every all-padding source rank, each
  rank mostly checking archives it reads anyway. Made with array operations over
  the groups and their ranges of ranks; Python runs once per group, not per rank.
  """
  out = _pads.Trailing()
  if not groups:
    return out
  t_rank = groups.rank
  row, rank = _copyplan.padding_ranks(
    groups.count, groups.src_slots, groups.src_world, t_rank, t_rank + 1, groups.slots, groups.world
  )
  if not len(row):
    return out
  rows, lengths = np.unique(row, return_counts=True)
  archive = groups.archives(row, rank)
  # Groups with the same history buffers are added together, one call per buffer.
  facts = groups.facts  # a row's sources: no per-row group object is made
  kinds: dict[tuple, int] = {}
  kind = np.empty(len(rows), np.int64)
  buffers = []
  names = np.empty(len(rows), np.int64)
  for i, gi in enumerate(rows.tolist()):
    f = facts[gi]
    names[i] = name_of[f.param]
    k = kinds.get((f.history, f.buffer_dtypes))
    if k is None:
      k = kinds[(f.history, f.buffer_dtypes)] = len(buffers)
      buffers.append(_copyplan.history_buffers(f))
    kind[i] = k
  kind, names = np.repeat(kind, lengths), np.repeat(names, lengths)
  for k, present in enumerate(buffers):
    sel = kind == k
    for m, d in present:
      out.add(d, archive[sel], names[sel], m)
  return out


def disk_fetch(
  ckpt: Checkpoint,
  groups: Sequence[_validate.SourceGroup] = (),
  *,
  padding: _pads.Trailing | None = None,
  described: Sequence[int] | None = None,
) -> _pipeline.Fetch:
  """Runs over packed buffers on disk: chunk spans read, checked and copied.

  The padding of every source buffer the runs copy from must be zero bits, and
  so must the all-padding source buffers that ``groups``' target rank checks
  (``all_padding_sources``; ``padding``: those of several target ranks at
  once): data that contradicts the layout is refused. The ``archive.json`` of the
  archives ``described_sources`` names (``described``: those of several target
  ranks) are checked first, whether or not a byte of them is read.
  """
  trailing = all_padding_sources(groups, ckpt.index.name_of) if padding is None else padding
  if described is None:
    described = described_sources(ckpt, groups, groups.rank, groups.world) if groups else []

  def fetch(runs: dict, keys: list, layout: _copyplan.TargetLayout) -> dict:
    for archive in described:
      ckpt.check_described(archive)
    # Each source buffer's runs, per target dtype: (key, the runs' positions in r).
    by_source = {dtype: _by_source(r) for dtype, r in runs.items()}
    wanted: dict = {}
    for dtype, r in runs.items():
      for sid, sel in by_source[dtype]:
        wanted.setdefault(keys[sid], []).append((r.src[sel], r.length[sel]))
    with opened_archives(ckpt, sorted(set(keys)), wanted) as files:
      # One scratch buffer for every read of this target rank, reused (warm pages).
      scratch = np.empty(STAGING_BYTES, np.uint8)
      out = {}
      for dtype, r in runs.items():
        buf = allocate(layout.sizes[dtype], dtype, f"target rank of {ckpt.directory}")
        for sid, sel in by_source[dtype]:
          archive, d = keys[sid]
          ckpt.archives.read_runs(
            archive,
            d,
            r.src[sel],
            r.dst[sel],
            r.length[sel],
            buf,
            scratch,
            f=files.get((archive, d)),
          )
        out[dtype] = buf
      ckpt.check_padding(trailing, scratch, files=files)
      return out

  return fetch


@contextlib.contextmanager
def opened_archives(
  ckpt: Checkpoint, keys: Sequence[tuple[int, np.dtype]], wanted: dict
) -> Iterator[dict]:
  """Opens the packed buffers ``keys`` (``(archive, dtype)``, in reading order), each
  archive's ``archive.json`` and the buffer file checked against the checkpoint,
  before anything is allocated or read: a checkpoint whose files cannot hold what
  it claims reads nothing.

  ``wanted[key]``: the runs' ``(src, length)`` arrays (lists of them, joined) read
  from that buffer, which on a cold page cache the kernel is asked for ahead
  (``Warmer``). Yields the open files, up to ``HELD_FILES`` of them (later ones
  are closed, and opened again when read); all are closed on leaving.
  """
  files: dict = {}
  warmer = ckpt.archives.warmer(keys)
  try:
    for i, key in enumerate(keys):
      archive, d = key
      ckpt.check_archive(archive)
      ckpt.archive_meta(archive)
      f = ckpt.open_buffer(archive, d)
      try:
        mine = wanted.get(key, ())
        if mine:
          warmer.opened(i, f, *(np.concatenate(x) for x in zip(*mine)))
      except BaseException:
        f.close()
        raise
      if len(files) < HELD_FILES:
        files[key] = f
      else:
        f.close()
    yield files
  finally:
    warmer.close()
    for f in files.values():
      f.close()


def _by_source(r: _copyplan.Runs) -> list[tuple[int, np.ndarray]]:
  """``(source, positions of its runs in r)`` for every source that runs ``r`` read."""
  order = np.argsort(r.source, kind="stable")
  sources, at = np.unique(r.source[order], return_index=True)
  return list(zip(sources.tolist(), np.split(order, at[1:])))

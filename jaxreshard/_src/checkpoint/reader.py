"""A checkpoint on disk: its index, its archives and their buffers (format version 4).

Layout::

  CHECKPOINT/
    jaxreshard.json          # the index, written last: the whole layout (signed)
    jaxreshard.table         # large layouts: the index's arrays (``tableindex``)
    archive_00000/           # one source rank's archive
      archive.json           # (signed) checkpoint id; digests of what the index says of
                             # it (layout, clock, params at each rank); per dtype:
                             # elements, chunk, crc32c's
      float32/               # every float32 history buffer of the rank, back to back
        zarr.json            #   (zarr v3, one shard, a crc32c per chunk: see _shardfile)
        c/0
      bfloat16/ ...
    archive_00001/ ...

The index carries everything planning needs, once for the whole checkpoint:

* ``params``: distinct ``[id, shape, dtype, trainable]`` entries;
* ``groups``: parameters split the same way: ``world_size``, the param
  entries and the ``[archive, rank]`` pairs that hold them;
* ``layouts``: distinct state layouts: the optax state's tree (scalars and
  history buffers as numbered leaves) and, per leaf, a clock scalar's number
  or a history buffer's ``[param, dtype, slots]``;
* ``clocks``: distinct optimizer clocks (the scalar leaves, exact bits);
* ``archives``: ``[name, layout, clock]`` of each archive;
* ``checkpoint``: an identity shared by every archive of one save;
* ``source``: null, or for the output of a reshard (whole or some ranks) the
  checkpoint it was resharded from: that checkpoint's identity, the target
  world size and the target's layout (a sha256 of every param's id, shape,
  dtype, trainability and history buffer dtypes), which every part of one
  reshard shares, so that parts of two saves are never merged.

The index and every ``archive.json`` are signed JSON: the first member is
``"checksum":"sha256:..."``, the sha256 of the file's JSON body, checked on
the raw bytes before anything in the file is parsed or used
(``_archive_format.verified_json``). A file without it (format version 2 and
earlier) is refused. An index of large layouts keeps its params, groups,
archives and layouts' optimizer subtrees in a binary table whose size and
sha256 the signed index records (``tableindex``); format version 3 is version
4 without the table, and reads as it always did.

A rank's buffers of one dtype lie in *packing order* (parameters sorted by id,
then the optimizer subtrees in order), so an archive's offsets follow from its
layout alone; planning a target rank reads the index and then only the
archives that overlap it. Files grow with ranks x dtypes, not with buffers.

Everything read here is untrusted: JSON sizes are bounded, checksums are
checked before parsing, every field is type-checked, names are checked before
they become paths, every file is opened below the one descriptor of the root
held for the checkpoint's life, without following links (``_shardread.Dir``),
sizes in the metadata are checked against the bytes on disk before anything
is allocated, and every archive read must carry the index's checkpoint
identity. Data that contradicts the layout is refused on every read: the
padding slots of a rank's buffer (past the elements its flat shard owns) must
hold zero bits, checked on every buffer of an archive read whole
(``Checkpoint.record``) and, for reads of runs, on the tail of every buffer a
read copies from (``Checkpoint.read_runs``) and on the all-padding ranks the
caller names (``Checkpoint.check_padding``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import archives as _archives
from jaxreshard._src.checkpoint import brief as _brief
from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import memo as _memo
from jaxreshard._src.checkpoint import pads as _pads
from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import tableindex as _tableindex
from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.checkpoint.archives import allocate, path_arg  # noqa: F401  (re-exported)
from jaxreshard._src.checkpoint.index import (  # noqa: F401  (re-exported)
  _TWICE,
  ARCHIVE_FILE,
  DEFAULT_CHUNK_BYTES,
  FORMAT,
  FORMAT_VERSION,
  INDEX_FILE,
  MAX_INDEX_BYTES,
  STAGING_BYTES,
  ArchiveLayout,
  LeafInfo,
  Source,
  SourcedRecords,
)
from jaxreshard._src.checkpoint.loaded import LoadedArchives
from jaxreshard._src.checkpoint.shardread import ReadStats  # noqa: F401  (re-exported)
from jaxreshard._src.checkpoint.writer import (  # noqa: F401  (re-exported)
  IndexBuilder,
  dump,
  dump_index,
  target_layout,
  write_archive,
  write_checkpoint,
)
from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.errors import ArchiveError, PlacementError

__all__ = [
  "Checkpoint",
  "FORMAT_VERSION",
  "LeafInfo",
  "ReadStats",
  "Source",
  "SourcedRecords",
  "open_checkpoint",
  "target_layout",
  "write_checkpoint",
]


class Checkpoint:
  """An opened checkpoint: the index checked, archives opened on demand.

  It answers the questions validation asks of sources (``_validate.Sources``),
  so ``restore`` runs the same pipeline as ``reshard``. What it learns is kept
  for as long as this object lives, never longer: what it makes of its index
  (``memo``) and each archive's checked ``archive.json`` (``archives``). Open
  files are not kept, and every read checks the bytes it reads against those.
  """

  def __init__(self, directory: Any):
    self.directory = path_arg(directory)
    # The root is opened once; every file below it is opened relative to this
    # descriptor, which lives as long as the object (or until ``close``).
    root = _shardread.Dir.root(self.directory)
    # An error or an interrupt anywhere below closes the root now: a caller that never
    # gets the object cannot, and a traceback kept alive would hold the descriptor.
    try:
      self._root = root
      self._closer = weakref.finalize(self, root.close)
      self.index = _read_index(root, directory, self.directory)
      i = self.index
      self.id, self.record_version, self.source = i.id, i.record_version, i.source
      self.layouts, self.clocks = i.layouts, i.clocks
      if len(self.layouts) > 1:
        _check_one_tree(self)
      self._lock = threading.Lock()
      self.memo = _memo.Memo()  # what validation learns of the index, for this object's life
      self.loaded = LoadedArchives()  # the assemblies whole archives are loaded with
      # The archives' files and bytes: metadata, buffers, runs, padding.
      self.archives = _archives.ArchiveReader(
        self.directory, root, i, weakref.WeakMethod(self.placement)
      )
    except BaseException:
      root.close()
      raise

  # The index's per-entry objects, made when first asked (``_index.Index``): planning
  # one target rank reads the index's arrays instead.
  params = property(lambda self: self.index.params)
  groups = property(lambda self: self.index.groups)
  names = property(lambda self: self.index.names)
  member = property(lambda self: self.index.member)
  archive_layout = property(lambda self: self.index.archive_layout)
  archive_clock = property(lambda self: self.index.archive_clock)

  def close(self) -> None:
    """Closes the root's descriptor; reading archives afterwards is refused."""
    self._closer()

  def __enter__(self) -> Checkpoint:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __len__(self) -> int:
    return len(self.index.tables.a_layout)

  __repr__ = _brief.checkpoint_repr  # one line: directory, archives, world sizes, params, step

  def placement(self, archive: int, pid: str) -> ParamPlacement | None:
    member = self.member[archive]
    if len(member) == 1:
      gi, rank = member[0]
      p = self.index.param_index[gi].get(pid)
    else:
      hit = self.memo.archive_params(self.index, archive).get(pid)
      if hit is _TWICE:
        raise _validate.listed_twice(pid, archive)
      gi, rank, p = hit if hit is not None else (None, None, None)
    if p is None:
      return None
    e = self.params[p]
    return ParamPlacement(pid, e.shape, rank, self.groups[gi].world_size, e.dtype, e.trainable)

  def placements(self, archive: int) -> list[ParamPlacement]:
    """Every placement an archive lists, sorted by param."""
    return placements(self.index, archive)

  def layout(self, archive: int) -> ArchiveLayout:
    return self.layouts[self.archive_layout[archive]]

  def history(self, archive: int, pid: str) -> tuple[Any, ...]:
    return self.layout(archive).history(pid)

  def clock_class(self, archive: int) -> int:
    """The rule records in memory follow (``_clock.ClockClasses``): one state structure
    and bit-identical clock scalars; archives of one layout and clock share it."""
    return self.memo.clock_classes.of(
      self, archive, (self.archive_layout[archive], self.archive_clock[archive])
    )

  def skeleton(self, archive: int) -> tuple[Any, ...]:
    return self.layout(archive).skeleton_key

  def scalars(self, archive: int) -> list[Any]:
    return self.clocks[self.archive_clock[archive]]

  def template(self, archive: int) -> _structure.StateParts:
    # A target takes its skeleton and clock scalars from the index's layout and clock
    # entries of ``archive``: its ``archive.json`` must say it was written with them,
    # even where no byte of it is read.
    self.check_described(archive)
    c = self.archive_clock[archive]
    with self._lock:
      return self.layout(archive).template(c, self.clocks[c])

  def check_described(self, archive: int) -> None:
    """The index's account of an archive (its layout, clock and placements) is the one
    its ``archive.json`` was written with, and holds on its own (``check_archive``):
    what any read of the archive checks, for an archive of which nothing is read."""
    self.check_archive(archive)
    self.archive_meta(archive)

  def check_archive(self, archive: int) -> None:
    """Refusals of one archive on its own: version, listing, histories of unlisted params.

    An archive of a uniform group (one layout whose buffers have the group's
    slots, checked once for the group) needs no check of its own.
    """
    if self.member[archive] and all(
      self.memo.is_uniform(self, gi) for gi, _ in self.member[archive]
    ):
      return
    check_histories(archive, self.placements(archive), self.layout(archive).state_parts)

  def complete_groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(param, shape, archive of each rank) of every param, from the groups alone."""
    return self.memo.complete_groups(self.index)

  def facts(self, pid: str, sources: tuple) -> _validate.SourceFacts:
    return self.memo.facts(self, pid, sources)

  def regular(self) -> Any:
    """The checkpoint's ``_regular.Regular``, or None when it is not regular."""
    return self.memo.regular(self)

  def locate_runs(
    self, groups: Any, archive: np.ndarray, group: np.ndarray, subtree: np.ndarray, dtype: np.dtype
  ) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    return locate_runs(self.index, groups, archive, group, subtree, dtype)

  # --- archives and their buffers (``_archives.ArchiveReader``) ----------------

  def archive_meta(self, archive: int) -> dict:
    """An archive's ``archive.json``, checked against the index (read once)."""
    return self.archives.archive_meta(archive)

  def check_padding(
    self,
    trailing: _pads.Trailing,
    scratch: np.ndarray,
    stats: ReadStats | None = None,
    files: dict | None = None,
  ) -> None:
    """Reads the padding of the buffers in ``trailing`` and checks it is zero bits.

    ``trailing`` holds buffers of all-padding ranks, which no run copies from
    (``_restore.all_padding_sources``, or a process's share of them in
    ``restore_sharded``), checked file by file in
    order of (archive, dtype name). ``files``: ``(archive, dtype) -> ShardFile``
    the caller holds open.
    """
    self.archives.check_padding(trailing.by_file(), scratch, stats, files, self.check_archive)

  def open_buffer(self, archive: int, dtype: np.dtype) -> _shardread.ShardFile:
    return self.archives.open_buffer(archive, dtype)

  def check_files(self, archive: int) -> None:
    """Every buffer file of an archive against its metadata, before anything is allocated."""
    self.archives.check_files(archive)

  def metadata_record(self, archive: int) -> ShardRecord:
    """An archive's record with ``LeafInfo`` (shape and dtype, no data) as buffers."""
    return self.plain_record(archive, self.layout(archive).infos())

  def record(self, archive: int, loaded: LoadedArchives | None = None) -> ShardRecord:
    """One whole archive, read from disk: a deferred record over its packed buffers
    when it holds one rank of a uniform group, else leaf by leaf. ``loaded``: the
    assemblies to make and share them with (this checkpoint's own by default)."""
    made = (self.loaded if loaded is None else loaded).record(self, archive)
    return _record.stamped([made or self.plain_record(archive)], state_id(self))[0]

  def plain_record(self, archive: int, buffers: dict | None = None) -> ShardRecord:
    """One whole archive, read from disk leaf by leaf (or with ``buffers`` in place of
    its bytes)."""
    layout = self.layout(archive)
    if buffers is None:
      buffers = self.archives.read_all(archive)
    return ShardRecord(
      version=self.record_version,
      placements=tuple(self.placements(archive)),
      state=layout.state(self.scalars(archive), buffers),
      roles=layout.roles,
    )


def locate_runs(
  index: Any, groups: Any, archive: np.ndarray, group: np.ndarray, subtree: np.ndarray, dtype: Any
) -> tuple[np.ndarray, np.ndarray, list[Any]]:
  """``Sources.locate_runs`` of a checkpoint: a history buffer lives in its archive's
  packed buffer of its dtype, where the archive's layout packs it
  (``ArchiveLayout.offset_table``)."""
  pids = groups.params
  if not len(archive):
    return np.zeros(0, np.int64), np.zeros(0, np.int64), []
  name_of = index.name_of
  rows, at = np.unique(group, return_inverse=True)
  names = np.fromiter((name_of[pids[g]] for g in rows.tolist()), np.int64, len(rows))[at]
  layout = index.tables.a_layout[archive]
  base = np.empty(len(archive), np.int64)
  for L in _copyplan.unique_ints(layout).tolist():
    sel = layout == L
    table = index.layouts[L].offset_table
    base[sel] = table[index.layouts[L].columns.rows_of(names[sel]), subtree[sel]]
  archives, source = np.unique(archive, return_inverse=True)
  return source.reshape(-1), base, [(a, np.dtype(dtype)) for a in archives.tolist()]


def state_id(ckpt: Checkpoint) -> str:
  """The identity of the checkpoint whose state ``ckpt`` holds: the one it was
  resharded from, when its index names one, else its own."""
  return ckpt.id if ckpt.source is None else ckpt.source.checkpoint


def _read_index(root: _shardread.Dir, given: Any, directory: str) -> _index.Index:
  """The checkpoint's index file, its checksum verified, parsed."""
  if not root.exists(INDEX_FILE):
    raise ArchiveError(
      f"{os.fspath(given)} is not a jaxreshard checkpoint (no {INDEX_FILE}; a save"
      " that did not finish leaves none)"
    )
  where = f"{directory}/{INDEX_FILE}"
  raw = root.read_bytes(INDEX_FILE, MAX_INDEX_BYTES)
  from jaxreshard._src.engine.pipeline import no_gc  # pylint: disable=g-import-not-at-top

  with no_gc():  # parsing makes many small objects and no cycles
    return _tableindex.parse_signed(raw, where, lambda entry: _table.read(root, entry, where))


def placements(index: _index.Index, archive: int) -> list[ParamPlacement]:
  """Every placement an archive lists, sorted by param."""
  out = []
  for gi, rank in index.member[archive]:
    g = index.groups[gi]
    for p in g.params:
      e = index.params[p]
      out.append(ParamPlacement(e.param, e.shape, rank, g.world_size, e.dtype, e.trainable))
  out.sort(key=lambda p: p.param)
  for a, b in zip(out, out[1:]):
    if a.param == b.param:
      raise _validate.listed_twice(a.param, archive)
  return out


def check_histories(
  archive: int, listed: list[ParamPlacement], state_parts: _structure.StateParts
) -> None:
  """An archive's histories belong to the params it lists, each of its flat layout."""
  _validate.check_listed(archive, state_parts, {p.param for p in listed})
  for p in listed:
    try:
      slots = FlatShard(p.shape, p.rank, p.world_size).slots
    except PlacementError as e:
      raise PlacementError(f"param {p.param!r}: archive {archive}: {e}") from None
    for m, h in enumerate(state_parts.history(p.param)):
      if isinstance(h, LeafInfo):
        _validate.check_flat_history(p, archive, m, h.shape, slots)


def open_checkpoint(directory: os.PathLike | str) -> Checkpoint:
  """Reads and checks a checkpoint's index; reads no archive.

  The checkpoint directory is opened once: every later read of this object
  opens its files below that descriptor, which is closed by ``close()`` (or
  ``with``) or when the object is garbage collected.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ArchiveError: it is not a jaxreshard checkpoint of this format version, its
      index fails its checksum, or its index is malformed; or it lies in a save's
      temporary directory (``.NAME.tmp-*``, ``*.orbax-checkpoint-tmp*``): a save
      still running, or the leftover of one that was killed, is never read.
  """
  _tempname.check_not_in_temporary(path_arg(directory))
  return Checkpoint(directory)


def open_unfinished(directory: os.PathLike | str) -> Checkpoint:
  """``open_checkpoint`` of a save's own temporary directory, by the save that
  writes it, to check that what it is about to commit loads."""
  return Checkpoint(directory)


def _check_one_tree(ckpt: Checkpoint) -> None:
  """``archivecheck.check_one_tree`` of one archive per layout, as an ``ArchiveError``."""
  firsts: dict[int, int] = {}
  for archive, layout in enumerate(ckpt.index.archive_layout):
    firsts.setdefault(layout, archive)
  try:
    _archivecheck.check_one_tree((a, ckpt.layouts[L].state_parts) for L, a in firsts.items())
  except PlacementError as e:
    ckpt.close()
    raise ArchiveError(f"{ckpt.directory}: {e}") from None

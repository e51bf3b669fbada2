"""Saving and loading whole checkpoints: every rank's archive, atomically.

The on-disk format (index, archives, one buffer per rank and dtype) is
``_reader``'s; this module adds the atomic commit (``tempdir``): a checkpoint is
written into a hidden sibling directory and renamed into place only when complete.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint.reader import (
  DEFAULT_CHUNK_BYTES,
  Checkpoint,
  SourcedRecords,
  open_checkpoint,
  open_unfinished,
  path_arg,
  write_checkpoint,
)
from jaxreshard._src.checkpoint.tempdir import (  # noqa: F401  (re-exported)
  LOCK_FILE,
  TempDir,
  commit_dir,
  new_temp_dir,
  remove_temp_dirs,
  temp_dirs,
)
from jaxreshard._src.checkpoint.tempname import check_not_temporary, lineage
from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.assembly import current_parts
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.errors import ArchiveExistsError, ReshardError
from jaxreshard._src.progress import ProgressCallback, Reporter

__all__ = [
  "DEFAULT_CHUNK_BYTES",
  "check_save_path",
  "LOCK_FILE",
  "TempDir",
  "commit_dir",
  "history_bytes",
  "load_records",
  "new_temp_dir",
  "open_checkpoint",
  "remove_temp_dirs",
  "save_records",
  "temp_dirs",
  "write_checkpoint",
]


def check_save_path(final: str) -> None:
  """Refuses a save to ``final`` where what it saves would not be read as saved: as or
  in a save's temporary directory (``check_not_temporary``), or inside a directory
  that opens as a checkpoint, along its ``lineage`` (its files would be counted,
  copied and removed as that checkpoint's).

  Raises:
    ReshardError: naming the path, and the checkpoint it lies in.
  """
  check_not_temporary(final)
  for here in lineage(final):
    if here in (os.path.abspath(final), os.path.realpath(final)):
      continue  # the save's own path: a checkpoint there is refused as existing
    if os.path.isfile(os.path.join(here, _index.INDEX_FILE)) and _is_checkpoint(here):
      raise ReshardError(
        f"{final}: it lies inside the checkpoint {here}, whose files it would join"
        " (counted, copied and removed as that checkpoint's); a checkpoint is never"
        " saved inside another: choose another path"
      )


def _is_checkpoint(directory: str) -> bool:
  """Whether ``directory`` opens as a checkpoint (a stray file of the index's name
  does not make one)."""
  try:
    open_checkpoint(directory).close()
  except (ReshardError, OSError):
    return False
  return True


def _is_under(path: str, *roots: str) -> bool:
  return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def save_records(
  directory: os.PathLike | str,
  records: Iterable[ShardRecord],
  *,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  progress: ProgressCallback | None = None,
  durable: bool = True,
) -> None:
  """Saves every rank's archive as one checkpoint directory, atomically and durably.

  Each archive is one buffer per dtype (all of the rank's history buffers back
  to back, a crc32c per chunk) plus a small metadata file; one index describes
  the whole layout. Files grow with ranks x dtypes, not with parameters.

  Args:
    directory: the checkpoint directory to create; it must not exist.
    records: the archives, in any iterable (a generator is written one record
      at a time, so a whole reshard never needs every rank in memory). Archive
      ``i`` is the ``i``-th record yielded.
    chunk_bytes: bytes per stored chunk, the granularity of partial reads.
    progress: called with a :class:`jaxreshard.Progress` after each archive is
      written (``total`` and ``total_bytes`` are None when ``records`` is not
      a sequence); each archive is also logged at DEBUG, the save at INFO, to
      the ``"jaxreshard"`` logger.
    durable: fsync every file and directory before the rename and the parent
      directory after it, so that a checkpoint that is visible survives a
      crash of the machine. ``False`` skips every fsync (scratch use only: a
      crash can then leave a committed checkpoint with missing bytes).

  Raises:
    ArchiveExistsError: ``directory`` already exists, or appeared while it
      was written (the rename never replaces anything).
    ArchiveError: the temporary directory was removed or changed by someone
      else while it was written; nothing is committed.
    FileNotFoundError: its parent directory does not exist.
    NotADirectoryError: its parent is not a directory.
    OSError: the disk is full, a quota or a permission (``filename`` is
      ``directory``); nothing is left behind. Except when the fsync of the
      parent directory after the rename fails: the checkpoint is then in place
      and complete but its rename may not survive a crash, as the error says.
    ReshardError: a record that cannot be stored (no records, an invalid
      archive, a state node type the format cannot re-create), or a ``directory``
      named as a save's temporary directory (which ``clean`` would remove).

  Everything is written into a temporary sibling directory, held by its
  descriptor and locked (``flock``) by this save, that is renamed to
  ``directory`` at the very end, once it is checked to be still this save's
  and complete: a failed save leaves nothing, and a killed one leaves a
  ``.NAME.tmp-*`` sibling whose lock is then free (never read as a checkpoint,
  even named explicitly: a leftover of a save killed after its last write looks
  whole, but was never reported done), which the next save to ``directory`` on the
  same host removes, as does ``jaxreshard clean``. Neither ever removes a
  directory whose writer holds its lock.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, records)
    >>> [r.state[0].mu["w"].shape for r in load_records(path)]
    [(3,), (3,)]
  """
  _index.check_chunk_bytes(chunk_bytes)
  final = path_arg(directory)
  check_save_path(final)
  _archivecheck.check_records_iterable(records, "save_records")
  sourced = isinstance(records, SourcedRecords)
  named = records.records if sourced else records
  if not isinstance(named, Sequence):
    # A generator's records are gone once written: the one being written is kept,
    # so that a deleted array in it is named as a list's would be.
    named = _deleted.Consumed(named)
    records = SourcedRecords(named, records.source) if sourced else named
  with _deleted.naming(records=named):
    _save(final, records, chunk_bytes, progress, durable)


def _save(
  final: str,
  records: Iterable[ShardRecord],
  chunk_bytes: int,
  progress: ProgressCallback | None,
  durable: bool,
) -> None:
  """``save_records`` of checked arguments (``final``: the checkpoint's absolute path)."""
  if isinstance(records, Sequence):
    reporter = Reporter(
      "save_records", progress, where=final, total=len(records), total_bytes=_total_bytes(records)
    )
  else:
    reporter = Reporter("save_records", progress, where=final, total=None, total_bytes=None)
  if not isinstance(durable, bool):
    raise ReshardError(f"durable {durable!r} must be True or False")
  tmp = None
  try:
    tmp = new_temp_dir(final, durable=durable)
    builder = write_checkpoint(
      tmp.out,
      records,
      chunk_bytes=chunk_bytes,
      progress=lambda i, nbytes: reporter.step(nbytes, archive=i),
      where=final,  # a refusal names the checkpoint, not its hidden temporary sibling
    )
    tmp.check(builder, chunk_bytes)
    if builder.source is None:
      check_restorable(tmp.path, final)
    tmp.commit(final)
  except OSError as e:
    if tmp is None:  # refused before anything was made
      if isinstance(e, ArchiveExistsError) or not e.errno:
        raise
      # Named by the checkpoint: the temporary sibling's name means nothing to a user.
      raise type(e)(
        e.errno, f"{e.strerror} (making the temporary directory of a save)", final
      ) from None
    where = tmp.path
    tmp.discard()
    if isinstance(e, ArchiveExistsError) or not e.errno or tmp.committed:
      raise
    if e.filename is not None and not _is_under(os.fspath(e.filename), where, final):
      raise  # the records' own source failed (a read error names the file it read)
    # A full disk, a quota or a permission: named by the checkpoint, since the
    # temporary file it happened in is gone.
    raise type(e)(e.errno, f"{e.strerror} (saving a checkpoint)", final) from None
  except BaseException:
    if tmp is not None:
      tmp.discard()
    raise
  finally:
    if tmp is not None:
      tmp.close()
  reporter.finish()


def check_restorable(path: str, final: str) -> None:
  """Refuses a checkpoint written at ``path`` that a restore would refuse: archives
  that are not one complete set of ranks, or whose optimizer clocks, structures,
  dtypes or trainability disagree. Validated from its index by the readers' own
  rules, with their messages; nothing is committed then. (A reshard's output names
  its source and may be a part of the target's ranks: its parts merge first.)"""
  try:
    with open_unfinished(path) as ckpt:
      _restore.validated_whole(ckpt)
  except ReshardError as e:
    raise type(e)(f"{final}: this save would not restore, so nothing is committed: {e}") from None


def history_bytes(record: ShardRecord) -> int:
  """The bytes of a record's history buffers, as a save stores them."""
  parts = current_parts(record)
  if parts is not None:  # its packed buffers' sizes; no leaf is made
    return parts.assembly.nbytes
  roles = _structure.roles_of(record)
  leaves = jax.tree_util.tree_leaves(record.state)
  return sum(
    int(np.size(x)) * np.dtype(x.dtype).itemsize
    for x, role in zip(leaves, roles)
    if role is not None
  )


def _total_bytes(records: Sequence[ShardRecord]) -> int | None:
  """What a progress report counts to: None when a record cannot be measured, which
  the write then refuses with a message naming its archive."""
  try:
    return sum(history_bytes(r) for r in records)
  except (ReshardError, _structure.StatePartsError, AttributeError, TypeError):
    return None


def _archive_bytes(ckpt: Checkpoint, archive: int) -> int:
  """The bytes of an archive's history buffers, from the index."""
  return sum(n * np.dtype(d).itemsize for d, n in ckpt.layout(archive).sizes.items())


def load_records(
  directory: os.PathLike | str, *, progress: ProgressCallback | None = None
) -> list[ShardRecord]:
  """Loads every archive of a checkpoint, exactly as it was saved.

  Needs neither the optimizer nor the model: the state's tree structure,
  placements, roles and clock scalars come from the checkpoint's index. Each
  archive's history buffers are numpy views of its buffers, read straight from
  the files and checked chunk by chunk. An archive holding one rank of a
  uniform group is a record whose placements and state are made when first
  read (as ``reshard``'s): a save writes its packed buffers as they are.

  Args:
    directory: a checkpoint written by ``save_records``.
    progress: called with a :class:`jaxreshard.Progress` after each archive is
      read; each archive is also logged at DEBUG, the load at INFO, to the
      ``"jaxreshard"`` logger.

  Returns:
    The records, archive 0 first.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: not a jaxreshard checkpoint, a missing archive, an archive of
      another version, a truncated, corrupted or inconsistent file.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(3.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=3))
    >>> [r.placements[0].rank for r in load_records(path)]
    [0, 1, 2]
  """
  ckpt = open_checkpoint(directory)
  for i in range(len(ckpt)):
    ckpt.check_archive(i)
  for i in range(len(ckpt)):  # every archive's metadata and file sizes before any allocation
    ckpt.check_files(i)
  sizes = [_archive_bytes(ckpt, i) for i in range(len(ckpt))]
  reporter = Reporter(
    "load_records", progress, where=ckpt.directory, total=len(ckpt), total_bytes=sum(sizes)
  )
  records = []
  for i in range(len(ckpt)):
    records.append(ckpt.record(i))
    reporter.step(sizes[i], archive=i)
  reporter.finish()
  return records

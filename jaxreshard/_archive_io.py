"""Saving and loading whole checkpoints: every rank's archive, atomically.

The on-disk format (index, archives, one buffer per rank and dtype) is
``_checkpoint``'s; this module adds the atomic commit: a checkpoint is written
into a hidden sibling directory and renamed into place only when complete.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import uuid
from typing import Iterable, Optional, Sequence

import jax
import numpy as np

from jaxreshard import _structure
from jaxreshard._checkpoint import (DEFAULT_CHUNK_BYTES, Checkpoint, open_checkpoint, path_arg,
                                    write_checkpoint)
from jaxreshard._errors import ArchiveExistsError, ReshardError
from jaxreshard._record import ShardRecord
from jaxreshard._report import ProgressCallback, Reporter

__all__ = ["DEFAULT_CHUNK_BYTES", "commit_dir", "history_bytes", "load_records", "new_temp_dir",
           "open_checkpoint", "remove_temp_dirs", "save_records", "temp_dirs",
           "write_checkpoint"]


_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-[0-9a-f]{32}-(?P<pid>[0-9]+)-(?P<host>[A-Za-z0-9._-]*)\Z")


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]


def temp_dirs(final: str) -> list[tuple[str, bool]]:
  """The temporary siblings saves to ``final`` left, each with whether its writer is gone.

  A writer is known to be gone when it ran on this host and its process no
  longer exists; a temporary directory of another host is never called stale.
  """
  parent, name = os.path.split(final)
  out = []
  try:
    entries = os.listdir(parent)
  except OSError:
    return out
  for entry in sorted(entries):
    m = _TEMP.match(entry)
    if not m or m["name"] != name:
      continue
    gone = m["host"] == _host() and not _alive(int(m["pid"]))
    out.append((os.path.join(parent, entry), gone))
  return out


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # exists, owned by someone else
    return True
  return True


def remove_temp_dirs(final: str, *, everything: bool = False) -> list[str]:
  """Removes the temporary siblings of ``final`` whose writer is gone (all with
  ``everything``); returns the paths removed."""
  removed = []
  for path, gone in temp_dirs(final):
    if gone or everything:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def new_temp_dir(final: str) -> str:
  """Creates the hidden sibling a checkpoint is written into before its rename.

  Its name carries this process's id and host, so that the next save to
  ``final`` removes what a killed save on this host left behind.

  Raises:
    ArchiveExistsError: ``final`` exists (a checkpoint is never overwritten).
    FileNotFoundError: its parent directory does not exist.
    NotADirectoryError: its parent is not a directory.
  """
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} already exists; jaxreshard never overwrites a checkpoint")
  parent = os.path.dirname(final)
  if not os.path.exists(parent):
    raise FileNotFoundError(f"parent directory {parent} of {final} does not exist")
  if not os.path.isdir(parent):
    raise NotADirectoryError(f"{parent} is not a directory, so {final} cannot be made in it")
  remove_temp_dirs(final)
  tmp = os.path.join(
      parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex}-{os.getpid()}-{_host()}")
  os.mkdir(tmp)
  return tmp


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def commit_dir(tmp: str, final: str) -> None:
  """Renames ``tmp`` to ``final``, never replacing anything at ``final``.

  Where the kernel offers it (Linux ``renameat2`` with ``RENAME_NOREPLACE``)
  the check and the rename are one atomic step; elsewhere the check comes
  just before the rename.

  Raises:
    ArchiveExistsError: something appeared at ``final`` while it was written.
  """
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    renameat2 = None
  if renameat2 is not None:
    if renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final),
                 _RENAME_NOREPLACE) == 0:
      return
    err = ctypes.get_errno()
    if err == errno.EEXIST or err == errno.ENOTEMPTY:
      raise ArchiveExistsError(f"{final} appeared while it was being written")
    if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # unsupported: fall back
      raise OSError(err, os.strerror(err), final)
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} appeared while it was being written")
  os.rename(tmp, final)


def save_records(directory: os.PathLike | str, records: Iterable[ShardRecord], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: Optional[ProgressCallback] = None) -> None:
  """Saves every rank's archive as one checkpoint directory, atomically.

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

  Raises:
    ArchiveExistsError: ``directory`` already exists, or appeared while it
      was written (the rename never replaces anything).
    FileNotFoundError: its parent directory does not exist.
    NotADirectoryError: its parent is not a directory.
    OSError: the disk is full, a quota or a permission (``filename`` is
      ``directory``); nothing is left behind.
    ReshardError: a record that cannot be stored (no records, an invalid
      archive, a state node type the format cannot re-create).

  Everything is written into a temporary sibling directory that is renamed to
  ``directory`` at the very end: a failed save leaves nothing, and a killed
  one leaves a ``.NAME.tmp-*`` sibling (never loadable) that the next save to
  ``directory`` on the same host removes, as does ``jaxreshard clean``.

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
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
    raise ReshardError(f"chunk_bytes {chunk_bytes!r} must be a positive integer")
  final = path_arg(directory)
  if isinstance(records, Sequence):
    reporter = Reporter("save_records", progress, where=final, total=len(records),
                        total_bytes=sum(history_bytes(r) for r in records))
  else:
    reporter = Reporter("save_records", progress, where=final, total=None, total_bytes=None)
  tmp = new_temp_dir(final)
  try:
    write_checkpoint(tmp, records, chunk_bytes=chunk_bytes,
                     progress=lambda i, nbytes: reporter.step(nbytes, archive=i))
    commit_dir(tmp, final)
  except OSError as e:
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, ArchiveExistsError) or not e.errno:
      raise
    # A full disk, a quota or a permission: named by the checkpoint, since the
    # temporary file it happened in is gone.
    raise type(e)(e.errno, f"{e.strerror} (saving a checkpoint)", final) from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  reporter.finish()


def history_bytes(record: ShardRecord) -> int:
  """The bytes of a record's history buffers, as a save stores them (0 for a record
  a save refuses: the write names what is wrong with it)."""
  try:
    roles = _structure.roles_of(record)
    leaves = jax.tree_util.tree_leaves(record.state)
    return sum(int(np.size(x)) * np.dtype(x.dtype).itemsize
               for x, role in zip(leaves, roles) if role is not None)
  except Exception:  # pylint: disable=broad-exception-caught
    return 0


def _archive_bytes(ckpt: Checkpoint, archive: int) -> int:
  """The bytes of an archive's history buffers, from the index."""
  return sum(n * np.dtype(d).itemsize for d, n in ckpt.layout(archive).sizes.items())


def load_records(directory: os.PathLike | str, *,
                 progress: Optional[ProgressCallback] = None) -> list[ShardRecord]:
  """Loads every archive of a checkpoint, exactly as it was saved.

  Needs neither the optimizer nor the model: the state's tree structure,
  placements, roles and clock scalars come from the checkpoint's index. Each
  archive's history buffers are numpy views of its buffers, read straight from
  the files and checked chunk by chunk.

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
  reporter = Reporter("load_records", progress, where=ckpt.directory, total=len(ckpt),
                      total_bytes=sum(sizes))
  records = []
  for i in range(len(ckpt)):
    records.append(ckpt.record(i))
    reporter.step(sizes[i], archive=i)
  reporter.finish()
  return records

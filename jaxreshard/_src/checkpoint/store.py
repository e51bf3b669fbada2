"""Saving and loading whole checkpoints: every rank's archive, atomically.

The on-disk format (index, archives, one buffer per rank and dtype) is
``_checkpoint``'s; this module adds the atomic commit: a checkpoint is written
into a hidden sibling directory and renamed into place only when complete.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import socket
import stat
import uuid
from typing import Iterable, Optional, Sequence

import jax
import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.checkpoint.reader import (ARCHIVE_FILE, DEFAULT_CHUNK_BYTES, INDEX_FILE, Checkpoint,
                                    IndexBuilder, open_checkpoint, path_arg, write_checkpoint)
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, ReshardError
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.progress import ProgressCallback, Reporter

__all__ = ["DEFAULT_CHUNK_BYTES", "LOCK_FILE", "TempDir", "commit_dir", "history_bytes",
           "load_records", "new_temp_dir", "open_checkpoint", "remove_temp_dirs", "save_records",
           "temp_dirs", "write_checkpoint"]


_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-[0-9a-f]{32}-(?P<pid>[0-9]+)-(?P<host>[A-Za-z0-9._-]*)\Z")

LOCK_FILE = ".jaxreshard-save.lock"
"""The file in a temporary directory that its writer holds ``flock(LOCK_EX)`` on
for the whole save: a directory whose lock nobody holds has no writer."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_probe(path: str) -> tuple[Optional[int], Optional[int]]:
  """``(dir_fd, lock_fd)`` of ``path`` with its writer's lock taken, or Nones when
  a writer holds it (or it cannot be locked, or is not a directory)."""
  try:
    dfd = os.open(path, _DIR_FLAGS)
  except OSError:
    return None, None
  lfd = -1
  try:
    try:
      lfd = os.open(LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
      # A directory without a lock: a writer that has not yet made it, or one
      # killed before. Made here and held, a writer that comes to take it
      # finds it taken and starts over in a new directory.
      lfd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                    dir_fd=dfd)
    fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:  # held by its writer (EWOULDBLOCK), or not ours to lock
    if lfd >= 0:
      os.close(lfd)
    os.close(dfd)
    return None, None
  return dfd, lfd


def temp_dirs(final: str) -> list[tuple[str, bool]]:
  """The temporary siblings saves to ``final`` left, each with whether its writer is gone.

  A writer holds an exclusive ``flock`` on the directory's lock file for its
  whole save; the writer is gone when that lock is free (taken and released
  at once here). Neither the process id nor the host in the directory's name
  decides it: process ids repeat across pid namespaces that share a host name.
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
    path = os.path.join(parent, entry)
    dfd, lfd = _lock_probe(path)
    if dfd is not None:
      os.close(lfd)
      os.close(dfd)
    out.append((path, dfd is not None))
  return out


def _this_host(path: str) -> bool:
  m = _TEMP.match(os.path.basename(path))
  return bool(m) and m["host"] == _host()


def _remove_below(dfd: int, path: str, keep: str = "") -> list[str]:
  """Removes everything in the held directory ``dfd`` but ``keep``; returns the
  paths that could not be removed (each with why)."""
  left = []
  with os.scandir(dfd) as it:
    names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
  for name, is_dir in names:
    if name == keep:
      continue
    where = os.path.join(path, name)
    try:
      if is_dir:
        sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
        try:
          left += _remove_below(sub, where)
        finally:
          os.close(sub)
        os.rmdir(name, dir_fd=dfd)
      else:
        os.unlink(name, dir_fd=dfd)
    except OSError as e:
      left.append(f"{where} ({e.strerror})")
  return left


def _remove_held(path: str, dfd: int) -> None:
  """Removes the directory ``path`` held as ``dfd`` (its lock held by the caller), the
  lock file last.

  Raises:
    ArchiveError: something in it could not be removed; names what is left.
  """
  left = _remove_below(dfd, path, keep=LOCK_FILE)
  if not left:
    try:
      os.unlink(LOCK_FILE, dir_fd=dfd)
      if not _same_file(os.stat(path, follow_symlinks=False), os.fstat(dfd)):
        raise ArchiveError(f"{path} was replaced while it was removed; it is left as it is")
      os.rmdir(path)
    except FileNotFoundError:
      pass  # another clean removed it first
    except OSError as e:
      left.append(f"{path} ({e.strerror})")
  if left:
    raise ArchiveError(f"{path} was removed only partly; left: {', '.join(left[:8])}"
                       + (f" and {len(left) - 8} more" if len(left) > 8 else ""))


def remove_temp_dirs(final: str, *, everything: bool = False) -> list[str]:
  """Removes the temporary siblings of ``final`` whose writer is gone; returns their paths.

  A directory whose lock a writer holds is never removed. Without
  ``everything`` only directories made on this host are considered, because
  a network file system may keep ``flock`` locks to the host that took them;
  ``everything`` adds other hosts' (still only those whose lock is free here).

  Raises:
    ArchiveError: a directory could not be removed entirely; the message names
      what is left (directories removed before it are gone).
  """
  removed = []
  for path, gone in temp_dirs(final):
    if not gone or not (everything or _this_host(path)):
      continue
    dfd, lfd = _lock_probe(path)  # taken again, and held while removing
    if dfd is None:
      continue  # a writer took it meanwhile
    try:
      try:
        _remove_held(path, dfd)
      except ArchiveError as e:
        if removed:
          raise ArchiveError(f"{e} (removed before it: {', '.join(removed)})") from None
        raise
    finally:
      os.close(lfd)
      os.close(dfd)
    removed.append(path)
  return removed


class TempDir:
  """The hidden sibling a checkpoint is written into before its rename.

  Its writer holds it by descriptor (every file is created below that
  descriptor) and holds an exclusive ``flock`` on its lock file from creation
  to commit, which is what tells ``clean`` that it is alive. Its name carries
  the process id and host only to be readable.

  Attributes:
    path: the directory's path.
    out: the held directory, for the writer.
  """

  def __init__(self, path: str, out: _shardfile.OutDir, lock_fd: int):
    self.path, self.out, self._lock = path, out, lock_fd
    self.committed = False

  @classmethod
  def create(cls, final: str, durable: bool = True) -> "TempDir":
    parent, base = os.path.split(final)
    for _ in range(8):
      path = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex}-{os.getpid()}-{_host()}")
      os.mkdir(path)
      made = cls._take(path, durable)
      if made is not None:
        return made
      # A clean took the new directory's lock first (it found no writer's lock
      # yet): it removes it; this save starts over in a new one.
    raise ArchiveError(f"{final}: every temporary directory made for the save was taken by a"
                       " concurrent clean; nothing was written")

  @classmethod
  def _take(cls, path: str, durable: bool) -> Optional["TempDir"]:
    try:
      dfd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
      return None
    lfd = -1
    try:
      lfd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                    dir_fd=dfd)
      fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      # Taken: still the directory at its path, with this lock file in it.
      if (os.fstat(dfd).st_nlink and os.fstat(lfd).st_nlink
          and _same_file(os.stat(path, follow_symlinks=False), os.fstat(dfd))
          and _same_file(os.stat(LOCK_FILE, dir_fd=dfd, follow_symlinks=False), os.fstat(lfd))):
        return cls(path, _shardfile.OutDir(dfd, path, durable), lfd)
    except (FileNotFoundError, BlockingIOError):
      pass
    except BaseException:
      if lfd >= 0:
        os.close(lfd)
      os.close(dfd)
      raise
    if lfd >= 0:
      os.close(lfd)
    os.close(dfd)
    return None

  def check(self, builder: IndexBuilder, chunk_bytes: int) -> None:
    """That the directory at :attr:`path` is still this one and holds every file written.

    Raises:
      ArchiveError: it was removed, replaced or emptied in part (by hand; a
        clean never touches it while its lock is held).
    """
    missing = []
    try:
      here = os.stat(self.path, follow_symlinks=False)
    except OSError:
      here = None
    if here is None or not _same_file(here, os.fstat(self.out.fd)):
      missing.append(self.path)
    else:
      dfd = self.out.fd
      for rel, size in _expected_files(builder, chunk_bytes):
        try:
          st = os.stat(rel, dir_fd=dfd, follow_symlinks=False)
        except OSError:
          st = None
        if st is None or not stat.S_ISREG(st.st_mode) or (size is not None
                                                           and st.st_size != size):
          missing.append(os.path.join(self.path, rel))
    if missing:
      raise ArchiveError(
          f"the save's temporary directory {self.path} was removed or changed while it was"
          f" written (missing or altered: {', '.join(missing[:8])}"
          + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
          + "); nothing is committed")

  def commit(self, final: str) -> None:
    """Renames the directory to ``final`` (never replacing anything), then fsyncs
    ``final``'s parent (when durable) and drops the lock file."""
    commit_dir(self.path, final)
    self.path, self.committed = final, True
    if self.out.durable:
      parent = os.path.dirname(final) or "."
      fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
      try:
        os.fsync(fd)
      except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (committing a checkpoint)", final) from None
      finally:
        os.close(fd)
    try:
      os.unlink(LOCK_FILE, dir_fd=self.out.fd)
    except OSError:
      pass  # an empty file no reader opens; the checkpoint is complete without it gone

  def discard(self) -> None:
    """Removes what was written unless it is committed (best effort: a failed save
    leaves nothing it can remove)."""
    if self.committed:
      return
    try:
      _remove_held(self.path, self.out.fd)
    except (OSError, ArchiveError):
      pass

  def close(self) -> None:
    """Releases the lock and the directory."""
    self.out.close()
    if self._lock >= 0:
      os.close(self._lock)
      self._lock = -1


def _expected_files(builder: IndexBuilder, chunk_bytes: int) -> list[tuple[str, Optional[int]]]:
  """Every file a checkpoint written by ``builder`` holds, relative to its root, with
  the exact size of each shard file (None: any size)."""
  files: list[tuple[str, Optional[int]]] = [(INDEX_FILE, None)]
  for name, layout, _ in builder.archives:
    files.append((os.path.join(name, ARCHIVE_FILE), None))
    sizes: dict[str, int] = {}
    for leaf in builder.layouts[layout]["leaves"]:
      if isinstance(leaf, list):
        sizes[leaf[1]] = sizes.get(leaf[1], 0) + leaf[2]
    for dtype, n in sorted(sizes.items()):
      if not n:
        continue
      itemsize = np.dtype(fmt.np_dtype(dtype, name)).itemsize
      chunk = _shardfile.chunk_elements(n, itemsize, chunk_bytes)
      files.append((os.path.join(name, dtype, _shardfile.META_FILE), None))
      files.append((os.path.join(name, dtype, *_shardfile.SHARD_KEY),
                    _shardfile.file_size(n, itemsize, chunk)))
  return files


def new_temp_dir(final: str, *, durable: bool = True) -> TempDir:
  """Creates, holds and locks the hidden sibling a checkpoint is written into.

  First removes what earlier saves to ``final`` on this host left behind
  (directories whose lock nobody holds).

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
  try:
    remove_temp_dirs(final)
  except ArchiveError:
    pass  # what an earlier save left and cannot be removed does not stop this one
  return TempDir.create(final, durable)


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
                 progress: Optional[ProgressCallback] = None, durable: bool = True) -> None:
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
      ``directory``); nothing is left behind.
    ReshardError: a record that cannot be stored (no records, an invalid
      archive, a state node type the format cannot re-create).

  Everything is written into a temporary sibling directory, held by its
  descriptor and locked (``flock``) by this save, that is renamed to
  ``directory`` at the very end, once it is checked to be still this save's
  and complete: a failed save leaves nothing, and a killed one leaves a
  ``.NAME.tmp-*`` sibling (never loadable) whose lock is then free, which the
  next save to ``directory`` on the same host removes, as does ``jaxreshard
  clean``. Neither ever removes a directory whose writer holds its lock.

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
  if not isinstance(durable, bool):
    raise ReshardError(f"durable {durable!r} must be True or False")
  tmp = new_temp_dir(final, durable=durable)
  try:
    builder = write_checkpoint(tmp.out, records, chunk_bytes=chunk_bytes,
                               progress=lambda i, nbytes: reporter.step(nbytes, archive=i))
    tmp.check(builder, chunk_bytes)
    tmp.commit(final)
  except OSError as e:
    tmp.discard()
    if isinstance(e, ArchiveExistsError) or not e.errno:
      raise
    # A full disk, a quota or a permission: named by the checkpoint, since the
    # temporary file it happened in is gone.
    raise type(e)(e.errno, f"{e.strerror} (saving a checkpoint)", final) from None
  except BaseException:
    tmp.discard()
    raise
  finally:
    tmp.close()
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

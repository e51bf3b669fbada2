"""Saving atomically: a hidden temporary sibling directory, its writer's lock, the commit.

A checkpoint is written into ``.NAME.tmp-ID-PID-HOST`` next to its final
path, held under ``flock`` on ``LOCK_FILE`` for the whole save, checked
complete and renamed into place without replacing anything; directories
nobody holds are a dead writer's and may be removed.
"""

from __future__ import annotations

import fcntl
import os
import stat

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.checkpoint.index import ARCHIVE_FILE, INDEX_FILE
from jaxreshard._src.checkpoint.rename import commit_dir, committed, forget, holds, not_this_save
from jaxreshard._src.checkpoint.table import TABLE_FILE
from jaxreshard._src.checkpoint.tempname import ORBAX_TEMP_SUFFIX, is_temporary, temp_stem
from jaxreshard._src.checkpoint.writer import IndexBuilder
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError

__all__ = [
  "LOCK_FILE",
  "ORBAX_TEMP_SUFFIX",
  "TempDir",
  "commit_dir",
  "has_lock_file",
  "hold",
  "holds",
  "is_temporary",
  "remove_held",
  "new_temp_dir",
  "not_this_save",
  "remove_temp_dirs",
  "temp_dirs",
]


LOCK_FILE = ".jaxreshard-save.lock"
"""The file in a temporary directory that its writer holds ``flock(LOCK_EX)`` on
for the whole save: a directory whose lock nobody holds has no writer."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_probe(path: str) -> tuple[int | None, int | None]:
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
      lfd = os.open(
        LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
      )
    fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:  # held by its writer (EWOULDBLOCK), or not ours to lock
    if lfd >= 0:
      os.close(lfd)
    os.close(dfd)
    return None, None
  return dfd, lfd


def temp_dirs(
  final: str, *, strict: bool = False, unlocked: bool = False
) -> list[tuple[str, bool | None]]:
  """The temporary siblings saves to ``final`` left, each with whether its writer is gone.

  A parent directory that cannot be listed has none to a save (which goes on
  without them); with ``strict`` (``clean``, which reports what it found) it
  raises the ``OSError`` naming it. With ``unlocked`` (``clean`` again), orbax's
  temporary directories that hold no lock file are listed too, with None: no
  lock says whether their writer is gone (orbax made the directory, and the
  save was killed before it locked it), so they are never removed here.

  A writer holds an exclusive ``flock`` on the directory's lock file for its
  whole save; the writer is gone when that lock is free (taken and released
  at once here). Neither the process id nor the host in the directory's name
  decides it: process ids repeat across pid namespaces that share a host name.
  """
  parent, name = os.path.split(final)
  stem = temp_stem(name)
  out = []
  try:
    entries = os.listdir(parent)
  except OSError as e:
    if strict:
      raise OSError(e.errno, f"{e.strerror} (listing it for saves to {final})", parent) from None
    return out
  for entry in sorted(entries):
    m = _tempname.TEMP_NAME.match(entry)
    ours = bool(m) and m["name"] == stem
    # Orbax's temporary directory of a save_sharded (or of a CheckpointManager with
    # DurableRenameTemporaryPath): its lock file says its writer follows this protocol;
    # without one, orbax's own writers hold no lock, and liveness cannot be decided.
    orbax = entry.startswith(name + ORBAX_TEMP_SUFFIX)
    if not (ours or orbax):
      continue
    path = os.path.join(parent, entry)
    if os.path.islink(path) or not os.path.isdir(path):
      continue  # a link or a file of that name is no save's: never followed or removed
    if orbax and not has_lock_file(path):
      if unlocked:
        out.append((path, None))
      continue
    dfd, lfd = _lock_probe(path)
    if dfd is not None:
      os.close(lfd)
      os.close(dfd)
    out.append((path, dfd is not None))
  return out


def has_lock_file(path: str) -> bool:
  """Whether the directory ``path`` holds a regular lock file (its writer takes locks)."""
  try:
    return stat.S_ISREG(os.stat(os.path.join(path, LOCK_FILE), follow_symlinks=False).st_mode)
  except OSError:
    return False


def hold(path: str) -> tuple[int, int] | None:
  """``(dir_fd, lock_fd)`` of the directory ``path`` with its writer's lock taken (the
  lock file made when missing), or None when another writer holds it or the
  directory or its lock file is no longer the one at its path (a clean removed it
  as it was taken); the caller closes both when its save is over."""
  dfd, lfd = _lock_probe(path)
  if dfd is None:
    return None
  try:
    if _still_there(path, dfd, lfd):
      return dfd, lfd
  except OSError:
    pass
  os.close(lfd)
  os.close(dfd)
  return None


def _still_there(path: str, dfd: int, lfd: int) -> bool:
  """Whether the directory ``dfd`` and its lock file ``lfd`` are still the ones at
  ``path`` (neither removed nor replaced since they were opened)."""
  return bool(
    os.fstat(dfd).st_nlink
    and os.fstat(lfd).st_nlink
    and _same_file(os.stat(path, follow_symlinks=False), os.fstat(dfd))
    and _same_file(os.stat(LOCK_FILE, dir_fd=dfd, follow_symlinks=False), os.fstat(lfd))
  )


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


def remove_held(path: str, dfd: int) -> bool:
  """Removes the directory ``path`` held as ``dfd`` (its lock held by the caller), the
  lock file last; False when ``path`` no longer names that directory (nothing removed).

  An orbax temporary directory, emptied, takes a temporary name of this host's
  before its lock file goes: orbax's name says nothing of a lock, so a process
  killed then would leave a directory without a lock that no clean may remove;
  under the new name the next clean removes it.

  Raises:
    ArchiveError: something in it could not be removed; names what is left.
  """
  # Only the directory that is still at ``path``: a directory renamed away (a save
  # committed just before an interrupt reached it) is someone's checkpoint now.
  try:
    here = _same_file(os.stat(path, follow_symlinks=False), os.fstat(dfd))
  except FileNotFoundError:
    here = False
  if not here:
    return False
  left = _remove_below(dfd, path, keep=LOCK_FILE)
  if not left:
    try:
      name = os.path.basename(path)
      if ORBAX_TEMP_SUFFIX in name and not _tempname.TEMP_NAME.match(name):  # orbax's
        last = _tempname.new_name(name.split(ORBAX_TEMP_SUFFIX)[0])
        last = os.path.join(os.path.dirname(path), last)
        commit_dir(path, last)  # never onto what is there
        path = last
      os.unlink(LOCK_FILE, dir_fd=dfd)
      if not _same_file(os.stat(path, follow_symlinks=False), os.fstat(dfd)):
        raise ArchiveError(f"{path} was replaced while it was removed; it is left as it is")
      os.rmdir(path)
    except FileNotFoundError:
      pass  # another clean removed it first
    except OSError as e:
      left.append(f"{path} ({e.strerror})")
  if left:
    raise ArchiveError(
      f"{path} was removed only partly; left: {', '.join(left[:8])}"
      + (f" and {len(left) - 8} more" if len(left) > 8 else "")
    )
  return True


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
    if not gone or not (everything or _tempname.this_host(path)):
      continue
    dfd, lfd = _lock_probe(path)  # taken again, and held while removing
    if dfd is None:
      continue  # a writer took it meanwhile
    try:
      try:
        if not remove_held(path, dfd):
          continue  # renamed away meanwhile: not a leftover
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
  def create(cls, final: str, durable: bool = True) -> TempDir:
    parent, base = os.path.split(final)
    for _ in range(8):
      path = os.path.join(parent, _tempname.new_name(base))
      os.mkdir(path)
      try:
        made = cls._take(path, durable)
      except BaseException:
        # Not taken (out of descriptors, say, or an interrupt while taking it):
        # what was made goes, by path (no descriptor needed); ``_take`` let go
        # of any lock it had.
        for remove, what in ((os.unlink, os.path.join(path, LOCK_FILE)), (os.rmdir, path)):
          try:
            remove(what)
          except OSError:
            pass
        raise
      if made is not None:
        return made
      # A clean took the new directory's lock first (it found no writer's lock
      # yet): it removes it; this save starts over in a new one.
    raise ArchiveError(
      f"{final}: every temporary directory made for the save was taken by a"
      " concurrent clean; nothing was written"
    )

  @classmethod
  def _take(cls, path: str, durable: bool) -> TempDir | None:
    dfd = lfd = -1
    out = None
    try:
      dfd = os.open(path, _DIR_FLAGS)
      lfd = os.open(
        LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
      )
      fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      # Taken: still the directory at its path, with this lock file in it.
      if _still_there(path, dfd, lfd):
        out = _shardfile.OutDir(dfd, path, durable)
        return cls(path, out, lfd)
    except (FileNotFoundError, BlockingIOError):
      pass
    except BaseException:
      if out is not None:  # it owns the directory's descriptor now (and closes it once)
        out.close()
        dfd = -1
      for fd in (lfd, dfd):
        if fd >= 0:
          os.close(fd)
      raise
    for fd in (lfd, dfd):
      if fd >= 0:
        os.close(fd)
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
        if st is None or not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
          missing.append(os.path.join(self.path, rel))
    if missing:
      raise ArchiveError(
        f"the save's temporary directory {self.path} was removed or changed while it was"
        f" written (missing or altered: {', '.join(missing[:8])}"
        + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        + "); nothing is committed"
      )

  def commit(self, final: str) -> None:
    """Renames the directory to ``final`` (never replacing anything), drops the lock
    file, then fsyncs ``final`` and its parent (when durable).

    Raises:
      ArchiveError: the directory the rename put at ``final`` is not this one (given
        another after ``check``): moved aside again, nothing of this save committed.
    """
    try:
      committed(final, self.out.fd)  # first: no interrupt lands between rename and record
      commit_dir(self.path, final)
    except BaseException:
      if not holds(final, self.out.fd):
        forget(final)  # not renamed: a directory made there may reuse the inode
      raise
    if not holds(final, self.out.fd):
      raise ArchiveError(not_this_save(self.path, final))
    self.path, self.committed = final, True
    try:
      os.unlink(LOCK_FILE, dir_fd=self.out.fd)
      if self.out.durable:
        # The unlink made durable too, or a crash may bring the lock file back.
        os.fsync(self.out.fd)
    except OSError:
      pass  # an empty file no reader opens; the checkpoint is complete without it gone
    if self.out.durable:
      parent = os.path.dirname(final) or "."
      fd = -1
      try:
        # Opening the parent can fail too (a directory writable but not readable).
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.fsync(fd)
      except OSError as e:
        raise OSError(
          e.errno,
          f"{e.strerror} (fsync of the parent directory after the rename: the checkpoint"
          " is in place and complete, but its rename may not survive a crash)",
          final,
        ) from None
      finally:
        if fd >= 0:
          os.close(fd)

  def discard(self) -> None:
    """Removes what was written unless it is committed (best effort: a failed save
    leaves nothing it can remove). A directory that is no longer at its temporary
    path was renamed into place: it is kept, whatever interrupted the save after,
    less its lock file."""
    if self.committed:
      return
    try:
      if not remove_held(self.path, self.out.fd):
        # Renamed into place before the interrupt: the checkpoint is whole and
        # only this save's lock file is left in it, which goes as a commit's does.
        os.unlink(LOCK_FILE, dir_fd=self.out.fd)
    except (OSError, ArchiveError):
      pass

  def __del__(self):
    # An interrupt that lands between the directory's making and its caller's
    # hold on it drops this object: its descriptors, the lock's included, go with
    # it, so a later save or clean can remove the directory.
    try:
      self.close()
    except Exception:  # noqa: BLE001 - a finalizer reports nothing
      pass
    except KeyboardInterrupt:
      # A finalizer cannot raise one (Python prints and drops it); this object is dropped
      # where its save ends or an interrupt already unwinds it: too late to stop anything.
      self.close()

  def close(self) -> None:
    """Releases the lock and the directory."""
    try:
      self.out.close()
    finally:
      lock, self._lock = self._lock, -1
      if lock >= 0:
        os.close(lock)


def _expected_files(builder: IndexBuilder, chunk_bytes: int) -> list[tuple[str, int | None]]:
  """Every file a checkpoint written by ``builder`` holds, relative to its root, with
  the exact size of each shard file (None: any size)."""
  files: list[tuple[str, int | None]] = [(INDEX_FILE, None)]
  if builder.table:
    files.append((TABLE_FILE, None))
  for name, layout, _ in builder.archives:
    files.append((os.path.join(name, ARCHIVE_FILE), None))
    for dtype, n in sorted(builder.layout_sizes(layout).items()):
      if not n:
        continue
      itemsize = np.dtype(fmt.np_dtype(dtype, name)).itemsize
      chunk = _shardfile.chunk_elements(n, itemsize, chunk_bytes)
      files.append((os.path.join(name, dtype, _shardfile.META_FILE), None))
      files.append(
        (os.path.join(name, dtype, *_shardfile.SHARD_KEY), _shardfile.file_size(n, itemsize, chunk))
      )
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

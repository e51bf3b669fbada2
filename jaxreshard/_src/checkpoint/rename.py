"""The commit of a save: a rename that never replaces what is at its target."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import uuid
from typing import Any

from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.errors import ArchiveExistsError

__all__ = ["commit_dir", "committed", "committed_here", "forget", "holds", "not_this_save"]

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
    if (
      renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE) == 0
    ):
      return
    err = ctypes.get_errno()
    if err == errno.EEXIST or err == errno.ENOTEMPTY:
      raise ArchiveExistsError(f"{final} appeared while it was being written")
    if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # unsupported: fall back
      raise OSError(err, os.strerror(err), final)
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} appeared while it was being written")
  os.rename(tmp, final)


def holds(path: str, fd: int) -> bool:
  """Whether the directory at ``path`` is the one open as ``fd``."""
  try:
    a, b = os.stat(path, follow_symlinks=False), os.fstat(fd)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
  except OSError:
    return False


def not_this_save(tmp: str, final: str) -> str:
  """The refusal of a rename that put another directory at ``final``, which is
  first moved aside (never onto anything) so that nothing is left there that
  this save did not write."""
  # Not a temporary name: a clean must not take it for a killed save's and remove it.
  parent, base = os.path.split(os.path.normpath(final))
  aside = os.path.join(parent, f".{_tempname.temp_stem(base)}.not-this-save-{uuid.uuid4().hex}")
  try:
    commit_dir(final, aside)
    where = f"it is moved aside to {aside}"
  except OSError as e:
    where = f"moving it aside failed ({e}): it is still at {final}"
  return (
    f"{final}: the directory renamed into place is not the one the save wrote: its"
    f" temporary directory {tmp} was replaced after its files were checked; {where};"
    " nothing of this save is committed"
  )


# The directories this process's saves renamed into place, most recent last:
# absolute path -> (device, inode) of the directory committed there.
_COMMITTED: dict[str, tuple[int, int]] = {}
_COMMITTED_KEPT = 256
_COMMITTED_LOCK = threading.Lock()


def committed_here(path: Any) -> bool:
  """Whether the directory at ``path`` is one a save of this process committed there
  (the same directory, not another made at that path since)."""
  key = os.path.abspath(path)
  with _COMMITTED_LOCK:
    made = _COMMITTED.get(key)
  try:
    st = os.stat(key, follow_symlinks=False)
  except OSError:
    return False
  return made == (st.st_dev, st.st_ino) and stat.S_ISDIR(st.st_mode)


def forget(path: Any) -> None:
  """Drops what ``committed`` recorded at ``path`` (a rename that did not happen, or a
  path found empty: a directory made there later may reuse the inode number)."""
  with _COMMITTED_LOCK:
    _COMMITTED.pop(os.path.abspath(path), None)


def committed(path: str, fd: int) -> None:
  """Records the directory open as ``fd`` as the one a save commits at ``path``."""
  st = os.fstat(fd)
  with _COMMITTED_LOCK:
    _COMMITTED.pop(os.path.abspath(path), None)
    _COMMITTED[os.path.abspath(path)] = (st.st_dev, st.st_ino)
    while len(_COMMITTED) > _COMMITTED_KEPT:
      del _COMMITTED[next(iter(_COMMITTED))]

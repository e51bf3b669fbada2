"""The commit of a save: a rename that never replaces what is at its target."""

from __future__ import annotations

import ctypes
import errno
import os

from jaxreshard._src.errors import ArchiveExistsError

__all__ = ["commit_dir"]

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

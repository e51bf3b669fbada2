"""Orbax's atomic-rename commit, made durable before a save is reported done.

Orbax commits a checkpoint (a step, or one item of it) by renaming its
temporary directory into place, and fsyncs neither the directory nor its
parent: after a power loss a save reported done may be gone, or (where the
rename reached the disk before the directory's entries) incomplete.
:class:`DurableRenameTemporaryPath` is orbax's own ``AtomicRenameTemporaryPath``
with the fsyncs a durable rename needs: the directory before it is renamed
(the entries of every file the handlers made in it), its parent after (the
rename itself), and the renamed directory again (the entries of the small
files orbax writes while it commits: ``commit_success.txt``, the metadata's
commit time, which nothing reads to load a step and whose contents are not
fsync'ed). The handlers' files are fsync'ed by whoever wrote them
(jaxreshard's archives and index are, when written).

``save_sharded`` commits through it. A ``CheckpointManager`` takes it as
``CheckpointManagerOptions(temporary_path_class=DurableRenameTemporaryPath)``,
which orbax uses for each step and for each item of a step.
"""

from __future__ import annotations

import asyncio
import os

import orbax.checkpoint as ocp

__all__ = ["DurableRenameTemporaryPath", "fsync_dir"]


def fsync_dir(path: str) -> None:
  """fsyncs the directory ``path`` (its entries: names made, removed or renamed in it)."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


class DurableRenameTemporaryPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """``AtomicRenameTemporaryPath`` whose commit is on the disk when it returns.

  The temporary directory is fsync'ed before the rename, the parent of the final
  one after, and the final one again (the files orbax adds while it commits), so
  a commit that returned survives a crash or power loss.
  Paths that are not local directories (another file system's ``epath``) are
  committed as orbax commits them.
  """

  async def finalize(self) -> None:  # pylint: disable=invalid-overridden-method
    tmp, final = os.fspath(self.get()), os.fspath(self.get_final())
    local = os.path.isdir(tmp)
    if local:
      await asyncio.to_thread(fsync_dir, tmp)
    await super().finalize()
    if local:
      await asyncio.to_thread(fsync_dir, os.path.dirname(os.path.abspath(final)))
      if os.path.isdir(final):
        await asyncio.to_thread(fsync_dir, final)

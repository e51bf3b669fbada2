"""Orbax's atomic-rename commit, made durable before a save is reported done.

Orbax commits a checkpoint (a step, or one item of it) by renaming its
temporary directory into place, and fsyncs neither the directory nor its
parent: after a power loss a save reported done may be gone, or (where the
rename reached the disk before the directory's entries) incomplete.
:class:`DurableRenameTemporaryPath` is orbax's own ``AtomicRenameTemporaryPath``
with the fsyncs a durable rename needs: the directory before it is renamed
(the entries of every file the handlers made in it), its parent after (the
rename itself), and the renamed directory again with the small files orbax
writes while it commits (``commit_success.txt``, the metadata's commit time).
Every file and directory in the temporary directory is fsync'ed before the
rename, whoever wrote it (orbax's own handlers do not fsync their files), and
after it the parent and the parent's parent (a run directory orbax made for the
first step).

Orbax gives every save to one path the same temporary directory, and a new
save removes whatever is there. Here the writer holds a lock (``flock`` on a
lock file in it, as ``save_records``' temporary directories have) from its
creation to the commit. A save that finds the directory held by another
process's writer removes nothing: ``save_sharded`` refuses before it starts;
inside orbax's directory creation (where raising would leave orbax's commit
threads waiting for a signal until their timeout) the save waits until that
writer commits or fails (up to a little less than orbax's coordination
timeout), and its own rename then refuses to replace what the other committed.
In a ``CheckpointManager`` a failed save's directory stays locked until orbax
lets go of its temporary-path objects (garbage collection) or this process
saves the step again. The check and the creation happen under a lock on the parent
directory, so two saves never both take one directory. Within one process, a
new save of a path takes over what an earlier save of it left (orbax keeps a
failed save's temporary paths alive; a retried step finds them); two threads
saving one path at once are not told apart. ``clean`` removes such a
directory once its lock is free (with ``--all``).

A committed checkpoint is never removed or replaced by a save through it. A
``CheckpointManager`` saves with orbax's ``force=True``, whose save removes what
is at the step's path before writing: a step another manager or process
committed, which this manager's list of steps missed, would be gone (and, until
the new rename, no step at all). Orbax asks the class for the save's temporary
path (``from_final``, in every process) before it removes anything: a committed
step is refused there (``ArchiveExistsError`` naming it; nothing is written or
removed, and the manager's next save goes on). One committed after that look is
kept too: the final path this class gives orbax removes nothing (orbax's removal
is refused), and the rename does not replace it (epath's rename refuses an
existing destination, the kernel's a directory that is not empty): the save's
commit is refused and its directory removed. A step the manager itself deleted
(``delete``, ``max_to_keep``) with ``enable_background_delete=True`` is only queued
for orbax's deleter thread: a save of its number waits until that thread of this
process is done with it (``deletes``), then looks. Orbax's synchronous ``Checkpointer``
(``enable_async_checkpointing=False``) removes the step before it asks the class,
which then cannot keep it.

``save_sharded`` commits through it; when it fails while orbax is still making
its directory (in a thread of orbax's own), it waits for that creation and
removes what it made, and a creation that starts after it failed makes
nothing. A ``CheckpointManager`` takes it as
``CheckpointManagerOptions(temporary_path_class=DurableRenameTemporaryPath)``,
which orbax uses for each step and for each item of a step.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import time
import weakref

import orbax.checkpoint as ocp
from etils import epath

from jaxreshard._src.checkpoint import tempdir as _tempdir
from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError
from jaxreshard._src.orbax import deletes as _deletes
from jaxreshard._src.orbax.inflight import InFlight

__all__ = [
  "DurableRenameTemporaryPath",
  "fsync_dir",
  "fsync_tree",
  "one_save",
  "refuse_if_committed",
  "refuse_if_held",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: str) -> None:
  """fsyncs the directory ``path`` (its entries: names made, removed or renamed in it)."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(path: str) -> None:
  """fsyncs every regular file and directory under ``path`` (links are not followed),
  the directories after what they hold."""
  for root, _dirs, files in os.walk(path, topdown=False):
    for name in files:
      _fsync_file(os.path.join(root, name))
    fsync_dir(root)


def _fsync_file(name: str, dir_fd: int | None = None) -> None:
  """fsyncs ``name`` if it is a regular file; a link or what is not ours to open is
  left alone (nothing a restore reads)."""
  try:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
  except OSError:
    return
  try:
    if stat.S_ISREG(os.fstat(fd).st_mode):
      os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_top(path: str) -> None:
  """fsyncs the regular files directly in the directory ``path``, then the directory:
  what orbax writes into a temporary directory after its tree was fsync'ed (the
  metadata's commit time, ``commit_success.txt``) is on the disk when the save returns."""
  with os.scandir(path) as entries:
    names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
  dfd = os.open(path, _DIR_FLAGS)
  try:
    for name in names:
      _fsync_file(name, dfd)
    os.fsync(dfd)
  finally:
    os.close(dfd)


def _close(*fds: int) -> None:
  for fd in fds:
    try:
      os.close(fd)
    except OSError:
      pass


def refuse_if_held(tmp: str, final: str) -> None:
  """Raises ``ArchiveExistsError`` when a live writer holds the lock of ``tmp``, the
  temporary directory of a save to ``final``.

  ``save_sharded`` asks before orbax starts its save (a refusal from inside
  orbax's directory creation leaves orbax's commit thread waiting for a signal
  until its timeout); ``create`` asks again under the parent's lock.
  """
  if _live(tmp):
    raise ArchiveExistsError(
      f"{tmp}: another save to {final} is writing it (its writer holds its"
      " lock); this save removed nothing"
    )


def refuse_if_committed(final: str, outcome: str = "this save removed nothing") -> None:
  """Raises ``ArchiveExistsError`` naming ``final`` when something is at it: a save
  through ``DurableRenameTemporaryPath`` never replaces or removes a committed
  checkpoint (a ``CheckpointManager`` whose list of steps missed another manager's
  or process's step saves it with orbax's ``force=True``, which removes it first)."""
  if os.path.lexists(final):
    raise _exists(final, outcome)


def _exists(final: str, outcome: str) -> ArchiveExistsError:
  return ArchiveExistsError(
    f"{final} already exists; jaxreshard never overwrites a checkpoint (a step another"
    f" manager or process committed included): {outcome}"
  )


# The type epath gives a local path (``PosixGPath``), which orbax's paths are here.
_LOCAL_PATH = type(epath.Path("/"))


class _KeptPosixGPath(_LOCAL_PATH):
  """A save's final path whose ``rmtree`` removes nothing. Orbax removes the final
  path of a forced save (every ``CheckpointManager`` save) after it asked the class
  for it (``from_final``, which refuses a committed one): a step another process
  commits in between is refused here instead of removed. Paths made from it
  (``final / name``) are removed as epath removes them."""

  _kept = False

  @classmethod
  def of(cls, final: epath.Path) -> _KeptPosixGPath:
    path = cls(final)
    path._kept = True
    return path

  def rmtree(self, missing_ok: bool = False) -> None:
    if not self._kept:
      return super().rmtree(missing_ok=missing_ok)
    final = os.fspath(self)
    refuse_if_committed(final)
    if not missing_ok:
      raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), final)
    return None


# A save waits for another process's save of the same path until this long before
# orbax's coordination timeout; it looks at a lock another holds this often.
_MARGIN_S = 5.0
_POLL_S = 0.005

_STILL_QUEUED = (
  "orbax's background deleter (enable_background_delete; the primary process's,"
  " which removes steps for every process) has not removed it yet, and this save"
  " waited for it as long as orbax waits for a step's processes; this save removed"
  " nothing (save the step once the deletion is done, e.g. after the manager's"
  " close(), which raises the error of a deleter that stopped, or delete without"
  " background deletion)"
)
_DELETER_STOPPED = (
  "it was queued for orbax's background deleter (enable_background_delete) of this"
  " process, whose thread stopped at an error before removing it (the manager's"
  " close() raises that error); this save removed nothing"
)


def _wait_s() -> float:
  """How long a save waits for another's work on its path: a little less than
  orbax's coordination timeout, which its other processes wait for it."""
  return max(1.0, ocp.multihost.coordination_timeout() - _MARGIN_S)


# The temporary paths this process holds the lock of, by path.
_HOLDERS: dict[str, weakref.ref] = {}


def _try_flock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return False
  return True


def _take_over(key: str) -> None:
  """Frees the lock this process still holds on the temporary directory ``key``: a
  new save of its path in this process means the save that made it is over (orbax
  keeps a failed save's temporary paths alive, so a retry of a step finds them)."""
  ref = _HOLDERS.pop(key, None)
  holder = ref() if ref is not None else None
  if holder is not None:
    holder._let_go()  # pylint: disable=protected-access


def _live(tmp: str) -> bool:
  """Whether another writer holds the lock of the temporary directory ``tmp``."""
  if not (os.path.isdir(tmp) and not os.path.islink(tmp) and _tempdir.has_lock_file(tmp)):
    return False
  held = _tempdir.hold(tmp)
  if held is None:
    return True
  _close(*held)
  return False


def _is_local(path: str) -> bool:
  return "://" not in path


class DurableRenameTemporaryPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """``AtomicRenameTemporaryPath`` whose commit is on the disk when it returns.

  The temporary directory is fsync'ed before the rename, the parent of the final
  one after, and the final one again (the files orbax adds while it commits), so
  a commit that returned survives a crash or power loss. A checkpoint committed
  at the final path (another manager's or process's step) is refused, never
  removed (orbax's ``force=True``) nor replaced.
  Paths that are not local directories (another file system's ``epath``) are
  committed as orbax commits them.
  """

  _held: tuple[int, int] | None = None
  _release: weakref.finalize | None = None
  # The instances of a class made by ``one_save``: the temporary paths of one save.
  _made: list[DurableRenameTemporaryPath] | None = None
  # A ``one_save`` class's: the creations of its directories orbax runs in its
  # threads. Orbax makes a save's directory while the handlers start writing,
  # so a save may fail before that creation is done: a creation that starts
  # after the save is over makes nothing (it returns the path unmade; raising
  # would only have orbax's thread log it), one running is waited for and what
  # it made removed, so a failed save leaves no directory behind.
  _creations: InFlight | None = None

  def __init__(self, temporary_path, final_path, **kwargs):
    if type(final_path) is _LOCAL_PATH:  # pylint: disable=unidiomatic-typecheck
      final_path = _KeptPosixGPath.of(final_path)  # never removed by orbax's force
    super().__init__(temporary_path, final_path, **kwargs)

  @classmethod
  def from_final(cls, final_path, **kwargs):
    """Orbax asks for a save's temporary path (each process, before the save
    starts); a committed checkpoint at ``final_path`` is refused here, and one
    committed later is neither removed (orbax's ``force``) nor replaced (the rename)."""
    final = os.fspath(final_path)
    if _is_local(final):
      # A step this process's manager deleted in the background is removed first.
      if _deletes.wait_for(final, _wait_s()):
        raise _exists(final, _STILL_QUEUED)
      if _deletes.stopped_at(final) and os.path.lexists(final):
        raise _exists(final, _DELETER_STOPPED)
      # An item's final path lies in its step's temporary directory: what is there
      # is a killed save's leftover, never committed, which orbax removes.
      if not _tempname.is_temporary(os.path.basename(os.path.dirname(os.path.abspath(final)))):
        refuse_if_committed(final)
    return super().from_final(final_path, **kwargs)

  @classmethod
  def end_creations(cls) -> None:
    """A ``one_save`` class's save is over: no creation of its directories starts,
    and those orbax is running are waited for."""
    if cls._creations is not None:
      cls._creations.stop()

  @classmethod
  def let_go(cls) -> None:
    """Removes the directories the instances of a ``one_save`` class still hold (a
    failed save's: a committed one is no longer held) and frees their locks,
    after ``end_creations``."""
    cls.end_creations()
    for path in cls._made or ():
      if path._held is not None:  # pylint: disable=protected-access
        try:
          _tempdir.remove_held(os.fspath(path.get()), path._held[0])  # pylint: disable=protected-access
        except (OSError, ArchiveError):
          pass  # left to the next save of the path, or to clean
      path._let_go()  # pylint: disable=protected-access

  async def create(self):  # pylint: disable=invalid-overridden-method
    tmp = os.fspath(self.get())
    if not _is_local(tmp):
      return await super().create()
    creations = type(self)._creations
    if creations is None:
      return await self._create(tmp, None)
    if not creations.start():
      return self.get()
    try:
      return await self._create(tmp, creations)
    finally:
      creations.done()

  async def _create(self, tmp: str, creations: InFlight | None):
    final = os.fspath(self.get_final())
    parent = os.path.dirname(os.path.abspath(tmp))
    os.makedirs(parent, exist_ok=True)
    key = os.path.abspath(tmp)
    # Orbax's other threads wait for this creation up to its coordination timeout;
    # giving up a little before it leaves them little to wait for after a refusal.
    deadline = time.monotonic() + _wait_s()
    taken = 0
    while True:
      # The parent is the caller's choice, a link to a directory included (as the
      # checkpoint's own path may be); what is made under it is never a link.
      pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
      try:
        # One save at a time decides whether the directory is taken and makes it. The
        # parent's lock is polled, never waited for in a thread: orbax creates a
        # step's items at once, and each wait would hold one of the threads that
        # creating the directories needs.
        while not _try_flock(pfd):
          if creations is not None and creations.stopped:
            return self.get()
          await asyncio.sleep(_POLL_S)
        _take_over(key)
        if not _live(tmp):  # absent, or a killed writer's: orbax removes it
          try:
            path = await super().create()
          except BaseException:
            _remove_made(tmp)
            raise
          held = _tempdir.hold(tmp)
          if held is None:  # a clean removed it as it was made: made anew
            taken += 1
            if taken < 8:
              continue
            raise ArchiveExistsError(f"{tmp}: every directory made for this save was taken")
          self._held = held
          # A failed save's lock goes at ``let_go``, when this object does, or
          # when a later save of the path in this process takes it over.
          self._release = weakref.finalize(self, _close, *held)
          _HOLDERS[key] = weakref.ref(self)
          if type(self)._made is not None:
            type(self)._made.append(self)
          return path
      finally:
        os.close(pfd)  # the parent's lock with it
      # Another process's save is writing it: raising here would leave orbax's
      # commit threads waiting for this creation's signal until their timeout, so
      # this save waits for that one to commit or fail (the rename then refuses
      # what that one committed) and takes the directory when it is free.
      if creations is not None and creations.stopped:  # the save failed meanwhile
        return self.get()
      if time.monotonic() > deadline:
        raise ArchiveExistsError(
          f"{tmp}: another save to {final} has been writing it for longer than orbax"
          " waits for a directory (its writer holds its lock); this save removed nothing"
        )
      await asyncio.sleep(_POLL_S * 10)

  def _let_go(self) -> None:
    if self._release is not None:
      self._release()
    self._held = self._release = None
    key = os.path.abspath(os.fspath(self.get()))
    ref = _HOLDERS.get(key)
    if ref is not None and ref() is self:
      del _HOLDERS[key]

  async def finalize(self) -> None:  # pylint: disable=invalid-overridden-method
    tmp, final = os.fspath(self.get()), os.fspath(self.get_final())
    local = _is_local(tmp) and os.path.isdir(tmp)
    try:
      if local:
        await asyncio.to_thread(fsync_tree, tmp)
      try:
        if local:  # another process's save of this path may have committed meanwhile
          refuse_if_committed(final, _NOT_RENAMED)
        await super().finalize()  # its rename never replaces a directory that is not empty
      except (ArchiveExistsError, OSError) as e:
        if not (local and os.path.lexists(final)) or not _refused_rename(e):
          raise
        if self._held is not None:  # this save's own directory: it commits nowhere now
          store = self._checkpoint_metadata_store
          if store is not None:  # orbax's writes of its metadata into it end first
            await asyncio.to_thread(store.wait_until_finished)
          try:
            _tempdir.remove_held(tmp, self._held[0])
          except (OSError, ArchiveError):
            pass  # left to the next save of the path, or to clean
        if isinstance(e, ArchiveExistsError):
          raise
        raise _exists(final, f"{_NOT_RENAMED} ({e})") from e
      if local and self._held is not None and not _tempdir.holds(final, self._held[0]):
        # Orbax renames by path: another directory given the temporary path after
        # the fsync above would be committed as this step.
        raise ArchiveError(_tempdir.not_this_save(tmp, final))
      if local:
        if self._held is not None:
          # The lock file goes once the directory is in place (its fd follows the rename).
          try:
            os.unlink(_tempdir.LOCK_FILE, dir_fd=self._held[0])
          except FileNotFoundError:
            pass
        parent = os.path.dirname(os.path.abspath(final))
        await asyncio.to_thread(fsync_dir, parent)
        await asyncio.to_thread(fsync_dir, os.path.dirname(parent))
        if os.path.isdir(final):
          await asyncio.to_thread(_fsync_top, final)
    finally:
      self._let_go()


def _refused_rename(e: BaseException) -> bool:
  """Whether ``e`` is a commit refused for what is at its final path: this module's
  check, epath's (a ``FileExistsError`` without an errno), or the rename's own."""
  if isinstance(e, (ArchiveExistsError, FileExistsError)):
    return True
  return isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY)


_NOT_RENAMED = "this save is not committed (its directory, never renamed over it, is removed)"


def _remove_made(tmp: str) -> None:
  """Removes what a creation that failed made at ``tmp`` (no other save of the path
  makes it meanwhile: the creation holds the parent's lock)."""
  held = _tempdir.hold(tmp)
  if held is None:
    return
  try:
    _tempdir.remove_held(tmp, held[0])
  except (OSError, ArchiveError):
    pass  # left to the next save of the path, or to clean
  finally:
    _close(*held)


def one_save() -> type[DurableRenameTemporaryPath]:
  """A ``DurableRenameTemporaryPath`` class for one save: its ``let_go()`` frees what
  that save's temporary paths hold once the save is over, failed or not."""
  return type(
    "DurableRenameTemporaryPath",
    (DurableRenameTemporaryPath,),
    {"_made": [], "_creations": InFlight()},
  )

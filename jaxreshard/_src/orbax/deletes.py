"""The steps this process's orbax background deleters have yet to remove.

With ``CheckpointManagerOptions(enable_background_delete=True)`` a manager's
``delete(step)`` (and its removal of a step past ``max_to_keep``) only queues the
step number; a thread removes the step later, finding its directory when it gets
to it (orbax's ``find_step_path``, which prefers an uncommitted directory of the
step: a new save's temporary one). A save of that step number meanwhile finds the
old step committed at its path, and a save that went on would have its own
directory, or the step it committed, removed by that thread.

So a save of a step through ``DurableRenameTemporaryPath`` first waits until every
step queued at its path is removed, and only then looks at what is committed
there. Each queued step is recorded here by its path (the run directory's links
resolved: two managers may spell it two ways) as orbax queues it, and let go when
the deleter's thread is done with it. Only orbax's primary process removes a step:
on another process the thread is done at once, and the step is waited for until
its directory is gone (the primary's deleter removes it before that process's
save of the step starts, which no process can commit alone). A thread that stopped
(orbax's deleter stops at its first error, and ``close`` raises it) removes
nothing more: its steps are let go, and a save that then finds one committed is
told so (:func:`stopped_at`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref

__all__ = ["stopped_at", "wait_for"]


def _kept(name: str, make):
  """The value ``name`` had before this module was run again (``importlib.reload``, as a
  notebook's autoreload does), else ``make()``. The wrappers installed on orbax's
  deleters stay, and call into this module's namespace: the steps they queued
  before must still be waited for, and a deleter tracked before is not wrapped twice.
  """
  return globals()[name] if name in globals() else make()


# The path of each queued step, with the deleter that queued it (once per queue).
_PENDING: dict[str, list] = _kept("_PENDING", dict)
# Steps another process's deleter removes (this one is not orbax's primary), by path.
_ELSEWHERE: set[str] = _kept("_ELSEWHERE", set)
# Steps left queued by a deleter whose thread stopped, by path.
_STOPPED: set[str] = _kept("_STOPPED", set)
# The deleters whose thread lets go of the steps it is done with (``_track``).
_TRACKED: weakref.WeakSet = _kept("_TRACKED", weakref.WeakSet)
_CHANGED: threading.Condition = _kept("_CHANGED", threading.Condition)
# How often a wait looks at whether a deleter's thread has stopped (it stops at
# its first error, with the steps after it still queued).
_POLL_S = 0.05


def _key(path) -> str:
  """A step's path with its run directory's links resolved (the step itself may not
  exist yet, or any more), each ``..`` taken where the kernel takes it: after the
  link before it."""
  path = os.fspath(path)
  return os.path.join(os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path))


def _step_path(standard, step: int) -> str:
  # The path the manager saves the step to (``build_step_path``, as its saves do).
  from orbax.checkpoint._src.path import step as step_lib  # pylint: disable=import-outside-toplevel

  return _key(step_lib.build_step_path(standard._directory, standard._name_format, step))  # pylint: disable=protected-access


def _alive(deleter) -> bool:
  thread = getattr(deleter, "_delete_thread", None)
  return thread is not None and thread.is_alive()


def _track(deleter) -> None:
  """Has ``deleter``'s thread let go of each step it is done with. Called before
  the first step is queued: the thread waits on an empty queue, and looks up the
  standard deleter's ``delete`` for every step it takes."""
  standard = deleter._standard_deleter  # pylint: disable=protected-access
  remove = standard.delete

  def delete(step: int) -> None:
    key = _step_path(standard, step)
    try:
      remove(step)
    except BaseException:
      _done(key, deleter, stopped=True)  # the thread stops at its first error
      raise
    _done(key, deleter, elsewhere=not _removes_here(standard))

  standard.delete = delete
  _TRACKED.add(deleter)


def _removes_here(standard) -> bool:
  """Whether orbax's deleter removes steps on this process (its primary host)."""
  from orbax.checkpoint._src.multihost import multihost  # pylint: disable=import-outside-toplevel

  try:
    return bool(multihost.is_primary_host(standard._primary_host))  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-exception-caught
    return True  # asked of a deleter unlike orbax's own: taken as removing here


def _done(key: str, deleter, elsewhere: bool = False, stopped: bool = False) -> None:
  with _CHANGED:
    owners = _PENDING.get(key, [])
    if deleter in owners:
      owners.remove(deleter)
      if elsewhere:
        _ELSEWHERE.add(key)
      if stopped:
        _STOPPED.add(key)
    if not owners:
      _PENDING.pop(key, None)
    _CHANGED.notify_all()


def _let_go_of_stopped() -> None:
  """Lets go of the steps of deleters whose thread stopped (with ``_CHANGED`` held):
  none of them will be removed; their paths are kept for ``stopped_at``."""
  for key, owners in list(_PENDING.items()):
    dead = [d for d in owners if not _alive(d)]
    if dead:
      _STOPPED.add(key)
      owners[:] = [d for d in owners if _alive(d)]
      if not owners:
        del _PENDING[key]


def _queued(deleter, step: int) -> str | None:
  """Records ``step`` as queued by ``deleter``; the key it is recorded at."""
  try:
    with _CHANGED:  # one wrapper per deleter, whichever threads queue at once
      if deleter not in _TRACKED:
        _track(deleter)
    key = _step_path(deleter._standard_deleter, step)  # pylint: disable=protected-access
  except (AttributeError, TypeError, ValueError):
    return None  # a deleter unlike orbax's own: its steps are not waited for
  with _CHANGED:
    _let_go_of_stopped()
    _STOPPED.discard(key)
    _PENDING.setdefault(key, []).append(deleter)
    elsewhere = list(_ELSEWHERE)
  # Steps another process removed are let go once their directory is gone, whether
  # or not this process saves their number again (looked at outside the lock).
  gone = [k for k in elsewhere if not os.path.lexists(k)]
  with _CHANGED:
    _ELSEWHERE.difference_update(gone)
  return key


def wait_for(path, timeout_s: float) -> bool:
  """Waits until no step queued at ``path`` is left to remove, up to ``timeout_s``
  seconds: one a live deleter of this process has queued, or one another process
  removes whose directory is still there. Whether one still is."""
  key = _key(path)
  deadline = time.monotonic() + timeout_s
  while True:
    with _CHANGED:
      _let_go_of_stopped()
      here, elsewhere = key in _PENDING, key in _ELSEWHERE
    # The file system is asked outside the lock: a slow one holds no deleter up.
    if elsewhere and not os.path.lexists(key):
      with _CHANGED:
        _ELSEWHERE.discard(key)
      elsewhere = False
    if not here and not elsewhere:
      return False
    left = deadline - time.monotonic()
    if left <= 0:
      # Waited for once: a later save of the step finds it as it is, at once.
      with _CHANGED:
        _ELSEWHERE.discard(key)
      return True
    with _CHANGED:
      _CHANGED.wait(min(left, _POLL_S))


def stopped_at(path) -> bool:
  """Whether a deleter of this process whose thread stopped had a step queued at
  ``path`` (it will not remove it)."""
  key = _key(path)
  with _CHANGED:
    _let_go_of_stopped()
    return key in _STOPPED


def _install() -> None:
  """Has orbax's background deleter record each step it queues (it queues a step
  number, which a save cannot see). An orbax without that deleter is left as it is."""
  try:
    from orbax.checkpoint._src.path import deleter as deleter_lib  # pylint: disable=import-outside-toplevel

    cls = deleter_lib.ThreadedCheckpointDeleter
    queue = cls.delete
  except (ImportError, AttributeError):
    return
  if getattr(queue, "_jaxreshard_records", False):
    return

  def delete(self, step: int) -> None:
    key = _queued(self, step)
    try:
      queue(self, step)
    except BaseException:
      if key is not None:
        _done(key, self)
      raise

  delete._jaxreshard_records = True  # pylint: disable=protected-access
  delete.__doc__ = queue.__doc__
  cls.delete = delete


_install()

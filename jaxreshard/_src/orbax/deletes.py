"""The steps this process's orbax background deleters have yet to remove.

With ``CheckpointManagerOptions(enable_background_delete=True)`` a manager's
``delete(step)`` (and its removal of a step past ``max_to_keep``) only queues the
step number; a thread removes the step later, finding its directory when it gets
to it (orbax's ``find_step_path``, which prefers an uncommitted directory of the
step: a new save's temporary one). A save of that step number meanwhile finds the
old step committed at its path, and a save that went on would have its own
directory, or the step it committed, removed by that thread.

So a save of a step through ``DurableRenameTemporaryPath`` first waits until this
process's deleters have removed every step queued at its path (or their thread
has stopped), and only then looks at what is committed there. Each queued step is
recorded here by its path as orbax queues it, and let go when the deleter's thread
is done with it, removed or not.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

__all__ = ["pending_at", "wait_for"]

# The path of each queued step, with the deleter that queued it (once per queue).
_PENDING: dict[str, list] = {}
# The deleters whose thread lets go of the steps it is done with (``_track``).
_TRACKED: weakref.WeakSet = weakref.WeakSet()
_CHANGED = threading.Condition()
# How often a wait looks at whether a deleter's thread has stopped (it stops at
# its first error, with the steps after it still queued).
_POLL_S = 0.05


def _key(path) -> str:
  return os.path.abspath(os.fspath(path))


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
    try:
      remove(step)
    finally:
      _done(_step_path(standard, step), deleter)

  standard.delete = delete
  _TRACKED.add(deleter)


def _done(key: str, deleter) -> None:
  with _CHANGED:
    owners = _PENDING.get(key, [])
    if deleter in owners:
      owners.remove(deleter)
    if not owners:
      _PENDING.pop(key, None)
    _CHANGED.notify_all()


def _queued(deleter, step: int) -> str | None:
  """Records ``step`` as queued by ``deleter``; the key it is recorded at."""
  try:
    if deleter not in _TRACKED:
      _track(deleter)
    key = _step_path(deleter._standard_deleter, step)  # pylint: disable=protected-access
  except (AttributeError, TypeError, ValueError):
    return None  # a deleter unlike orbax's own: its steps are not waited for
  with _CHANGED:
    _PENDING.setdefault(key, []).append(deleter)
  return key


def pending_at(path) -> bool:
  """Whether a live deleter of this process has yet to remove a step queued at ``path``."""
  with _CHANGED:
    return any(_alive(d) for d in _PENDING.get(_key(path), ()))


def wait_for(path, timeout_s: float) -> bool:
  """Waits until no live deleter of this process has a step queued at ``path``, up to
  ``timeout_s`` seconds; whether one still has."""
  key = _key(path)
  deadline = time.monotonic() + timeout_s
  with _CHANGED:
    while any(_alive(d) for d in _PENDING.get(key, ())):
      left = deadline - time.monotonic()
      if left <= 0:
        return True
      _CHANGED.wait(min(left, _POLL_S))
  return False


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

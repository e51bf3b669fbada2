"""Where a jaxreshard checkpoint is: a checkpoint directory, or an item of an orbax step.

jaxreshard's orbax handler writes a whole jaxreshard checkpoint (its index,
``jaxreshard.json``, and its archives) into the item directory orbax gives it:
``RUN/STEP/ITEM`` for a ``CheckpointManager`` run (``ITEM`` is ``default``
for a manager without item names). A path names a checkpoint in one of four
ways:

* the checkpoint directory itself (it holds ``jaxreshard.json``);
* an orbax step directory (named as a step, or holding orbax's step metadata):
  its one item holding a jaxreshard checkpoint, or the one ``item`` names when
  there are several; a directory of checkpoints that is neither is refused,
  naming them;
* an orbax run directory: the step ``step`` names, or the latest step (the
  largest number) that holds a jaxreshard item; a later step whose jaxreshard
  item (as orbax's step metadata records it) has lost its index, or is a link,
  is refused, never passed over for an older one (whatever ``item`` names), and
  so is a step read without ``item`` that lost one of its recorded items;
* anything else is refused, in words that say what was looked for.

A step directory is one whose name is a step number, ``30`` or, with orbax's
``step_prefix``, ``step_30``; orbax's temporary directories (a save that did
not finish) never match and are never taken.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from typing import Any

from jaxreshard._src.checkpoint import tempdir as _tempdir
from jaxreshard._src.checkpoint.index import INDEX_FILE
from jaxreshard._src.errors import ArchiveError

__all__ = ["Located", "enclosing", "locate", "orbax_steps"]

_STEP_NAME = re.compile(r"(?:.*_)?([0-9]+)\Z")


@dataclasses.dataclass(frozen=True)
class Located:
  """A jaxreshard checkpoint found from a path.

  Attributes:
    path: the checkpoint directory (the one holding ``jaxreshard.json``).
    step: the orbax step taken, or None when the path was not a run directory.
    steps: every step of the run holding a jaxreshard item, ascending (empty
      when the path was not a run directory).
    item: the orbax item's name, or None when the path was the checkpoint itself.
  """

  path: str
  step: int | None = None
  steps: tuple[int, ...] = ()
  item: str | None = None

  def describe(self) -> str:
    """``step 30 (of 10, 20, 30), item 'default'``; empty for a plain checkpoint."""
    parts = []
    if self.step is not None:
      parts.append(f"step {self.step} (of {', '.join(map(str, self.steps))})")
    if self.item is not None:
      parts.append(f"item {self.item!r}")
    return ", ".join(parts)


def _is_dir(path: str) -> bool:
  return os.path.isdir(path) and not os.path.islink(path)


def _items(step_dir: str) -> list[str]:
  """The names of a step directory's items that hold a jaxreshard checkpoint, sorted."""
  try:
    names = os.listdir(step_dir)
  except OSError:
    return []
  return sorted(
    n
    for n in names
    if not _tempdir.is_temporary(n)  # an uncommitted save, whatever it already holds
    and _is_dir(os.path.join(step_dir, n))
    and _has_index(os.path.join(step_dir, n))
  )


def _is_step(path: str) -> bool:
  """Whether ``path`` is an orbax step directory: named as a step (``30``, ``step_30``)
  or holding orbax's step metadata. Any other directory that holds checkpoints (a
  user's folder of them, ``/tmp``) is not one: none of them is taken for it."""
  name = os.path.basename(os.path.normpath(path))
  return bool(_STEP_NAME.match(name)) or os.path.lexists(os.path.join(path, _STEP_METADATA))


def _has_index(path: str) -> bool:
  # Whatever is at the index's name makes a checkpoint, to be opened and refused in
  # its own words (not a regular file, a link) as the library refuses it.
  return os.path.lexists(os.path.join(path, INDEX_FILE))


def _raise_if_unreadable(where: str) -> None:
  """The OS's own error (``PermissionError``...) where ``where`` cannot be looked
  into: its index and its steps would otherwise both read as missing, and the
  refusal would send the reader after a save that did not finish."""
  for probe in (lambda: os.stat(os.path.join(where, INDEX_FILE)), lambda: os.listdir(where)):
    try:
      probe()
    except FileNotFoundError:
      pass
    except OSError as e:
      raise OSError(
        e.errno, f"{e.strerror} (looking in it for {INDEX_FILE} or orbax steps)", where
      ) from None


def orbax_steps(run_dir: os.PathLike | str) -> dict[int, str]:
  """Each step of an orbax run directory that holds a jaxreshard item: step -> its directory."""
  run_dir = os.fspath(run_dir)
  steps: dict[int, str] = {}
  try:
    names = os.listdir(run_dir)
  except OSError:
    return steps
  for name in names:
    m = _STEP_NAME.match(name)
    path = os.path.join(run_dir, name)
    if m and not _tempdir.is_temporary(name) and _is_dir(path) and _items(path):
      step = int(m.group(1))
      if step in steps:
        raise ArchiveError(
          f"{run_dir}: step {step} is in two directories ({os.path.basename(steps[step])!r}"
          f" and {name!r}); name the one to read as the path"
        )
      steps[step] = path
  return dict(sorted(steps.items()))


def _take_item(step_dir: str, item: str | None) -> str:
  items = _items(step_dir)
  lost = _lost_items(step_dir) if item is None else []
  if lost:  # the one item left is not the step's one item: the step is damaged
    raise ArchiveError(
      f"{step_dir}: orbax recorded jaxreshard item {lost[0][0]!r} in it, but {lost[0][1]}"
      " (the step is damaged); choose an item that is there with --item NAME"
    )
  if item is not None:
    if item not in items:
      raise ArchiveError(
        f"{step_dir} has no item {item!r} holding a jaxreshard checkpoint"
        f" (its jaxreshard items: {', '.join(map(repr, items)) or 'none'})"
      )
    return item
  if len(items) > 1:
    raise ArchiveError(
      f"{step_dir} holds {len(items)} jaxreshard items ({', '.join(map(repr, items))});"
      " choose one with --item NAME"
    )
  return items[0]


def locate(path: os.PathLike | str, *, step: int | None = None, item: str | None = None) -> Located:
  """The jaxreshard checkpoint a path names (see the module doc).

  Args:
    path: a checkpoint directory, an orbax step directory or an orbax run directory.
    step: the run's step to take (default: the latest); only for a run directory.
    item: the step's item to take (default: its one jaxreshard item).

  Returns:
    A ``Located``. A path that is not a directory is returned as it is, for
    ``open_checkpoint`` to refuse (``does not exist``).

  Raises:
    ArchiveError: nothing found; a step or item that is not there; a step
      directory with several jaxreshard items and no ``item``; ``step`` or
      ``item`` given for a path they do not apply to.
  """
  where = os.fspath(path)
  # The path given may be a symbolic link (``run/latest -> run/10``): it is the
  # caller's choice, as for a checkpoint directory itself. Inside it, a step or
  # an item that is a link is never taken.
  if not os.path.isdir(where) or _has_index(where):
    if step is not None or item is not None:
      given = "--step" if step is not None else "--item"
      _refuse_option(where, given, "it is a jaxreshard checkpoint itself")
    return Located(where)
  if _items(where) and _is_step(where):  # a step directory
    if step is not None:
      _refuse_option(where, "--step", "it is one orbax step's directory")
    name = _take_item(where, item)
    return Located(os.path.join(where, name), item=name)
  steps = orbax_steps(where)
  if not steps:
    _raise_if_unreadable(where)
    inside = _items(where)
    raise ArchiveError(
      f"{where} is not a jaxreshard checkpoint: it holds no {INDEX_FILE} (a save that did not"
      " finish leaves none) and no orbax steps with a jaxreshard item"
      + (
        f"; the checkpoints in it: {', '.join(map(repr, inside[:8]))}"
        f"{' and more' if len(inside) > 8 else ''} (name one as the path)"
        if inside
        else ""
      )
    )
  if step is None:
    step = max(steps)
    _refuse_later_damaged_steps(where, step)
  elif step not in steps:
    raise ArchiveError(
      f"{where} has no step {step} with a jaxreshard item (its steps: {', '.join(map(str, steps))})"
    )
  name = _take_item(steps[step], item)
  return Located(os.path.join(steps[step], name), step, tuple(steps), name)


# The file orbax writes in every step directory it commits (orbax 0.12 on).
_STEP_METADATA = "_CHECKPOINT_METADATA"
# Orbax's step metadata of a few items is a few hundred bytes; more is not read.
_STEP_METADATA_MAX_BYTES = 1 << 20
# Orbax records an item's handler as ``module.qualname``: jaxreshard's is the class of
# this name in a module of the jaxreshard package, not any class whose name ends so.
_HANDLER = "ReshardCheckpointHandler"
_ITEM_NAME = re.compile(r"(?!\.\.?\Z)[^/\x00]{1,255}\Z")


def _recorded_items(step_dir: str) -> list[str]:
  """The items orbax's metadata of a committed step records as written by jaxreshard's
  handler (``item_handlers``), whatever the step directory holds now; none when the
  metadata is missing, a link, too large or not orbax's JSON."""
  try:
    # Never through a link, never blocking on a FIFO: a regular file, checked once open.
    fd = os.open(
      os.path.join(step_dir, _STEP_METADATA), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    )
  except OSError:
    return []
  try:
    with os.fdopen(fd, "rb") as f:
      st = os.fstat(f.fileno())
      if not stat.S_ISREG(st.st_mode) or st.st_size > _STEP_METADATA_MAX_BYTES:
        return []
      meta = json.loads(f.read(_STEP_METADATA_MAX_BYTES + 1))
  except (OSError, ValueError, RecursionError):
    return []
  handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
  if not isinstance(handlers, dict):
    return []
  return sorted(
    name
    for name, handler in handlers.items()
    if isinstance(name, str)
    and isinstance(handler, str)
    and _is_ours(handler)
    and _ITEM_NAME.match(name)  # a name inside the step directory, never a path
  )


def _is_ours(handler: str) -> bool:
  """Whether orbax's record of an item's handler names jaxreshard's handler."""
  module, _, name = handler.rpartition(".")
  return name == _HANDLER and module.partition(".")[0] == "jaxreshard"


def _refuse_later_damaged_steps(run_dir: str, latest: int) -> None:
  """Refuses a run in which a step after ``latest`` (the latest step holding a
  jaxreshard item) lost the index of the jaxreshard item orbax recorded in it: that
  step is the run's latest (orbax's ``latest_step()``, whose restore refuses it),
  and reading an older one in its place would give an older state than the run's.

  Raises:
    ArchiveError: such a step, named with its item and what to do.
  """
  try:
    names = os.listdir(run_dir)
  except OSError:
    return
  for name in sorted(names):
    m = _STEP_NAME.match(name)
    path = os.path.join(run_dir, name)
    if not m or int(m.group(1)) <= latest or _tempdir.is_temporary(name):
      continue
    if os.path.islink(path):
      # Orbax's steps follow links: a linked step holding a jaxreshard item (looked at
      # through the link, never read) is the run's latest, and is not taken here.
      if os.path.isdir(path) and (_items(path) or _recorded_items(path)):
        raise ArchiveError(
          f"{run_dir}: step {int(m.group(1))} is later than step {latest}, and {path} is a"
          f" symbolic link, never read inside a run; give --step {latest} to read step"
          f" {latest}, or the link itself as the path"
        )
      continue
    if not _is_dir(path):
      continue
    lost = _lost_items(path)
    if lost:
      raise ArchiveError(
        f"{run_dir}: step {int(m.group(1))} is later than step {latest}, and orbax recorded"
        f" jaxreshard item {lost[0][0]!r} in it, but {lost[0][1]} (the step is damaged);"
        f" give --step {latest} to read step {latest}"
      )


def _lost_items(step_dir: str) -> list[tuple[str, str]]:
  """The jaxreshard items orbax recorded in a step that hold no checkpoint a reader
  takes, each with why: no index, or a link (never taken)."""
  lost = []
  for n in _recorded_items(step_dir):
    where = os.path.join(step_dir, n)
    if os.path.islink(where):
      lost.append((n, f"{where} is a symbolic link, never read"))
    elif not _has_index(where):
      lost.append((n, f"{where} holds no {INDEX_FILE}"))
  return lost


def enclosing(found: Located) -> list[tuple[str, str]]:
  """The orbax directories around a found checkpoint, each with what it is: a new
  checkpoint written below one would be taken for an item of its step, and change
  what that step or run directory names. The run directory when the checkpoint's
  directory is an item of one of its steps (a directory orbax committed: it holds
  orbax's step metadata, so ``/data/run_3/ckpt`` alone does not make ``/data`` a run
  directory); else the step directory when the checkpoint was found as one of its
  items; else none."""
  step_dir = os.path.dirname(os.path.abspath(found.path))
  run = os.path.dirname(step_dir)
  steps = {}
  if os.path.isfile(os.path.join(step_dir, _STEP_METADATA)):
    try:
      steps = orbax_steps(run)
    except (OSError, ArchiveError):
      steps = {}
  if any(os.path.realpath(d) == os.path.realpath(step_dir) for d in steps.values()):
    return [(run, "the orbax run directory of a checkpoint this command reads")]
  if found.item is not None:
    return [(step_dir, "the orbax step directory of a checkpoint this command reads")]
  return []


def _refuse_option(where: str, option: str, why: Any) -> None:
  inside = "a run directory's steps" if option == "--step" else "an orbax step's items"
  raise ArchiveError(f"{option} chooses among {inside}; {where} has none: {why}")

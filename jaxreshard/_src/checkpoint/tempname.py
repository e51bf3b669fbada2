"""The names of the temporary directories saves write into before their commit.

A save to ``NAME`` writes into the hidden sibling ``.NAME.tmp-ID-PID-HOST`` (``ID``
32 hex digits); orbax's commit renames ``NAME`` + :data:`ORBAX_TEMP_SUFFIX`. What
a name says is only read to find a checkpoint's own siblings and to show them:
whether a writer is alive is its lock's to say (``tempdir``).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from collections.abc import Iterator

from jaxreshard._src.errors import ArchiveError, ReshardError

__all__ = [
  "ORBAX_TEMP_SUFFIX",
  "TEMP_NAME",
  "host",
  "check_not_in_temporary",
  "check_not_temporary",
  "committed_path",
  "is_temporary",
  "lineage",
  "temporary_around",
  "new_name",
  "temp_stem",
  "this_host",
]

TEMP_NAME = re.compile(
  r"\.(?P<name>.+)\.tmp-[0-9a-f]{32}-(?P<pid>[0-9]+)-(?P<host>[A-Za-z0-9._-]*)\Z"
)

# A directory's name holds at most 255 bytes (Linux's NAME_MAX). A temporary
# sibling's name is the checkpoint's with ``.`` before it and, after it, ``.tmp-``,
# 32 hex digits, the process id (at most 7 digits under Linux's pid_max, 20 here)
# and the host (at most 64 bytes): a checkpoint name too long to leave room for
# them is cut in its sibling's name, a hash of the whole name after the cut, so
# that the siblings of two names never share a name and ``clean`` finds each one's.
_NAME_MAX = 255
_AROUND_NAME = 1 + len(".tmp-") + 32 + 1 + 20 + 1 + 64
_HASH_CHARS = 16


def temp_stem(name: str) -> str:
  """The checkpoint name ``name`` as its temporary siblings carry it: itself, or cut
  and followed by ``~`` and a hash of the whole when it is too long.

  Examples:
    >>> temp_stem("ckpt")
    'ckpt'
    >>> stem = temp_stem("c" * 250)
    >>> len(stem.encode()) + _AROUND_NAME <= 255, stem[:4], stem[-17]
    (True, 'cccc', '~')
  """
  raw = os.fsencode(name)
  if len(raw) + _AROUND_NAME <= _NAME_MAX:
    return name
  keep = _NAME_MAX - _AROUND_NAME - 1 - _HASH_CHARS
  digest = hashlib.sha256(raw).hexdigest()[:_HASH_CHARS]
  # Cut as bytes: a character cut in two is kept as escapes, which give back its bytes.
  return f"{os.fsdecode(raw[:keep])}~{digest}"


# Orbax's temporary directories: its commit renames ``NAME`` + this (and what it may
# add after it) to ``NAME``.
ORBAX_TEMP_SUFFIX = ".orbax-checkpoint-tmp"


def is_temporary(name: str) -> bool:
  """Whether ``name`` is a save's temporary directory (jaxreshard's or orbax's): never
  a checkpoint, a step or an item to read, whatever it holds.

  Examples:
    >>> is_temporary(".ckpt.tmp-" + "0" * 32 + "-7-host"), is_temporary("7.orbax-checkpoint-tmp")
    (True, True)
    >>> is_temporary("ckpt"), is_temporary("7")
    (False, False)
  """
  return bool(TEMP_NAME.match(name)) or ORBAX_TEMP_SUFFIX in name


def lineage(path: str) -> Iterator[str]:
  """``path`` and each directory above it, as written (made absolute) and then with
  every symbolic link resolved (a link's own name hides where it leads)."""
  for here in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
    while True:
      yield here
      parent = os.path.dirname(here)
      if parent == here:
        break
      here = parent


def temporary_around(path: str) -> str | None:
  """The name of a save's temporary directory that ``path`` is or lies in (along its
  ``lineage``), or None."""
  for here in lineage(path):
    name = os.path.basename(here)
    if name and is_temporary(name):
      return name
  return None


# A directory orbax writes a save into: its final name and this suffix, then, in
# older orbax versions, a timestamp.
_ORBAX_TEMP = re.compile(r"(?P<name>.+)" + re.escape(ORBAX_TEMP_SUFFIX) + r"(-[0-9]+)?\Z")


def committed_path(path: str) -> str:
  """Where a save writing into ``path`` commits: ``path`` with its lowest orbax
  temporary directories (a manager's ``STEP.orbax-checkpoint-tmp`` and its item's
  ``ITEM.orbax-checkpoint-tmp``, or a checkpointer's ``NAME.orbax-checkpoint-tmp``:
  at most two, one inside the other, each named exactly as orbax names them)
  named as orbax's commit names them; ``path`` itself where it lies in none. A
  directory above them with a temporary name is left as it is (and a save there
  refused).

  Examples:
    >>> committed_path("/runs/a/7.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp")
    '/runs/a/7/state'
    >>> committed_path("/runs/b.orbax-checkpoint-tmp-old/c.orbax-checkpoint-tmp")
    '/runs/b.orbax-checkpoint-tmp-old/c'
    >>> committed_path("/runs/a/ckpt")
    '/runs/a/ckpt'
  """
  parts = os.path.abspath(path).split(os.sep)
  found = [i for i, p in enumerate(parts) if _ORBAX_TEMP.match(p)]
  run = found[-2:] if len(found) > 1 and found[-2] == found[-1] - 1 else found[-1:]
  for i in run:
    parts[i] = _ORBAX_TEMP.match(parts[i])["name"]
  return os.sep.join(parts)


def check_not_temporary(final: str) -> None:
  """Refuses to save a checkpoint at ``final`` when it is, or lies in, a save's
  temporary directory (its name's, or a symbolic link's to one): ``jaxreshard
  clean`` and the next save to its base name take such a directory for a killed
  save's leftover, and remove it once nobody holds its lock; and no read opens a
  checkpoint there (``check_not_in_temporary``).

  Raises:
    ReshardError: naming the path.
  """
  if is_temporary(os.path.basename(final)):
    raise ReshardError(
      f"{final}: a checkpoint is never saved under the name of a save's temporary"
      " directory (.NAME.tmp-*, *.orbax-checkpoint-tmp*), which jaxreshard clean and"
      " later saves remove as a killed save's leftover; choose another name"
    )
  name = temporary_around(final)
  if name is not None:
    raise ReshardError(
      f"{final}: it lies in {name!r}, a save's temporary directory by its name"
      " (.NAME.tmp-*, *.orbax-checkpoint-tmp*): a checkpoint saved there would never"
      " be read, and jaxreshard clean and later saves remove such a directory as a"
      " killed save's leftover; choose another path"
    )


def check_not_in_temporary(path: str) -> None:
  """Refuses to read a checkpoint at ``path`` when it, or a directory above it, is a
  save's temporary directory, named as such or through a symbolic link: a save
  still writing it, or the leftover of a save that was killed before its commit
  (which may hold a complete-looking index).

  Raises:
    ArchiveError: naming the path and the committed name to read instead.
  """
  name = temporary_around(path)
  if name is not None:
    raise ArchiveError(
      f"{path}: {name!r} is a save's temporary directory (.NAME.tmp-*,"
      " *.orbax-checkpoint-tmp*), never a checkpoint to read: a save still writing"
      " it, or the leftover of one killed before its commit; read the committed"
      " checkpoint instead (jaxreshard clean removes leftovers nobody holds)"
    )


def new_name(base: str) -> str:
  """A new temporary sibling's name for a save to the checkpoint named ``base``."""
  return f".{temp_stem(base)}.tmp-{uuid.uuid4().hex}-{os.getpid()}-{host()}"


def host() -> str:
  """This host's name as temporary names carry it (what a directory name may hold)."""
  return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]


def this_host(path: str) -> bool:
  """Whether the temporary directory ``path`` was named by a process of this host."""
  m = TEMP_NAME.match(os.path.basename(path))
  return bool(m) and m["host"] == host()

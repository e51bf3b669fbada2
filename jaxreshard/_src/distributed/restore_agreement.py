"""The processes of a restore onto devices of several processes read one checkpoint.

Each process reads the ranks (or the shards) of its own devices and makes its part
of global arrays; no byte passes between processes. Processes that opened two
checkpoints (a step number read at two moments, a stale copy of the run directory
on one host) would make arrays whose parts are of two saves, and a clock that
differs between processes. So before any byte is read, every process whose devices
the restore places on tells the others, through the ``jax.distributed`` key-value
store, the identity of the state it opened (or why it could not open one), and
every process compares: one identity, or an error in every process.

The processes meet under the set of them and how many such restores each made
before: every process restores onto those devices in the same order, as it calls
any collective.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.errors import ArchiveError, PlacementError

__all__ = ["devices_of_target", "opened_everywhere", "processes_of"]

_KEY = "jaxreshard/restore"
# A process that is not at the restore by then (it failed before it, or hangs) is
# named; the others fail instead of waiting for good.
TIMEOUT_S = 600.0
_POLL_S = 0.02
_COUNTS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


def processes_of(devices: Iterable[Any]) -> tuple[int, ...]:
  """The processes whose devices are among ``devices``, sorted."""
  return tuple(sorted({d.process_index for d in devices}))


def devices_of_target(target: Any) -> Iterable[Any]:
  """The devices a target's leaves are laid out on (leaves without a sharding, which
  the restore refuses later, add none)."""
  for leaf in jax.tree.leaves(target):
    yield from getattr(getattr(leaf, "sharding", None), "device_set", ())


def _client(processes: tuple[int, ...]) -> Any:
  """The ``jax.distributed`` client, where the restore spans several processes."""
  if len(processes) < 2 or jax.process_count() < 2:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return distributed.global_state.client


def _text(words: str) -> str:
  """``words`` as the key-value store takes them (UTF-8, a lone surrogate escaped)."""
  return words.encode("utf-8", "backslashreplace").decode("utf-8")[:2000]


def opened_everywhere(
  processes: tuple[int, ...], open_it: Callable[[], Any], directory: Any
) -> Any:
  """``open_it()`` (the checkpoint), once every one of ``processes`` opened one of the
  same state.

  Raises:
    PlacementError: another process opened a checkpoint of another state.
    ArchiveError: another process could not open its checkpoint (its error), or
      was not at this restore within ``TIMEOUT_S``.
    whatever ``open_it`` raises, in this process (the others are told).
  """
  client = _client(processes)
  if client is None:
    return open_it()
  with _LOCK:
    n = _COUNTS[processes]
    _COUNTS[processes] += 1
  prefix = f"{_KEY}/{'-'.join(map(str, processes))}/{n}/"
  me = jax.process_index()
  try:
    ckpt = open_it()
  except BaseException as e:
    try:  # the others stop waiting for this process
      client.key_value_set(prefix + str(me), _text(f"failed: {type(e).__name__}: {e}"))
    except Exception:  # pylint: disable=broad-exception-caught
      pass
    raise
  mine = {"state": _reader.state_id(ckpt), "path": str(directory)}
  client.key_value_set(prefix + str(me), "ok " + _text(json.dumps(mine)))
  others = set(processes) - {me}
  deadline = time.monotonic() + TIMEOUT_S
  while True:
    told = {}
    for key, value in client.key_value_dir_get(prefix):
      tail = key.rsplit("/", 1)[-1]
      if tail.isdigit() and int(tail) in others:
        told[int(tail)] = value
    for p in sorted(told):
      if told[p].startswith("failed: "):
        raise ArchiveError(
          f"{directory}: process {p} of this restore could not open its checkpoint"
          f" ({told[p][len('failed: ') :]})"
        )
      theirs = json.loads(told[p][len("ok ") :])
      if theirs["state"] != mine["state"]:
        raise PlacementError(
          f"the processes of this restore opened checkpoints of two saves: process {me}"
          f" {mine['path']} (checkpoint {mine['state']}), process {p} {theirs['path']}"
          f" (checkpoint {theirs['state']}); every process restores the same checkpoint"
        )
    if len(told) == len(others):
      return ckpt
    if time.monotonic() > deadline:
      waiting = sorted(others - set(told))
      raise ArchiveError(
        f"{directory}: processes {waiting} did not come to this restore within {TIMEOUT_S:g} s"
      )
    time.sleep(_POLL_S)

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
# named; the others fail instead of waiting for good. Long: a slow peer (still
# loading its data) is waited for, as a collective waits.
TIMEOUT_S = 1800.0
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

  Every process sets its word (the state it opened, or why it could not); the
  first of ``processes`` reads every other's as it comes and sets the verdict,
  which the others wait for: a number of requests to the store linear in the
  processes, each answered when its key is set.

  Raises:
    PlacementError: processes opened checkpoints of two states.
    ArchiveError: another process could not open its checkpoint (its error), or a
      process was not at this restore within ``TIMEOUT_S``.
    whatever ``open_it`` raises, in this process (the others are told).
  """
  client = _client(processes)
  if client is None:
    return open_it()
  with _LOCK:
    n = _COUNTS[processes]
    _COUNTS[processes] += 1
  prefix = f"{_KEY}/{'-'.join(map(str, processes))}/{n}/"
  me, leader = jax.process_index(), processes[0]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    ckpt = open_it()
  except BaseException as e:
    word = _text(f"failed: {type(e).__name__}: {e}")
    try:  # the others stop waiting for this process
      client.key_value_set(prefix + str(me), word)
      if me == leader:
        client.key_value_set(prefix + "verdict", _verdict({me: word}, directory))
    except Exception:  # pylint: disable=broad-exception-caught
      pass
    raise
  word = "ok " + _text(json.dumps({"state": _reader.state_id(ckpt), "path": str(directory)}))
  client.key_value_set(prefix + str(me), word)
  if me == leader:
    words = {me: word}
    for p in processes[1:]:
      words[p] = _get(client, prefix + str(p), deadline, directory, [p])
      if words[p].startswith("failed: "):
        break  # named at once; the others need not be waited for
    verdict = _verdict(words, directory)
    client.key_value_set(prefix + "verdict", verdict)
  else:
    verdict = _get(client, prefix + "verdict", deadline, directory, [leader])
  if verdict != "ok":
    cls, _, words = verdict.partition(": ")
    raise (PlacementError if cls == "PlacementError" else ArchiveError)(words)
  return ckpt


def _get(client: Any, key: str, deadline: float, directory: Any, who: list[int]) -> str:
  """The value of ``key`` once set; an ArchiveError naming ``who`` past ``deadline``."""
  left_ms = max(1, int((deadline - time.monotonic()) * 1000))
  try:
    return client.blocking_key_value_get(key, left_ms)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if "DEADLINE_EXCEEDED" not in str(e) and time.monotonic() < deadline:
      raise
    raise ArchiveError(
      f"{directory}: processes {who} did not come to this restore within {TIMEOUT_S:g} s"
    ) from None


def _verdict(words: dict[int, str], directory: Any) -> str:
  """The restore's verdict from the processes' words: "ok", or a refusal as
  ``Class: words``."""
  for p, word in sorted(words.items()):
    if word.startswith("failed: "):
      why = word[len("failed: ") :]
      return (
        f"ArchiveError: {directory}: process {p} of this restore could not open its"
        f" checkpoint ({why})"
      )
  opened = {p: json.loads(word[len("ok ") :]) for p, word in words.items()}
  first = min(opened)
  for p in sorted(opened):
    if opened[p]["state"] != opened[first]["state"]:
      a, b = opened[first], opened[p]
      return (
        "PlacementError: the processes of this restore opened checkpoints of two saves:"
        f" process {first} {a['path']} (checkpoint {a['state']}), process {p} {b['path']}"
        f" (checkpoint {b['state']}); every process restores the same checkpoint"
      )
  return "ok"

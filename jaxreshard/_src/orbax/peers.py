"""The processes of one multi-process save tell each other whether it starts, and when their
archives are written.

Through the ``jax.distributed`` key-value store. Before a save starts, each
process looks on its own whether it may (``agree_to_start``): another job's save
may commit the directory between two processes' looks, and a process that
refused alone would leave the others waiting for it. Each process's commit future
sets its key once its archives are written (or why they are not), then waits
for every other process's key. A process that failed is named as soon as it
tells; one that hangs or died is waited for until the handler's timeout, as
orbax's barrier would. Without a ``jax.distributed`` client (one process)
there is nothing to tell or wait for.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxreshard._src.distributed import kvstore as _kv
from jaxreshard._src.errors import (
  ArchiveError,
  ArchiveExistsError,
  DtypeError,
  PlacementError,
  ReshardError,
  ShapeError,
)

__all__ = ["agree_to_start", "await_peers", "failure_told", "forget", "tell_peers"]

_PEERS_KEY = "jaxreshard/save"
_POLL_S = 0.2
_START_KEY = "jaxreshard/start"
_START_POLL_S = 0.02
_VERDICT = "verdict"  # the key, beside the processes' words, of a save's one verdict
# The n-th agreement of each process on a checkpoint's name (its directory's last
# two components, symbolic links resolved: a step's ``100/opt`` is not ``200/opt``,
# and a host may mount the storage at another path above them) is the same save's:
# every process saves a name in the same order. A process that misses a save fails
# only that save (``agree_to_start`` moves it past it); a save of another name still
# meets the others' save of it.
_STARTS: collections.Counter = collections.Counter()
_STARTS_LOCK = threading.Lock()
# The refusals a process tells the others, by name (the library's, and a missing
# parent directory); any other is an ArchiveError.
_REFUSALS = {
  cls.__name__: cls
  for cls in (FileNotFoundError, ReshardError, PlacementError, ShapeError, DtypeError)
  + (ArchiveError, ArchiveExistsError)
}


def tell_peers(checkpoint_id: str, error: BaseException | None) -> None:
  """Tells the other processes of this save that this one's archives are written, or why not."""
  client = _kv.client()
  if client is None:
    return
  value = "ok" if error is None else _kv.text(f"failed: {type(error).__name__}: {error}")[:2000]
  try:
    client.key_value_set(f"{_PEERS_KEY}/{checkpoint_id}/{jax.process_index()}", value)
  except Exception:  # pylint: disable=broad-exception-caught
    pass  # the others then wait for this process until their timeout, as orbax would


def await_peers(
  checkpoint_id: str, directory: str, timeout_s: float, stopped: Callable[[], str | None]
) -> None:
  """Returns when every process of this save told that its archives are written.

  Raises:
    ArchiveError: a process told that its write failed (naming it and its
      error), not every process told within ``timeout_s``, or ``stopped()``
      said why this process's save is over meanwhile (its words follow the
      directory's).
  """
  client = _kv.client()
  if client is None:
    return
  prefix = f"{_PEERS_KEY}/{checkpoint_id}/"
  others = set(range(jax.process_count())) - {jax.process_index()}
  deadline = time.monotonic() + timeout_s
  while True:
    told = {}
    for key, value in client.key_value_dir_get(prefix):
      tail = key.rsplit("/", 1)[-1]
      if tail.isdigit():
        told[int(tail)] = value
    failed = sorted(p for p in others if told.get(p, "ok") != "ok")
    if failed:
      p = failed[0]
      raise ArchiveError(
        f"{directory}: process {p} did not write its archives"
        f" ({told[p][len('failed: ') :]}); nothing is committed"
      )
    waiting = sorted(others - set(told))
    if not waiting:
      return
    why = stopped()
    if why is not None:
      raise ArchiveError(f"{directory}: {why}")
    if time.monotonic() > deadline:
      raise ArchiveError(
        f"{directory}: processes {waiting} did not finish writing their archives"
        f" within {timeout_s:g} s; nothing is committed"
      )
    time.sleep(_POLL_S)


def failure_told(checkpoint_id: str, wait_s: float) -> str | None:
  """The first other process of this save that told its write failed, and why (as
  ``await_peers`` words it), looked for during ``wait_s``; None if none did."""
  client = _kv.client()
  if client is None:
    return None
  prefix = f"{_PEERS_KEY}/{checkpoint_id}/"
  deadline = time.monotonic() + wait_s
  while True:
    for key, value in sorted(client.key_value_dir_get(prefix)):
      tail = key.rsplit("/", 1)[-1]
      if tail.isdigit() and int(tail) != jax.process_index() and value != "ok":
        return f"process {tail} did not write its archives ({value[len('failed: ') :]})"
    if time.monotonic() > deadline:
      return None
    time.sleep(_POLL_S)


def forget(checkpoint_id: str) -> None:
  """Removes the keys of a save every process told and was heard by (the primary, once)."""
  client = _kv.client()
  if client is not None:
    try:
      client.key_value_delete(f"{_PEERS_KEY}/{checkpoint_id}/")
    except Exception:  # pylint: disable=broad-exception-caught
      pass


def agree_to_start(
  refusal: BaseException | None, directory: str, timeout_s: float
) -> Callable[[], None]:
  """Returns once every process of a save told that it starts; raises in every process
  the refusal of any.

  ``refusal`` is why this process refuses the save (None: it starts). The processes
  meet under ``directory``'s name and how many saves of that name each made before
  (``_start_key``). Each process tells its word; the first process that can decide
  sets the save's one verdict (the key-value store keeps the first verdict set and
  refuses any other), and every process follows it: every word "starts", the
  lowest-numbered refusal it saw, or, past ``timeout_s``, that a process did not
  come. A process that comes later follows the verdict found; unless that verdict
  is that it did not come and another process already came to the next save of the
  name: then this process missed the save, and its save is that next one (it fails
  only the save it missed, not every later one).

  Returns:
    a function that forgets the agreement: call it once every process is past it
    (after a collective of the save).

  Raises:
    ReshardError, FileNotFoundError: the refusal, of its class (a library error,
      or a missing parent directory), its words preceded by the process that refused
      (unchanged in a single process); a refusal of any other class is an
      ArchiveError whose words name that class. ArchiveError: not every process told
      within ``timeout_s``. Every process raises the same error.
  """
  client = _kv.client()
  if client is None:
    if refusal is not None:
      raise refusal
    return lambda: None
  digest, n = _start_key(directory)
  prefix = f"{_START_KEY}/{digest}/{n}/"
  me = jax.process_index()
  word = "ok" if refusal is None else _kv.text(f"{type(refusal).__name__}:{refusal}")[:2000]
  client.key_value_set(prefix + str(me), word)
  deadline = time.monotonic() + timeout_s
  tried = False
  while True:
    told = dict((key.rsplit("/", 1)[-1], value) for key, value in client.key_value_dir_get(prefix))
    verdict = told.get(_VERDICT)
    if verdict is None:
      if tried:  # one was set, by this process or another, yet none is found
        raise ArchiveError(f"{directory}: the processes could not agree to start the save")
      verdict = _verdict(told, directory, timeout_s, time.monotonic() > deadline)
      if verdict is None:
        time.sleep(_START_POLL_S)
        continue
      try:
        client.key_value_set(prefix + _VERDICT, _kv.text(verdict))
      except Exception:  # pylint: disable=broad-exception-caught
        pass  # another process's verdict came first: it is the one read next
      tried = True
      continue
    if verdict == "ok":
      return lambda: _delete(client, prefix) if me == 0 else None
    absent, _, verdict = verdict.partition("|")
    if str(me) in absent.split(",") and _started(client, f"{_START_KEY}/{digest}/{n + 1}/"):
      # The others waited for this process until their timeout, then came to their next
      # save of the name: this process missed that save, and this one is their next.
      n = _skip(digest, n)
      prefix = f"{_START_KEY}/{digest}/{n}/"
      client.key_value_set(prefix + str(me), word)
      deadline, tried = time.monotonic() + timeout_s, False
      continue
    name, _, words = verdict.partition(":")
    raise _REFUSALS.get(name, ArchiveError)(words) from refusal


def _started(client: Any, prefix: str) -> bool:
  """Whether a process told its word in the agreement under ``prefix``."""
  return any(key.rsplit("/", 1)[-1].isdigit() for key, _ in client.key_value_dir_get(prefix))


def _skip(digest: str, n: int) -> int:
  """``n + 1``, the agreement this process's save of the name moves to once it missed the
  ``n``-th (``agree_to_start``); its next save of the name is the one after."""
  with _STARTS_LOCK:
    _STARTS[digest] = max(_STARTS[digest], n + 2)
  return n + 1


def _start_key(directory: str) -> tuple[str, int]:
  """``(digest of the name, n)``: this process's n-th save of ``directory``'s name (its
  last two components, symbolic links above them resolved)."""
  path = os.path.realpath(os.path.abspath(directory))
  name = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
  digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:24]
  with _STARTS_LOCK:
    n = _STARTS[digest]
    _STARTS[digest] = n + 1
  return digest, n


def _verdict(told: dict[str, str], directory: str, timeout_s: float, late: bool) -> str | None:
  """The verdict the words ``told`` (process number -> word) give, or None while some
  process has not told (``late``: not within ``timeout_s``, and then it did not come)."""
  words = {int(k): v for k, v in told.items() if k.isdigit()}
  refused = sorted(p for p, v in words.items() if v != "ok")
  if refused:
    name, _, why = words[refused[0]].partition(":")
    if name not in _REFUSALS:  # raised as an ArchiveError that names it
      name, why = "ArchiveError", f"{name}: {why}"
    return f"|{name}:process {refused[0]} refused the save: {why}"
  waiting = sorted(set(range(jax.process_count())) - set(words))
  if not waiting:
    return "ok"
  if not late:
    return None
  absent = ",".join(str(p) for p in waiting)  # before "|": the processes waited for in vain
  return (
    f"{absent}|ArchiveError:{directory}: processes {waiting} did not start the save within"
    f" {timeout_s:g} s; nothing was written"
  )


def _delete(client: Any, key: str) -> None:
  try:
    client.key_value_delete(key)
  except Exception:  # pylint: disable=broad-exception-caught
    pass  # a word left in the store is never read again

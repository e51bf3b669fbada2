"""The processes of one multi-process save tell each other that their archives are written.

Through the ``jax.distributed`` key-value store: each process's commit future
sets its key once its archives are written (or why they are not), then waits
for every other process's key. A process that failed is named as soon as it
tells; one that hangs or died is waited for until the handler's timeout, as
orbax's barrier would. Without a ``jax.distributed`` client (one process)
there is nothing to tell or wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from jaxreshard._src.errors import ArchiveError

__all__ = ["await_peers", "forget", "tell_peers"]

_PEERS_KEY = "jaxreshard/save"
_POLL_S = 0.2


def _distributed_client() -> Any:
  """The ``jax.distributed`` client of a multi-process job, or None."""
  if jax.process_count() < 2:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return distributed.global_state.client


def tell_peers(checkpoint_id: str, error: BaseException | None) -> None:
  """Tells the other processes of this save that this one's archives are written, or why not."""
  client = _distributed_client()
  if client is None:
    return
  value = "ok" if error is None else f"failed: {type(error).__name__}: {error}"[:2000]
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
  client = _distributed_client()
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


def forget(checkpoint_id: str) -> None:
  """Removes the keys of a save every process told and was heard by (the primary, once)."""
  client = _distributed_client()
  if client is not None:
    try:
      client.key_value_delete(f"{_PEERS_KEY}/{checkpoint_id}/")
    except Exception:  # pylint: disable=broad-exception-caught
      pass

"""Orbax's making of a save's directories, seen from the handler.

Orbax gives every save an operation id (shared by the items of a
``Composite``) and makes the save's step and item directories in threads of
its own, each telling a signal when its directories are made, before it asks
the handlers to save. A handler that refuses the save waits here until that
making is over, so that the process can end at once after the refusal.
"""

from __future__ import annotations

import asyncio
import threading
import time

import orbax.checkpoint as ocp

__all__ = ["await_directory_creation", "operation_id"]


def operation_id() -> str:
  """Orbax's id of the save being started: every item of a Composite's is the same."""
  from orbax.checkpoint._src.futures import synchronization  # pylint: disable=g-import-not-at-top

  return synchronization.OperationIdGenerator.get_current_operation_id()


# How often a refused save looks whether orbax's directory creation is over.
_CREATION_POLL_S = 0.005


async def await_directory_creation() -> None:
  """Returns once the directories orbax is making for the save being started are made, or
  their making ended without them (or orbax's coordination timeout passed).

  Orbax starts making a save's directories, in threads of its own, before it asks
  the handler's ``async_save``; each thread tells a signal of the save's contract
  when its directories are made, and the next waits for it. A save refused in
  ``async_save`` leaves them running: were the process to exit now, the
  interpreter would refuse their file operations (no executor work is taken at
  exit), a creation cut short would never tell its signal, and the thread waiting
  for it would hold the exit until orbax's coordination timeout.
  Where a signal's thread is not (or no longer) running here, it is not waited for:
  its creation failed, or runs in the primary process.
  """
  try:
    await _await_signals_of(operation_id())
  except Exception:  # pylint: disable=broad-exception-caught
    # Whatever stops the wait (orbax moved what it reads), the refusal is raised as it is.
    return


async def _await_signals_of(operation: str) -> None:
  """``await_directory_creation`` for the save of orbax operation ``operation``."""
  # pylint: disable-next=g-import-not-at-top
  from orbax.checkpoint._src.futures import future, signaling_client

  contract = future.AwaitableSignalsContract
  keys = {
    signal: contract.get_unique_awaitable_singal_key(signal, operation)
    for signal in contract.get_awaitable_signals_from_contract(operation_id=operation)
  }
  client = signaling_client.get_signaling_client()
  deadline = time.monotonic() + ocp.multihost.coordination_timeout()
  while keys and time.monotonic() < deadline:
    # The senders first: a thread that ends after telling its signal is seen to tell it.
    sending = {
      signal
      for thread in threading.enumerate()
      if isinstance(thread, future._SignalingThread)  # pylint: disable=protected-access
      and getattr(thread, "_operation_id", None) == operation
      for signal in getattr(thread, "_send_signals", ())
    }
    keys = {s: k for s, k in keys.items() if client.key_value_try_get(k) is None}
    if any(signal not in sending for signal in keys):
      return
    await asyncio.sleep(_CREATION_POLL_S)

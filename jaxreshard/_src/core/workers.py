"""The process's worker threads: one named pool each, made on first use and again after a fork.

A thread does not survive ``fork``: the child of a process that had made a pool
would hold a pool whose threads it does not have, and any work handed to it
would wait forever. So every pool is dropped in a forked child (and the lock
that guards them made anew, since a fork can happen while another thread holds
it); the child's first call makes its own pools. The parent keeps its pools.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["pool"]

_LOCK = threading.Lock()
_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """This process's pool ``name`` of ``threads`` threads (named ``jaxreshard-<name>``).

  The first call for a name fixes its thread count; later calls return that pool.

  Examples:
    >>> pool("example", 1).submit(sum, [1, 2]).result()
    3
  """
  with _LOCK:
    held = _POOLS.get(name)
    if held is None:
      held = _POOLS[name] = concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix=f"jaxreshard-{name}"
      )
    return held


def _forget_in_child() -> None:
  """In a forked child: the parent's pools have no threads here; forget them."""
  global _LOCK
  _LOCK = threading.Lock()
  _POOLS.clear()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_in_child)

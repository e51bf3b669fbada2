"""The ``jax.distributed`` key-value store, as multi-process saves and restores use it."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["client", "text"]


def client() -> Any:
  """The ``jax.distributed`` client of a multi-process job, or None."""
  if jax.process_count() < 2:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return distributed.global_state.client


def text(words: str) -> str:
  """``words`` as the key-value store takes them (UTF-8): a character that stands for
  a byte of a path that is not UTF-8 (a lone surrogate) is written escaped."""
  return words.encode("utf-8", "backslashreplace").decode("utf-8")

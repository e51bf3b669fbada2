"""Functions of the C library that the process calls directly, through ctypes."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["function"]


def function(name: str, argtypes: Sequence[Any], restype: Any) -> Callable[..., Any] | None:
  """The C library's ``name`` (errno kept for ``ctypes.get_errno``), or None where
  it cannot be called so: a platform other than 64-bit Linux, or a C library
  without it."""
  if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
    return None
  try:
    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
  except (OSError, AttributeError):
    return None
  fn.argtypes = list(argtypes)
  fn.restype = restype
  return fn

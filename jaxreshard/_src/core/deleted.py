"""Jax arrays passed after their buffers were freed, named instead of jax's bare error.

A jitted step that donates its state frees the state's buffers (so does
``Array.delete``); passing that state again makes jax raise a ``RuntimeError``
("Array has been deleted") naming only a shape. The public calls that take
records, states or params re-raise it as a ``ReshardError`` naming the argument
and the key path of the first deleted leaf, found by walking the arguments only
once the call has failed: a call that succeeds pays nothing.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from jaxreshard._src.errors import ReshardError

__all__ = ["deleted_leaf", "names_deleted", "refuse_deleted"]

_F = TypeVar("_F", bound=Callable[..., Any])
# The words of jax's error for a deleted array (``jax.Array``'s own check).
_JAX_WORDS = "has been deleted"
_calls = threading.local()


def deleted_leaf(value: Any) -> str | None:
  """The key path of the first deleted jax array among ``value``'s leaves, or None."""
  try:
    leaves = jax.tree_util.tree_leaves_with_path(value)
  except Exception:  # noqa: BLE001 -- not a tree jax can walk: nothing to name
    return None
  for path, leaf in leaves:
    # A tracer (under jit) stands for a value that is not there yet: never deleted.
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      if leaf.is_deleted():
        return jax.tree_util.keystr(path)
  return None


def _message(name: str, path: str) -> str:
  return (
    f"{name}{path} is a deleted jax array: its buffer was freed (a jitted step that"
    " donated it, or Array.delete); pass the arrays that step returned instead"
  )


def refuse_deleted(value: Any, name: str) -> None:
  """Raises a ReshardError naming the first deleted jax array among ``value``'s leaves."""
  path = deleted_leaf(value)
  if path is not None:
    raise ReshardError(_message(name, path))


def names_deleted(fn: _F) -> _F:
  """``fn``, jax's error for a deleted array among its arguments re-raised as a
  ReshardError naming the argument and the leaf (any other error as it was)."""
  signature = inspect.signature(fn)

  def first(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    try:
      arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
      return None
    for name, value in arguments.items():
      path = deleted_leaf(value)
      if path is not None:
        return name, path
    return None

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    # Only the outermost such call on this thread names an argument: the one the
    # caller passed, not one a call inside it made.
    depth = getattr(_calls, "depth", 0)
    _calls.depth = depth + 1
    try:
      return fn(*args, **kwargs)
    except RuntimeError as e:
      found = first(args, kwargs) if not depth and _JAX_WORDS in str(e) else None
      if found is None:
        raise
      raise ReshardError(_message(*found)) from e
    finally:
      _calls.depth = depth

  return wrapper  # type: ignore[return-value]

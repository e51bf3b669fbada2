"""Jax arrays passed after their buffers were freed, named instead of jax's bare error.

A jitted step that donates its state frees the state's buffers (so does
``Array.delete``); passing that state again makes jax raise a ``RuntimeError``
("Array has been deleted") naming only a shape. The public calls that take
records, states or params re-raise it as a ``ReshardError`` naming the argument
and the key path of the first deleted leaf, found by walking the arguments only
once the call has failed: a call that succeeds pays nothing. A call that consumes
a generator of records keeps the record it uses last (``Consumed``), since the
generator itself has nothing left to walk then.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import jax

from jaxreshard._src.errors import ReshardError

__all__ = ["Consumed", "deleted_leaf", "names_deleted", "naming", "refuse_deleted"]

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


class Consumed:
  """An iterator over ``iterable`` that keeps the item it gave last, and that item's
  index: a call that consumes a generator can still name that item's deleted array
  when using it fails (the items before it are gone; the one being used is the one
  that failed). Only a reference is kept: nothing is walked unless the call fails."""

  def __init__(self, iterable: Iterable[Any]):
    self._items = iter(iterable)
    self._index = -1
    self._last: Any = None

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self) -> Any:
    self._last = None
    item = next(self._items)
    self._index += 1
    self._last = item
    return item

  def deleted(self, name: str) -> tuple[str, str] | None:
    """(``name[i]``, the key path) of the last item's first deleted array, or None."""
    path = deleted_leaf(self._last) if self._index >= 0 else None
    return None if path is None else (f"{name}[{self._index}]", path)


def _first(values: Mapping[str, Any]) -> tuple[str, str] | None:
  """(argument name, key path) of the first deleted jax array among ``values``."""
  for name, value in values.items():
    if isinstance(value, Consumed):
      found = value.deleted(name)
    else:
      path = deleted_leaf(value)
      found = None if path is None else (name, path)
    if found is not None:
      return found
  return None


@contextlib.contextmanager
def _outermost(
  find: Callable[[], tuple[str, str] | None], call: str | None = None
) -> Iterator[None]:
  """jax's error for a deleted array raised inside, re-raised as a ReshardError naming
  what ``find`` finds (any other error, or one ``find`` finds nothing for, as it was).
  Only the outermost such block on this thread raises: it names the arguments the
  caller passed, and only when none of them holds the array, what a block inside it
  found among its own (``call``'s): a generator of records given to ``save_records``
  that reshards inside, whose sources are nowhere in the outer call's arguments."""
  depth = getattr(_calls, "depth", 0)
  _calls.depth = depth + 1
  try:
    yield
  except RuntimeError as e:
    if _JAX_WORDS not in str(e):
      raise
    if depth:  # inside another block: what it finds is kept, the shallowest's last
      found = find()
      if found is not None:
        _calls.inner = (
          found[0],
          f"{found[1]} (given to {call} inside the call)" if call else found[1],
        )
      raise
    found = find() or getattr(_calls, "inner", None)
    if found is None:
      raise
    raise ReshardError(_message(*found)) from e
  finally:
    _calls.depth = depth
    if not depth:
      _calls.inner = None


def naming(**values: Any) -> contextlib.AbstractContextManager[None]:
  """A block whose jax error for a deleted array names the first of ``values`` (by its
  keyword) that holds one, and its key path; a :class:`Consumed` value names the item
  it gave last (``name[i]``)."""
  return _outermost(lambda: _first(values))


def names_deleted(fn: _F) -> _F:
  """``fn``, jax's error for a deleted array among its arguments re-raised as a
  ReshardError naming the argument and the leaf (any other error as it was)."""
  signature = inspect.signature(fn)

  def first(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    try:
      arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
      return None
    return _first(arguments)

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with _outermost(lambda: first(args, kwargs), fn.__name__):
      return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]

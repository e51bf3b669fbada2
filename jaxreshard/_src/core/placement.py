"""Placement entries and explicit migrations (frozen, hashable, static)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ParamPlacement", "Migration", "SUPPORTED_DTYPES", "as_dtype", "same_migrations"]

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def as_dtype(dtype: Any) -> Any:
  """Normalizes anything numpy/jax accept as a dtype; leaves junk as-is.

  Construction never raises: validation happens where a refusal can name the
  parameter and the archive index (see ``_validate``). ``None`` stays ``None``
  (numpy would read it as float64): a placement without a dtype is refused as one.
  """
  if dtype is None:
    return None
  try:
    return np.dtype(dtype)
  except TypeError:
    return dtype


def _as_int(value: Any) -> Any:
  """An integer of any kind (numpy's too) as a Python int; a bool, a float or junk
  as-is, for validation to refuse by name."""
  if isinstance(value, bool):
    return value
  try:
    return operator.index(value)
  except TypeError:
    return value


def _as_tuple(value: Any) -> Any:
  try:
    return tuple(operator.index(v) for v in value)
  except TypeError:
    return value


def _as_sources(value: Any) -> Any:
  """Source archive indices as a tuple; anything that is not a collection of them
  (None, an int) as-is, for validation to refuse by name."""
  try:
    return tuple(value)
  except TypeError:
    return value


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
  """One parameter's entry in one archive.

  Attributes:
    param: the parameter's id: its params-pytree key path joined with ``/``.
    shape: logical shape of the full parameter.
    rank: the archive's rank for this parameter.
    world_size: number of ranks this parameter was split over.
    dtype: storage dtype of the parameter (float32, float16 or bfloat16).
    trainable: False for frozen parameters.
  """

  param: str
  shape: tuple[int, ...]
  rank: int
  world_size: int
  dtype: Any = np.dtype("float32")
  trainable: bool = True

  # Whether ``shape``, ``rank`` and ``world_size`` are of Python ints: set False,
  # on the instance, when they are not. Validation then checks their types (one
  # attribute read per placement, not a test per value).
  _integral = True

  def __post_init__(self):
    rank, world = self.rank, self.world_size
    integral = type(rank) is int and type(world) is int
    if not integral:
      rank, world = _as_int(rank), _as_int(world)
      object.__setattr__(self, "rank", rank)
      object.__setattr__(self, "world_size", world)
      integral = type(rank) is int and type(world) is int
    try:
      shape = tuple(operator.index(v) for v in self.shape)
    except TypeError:
      shape, integral = self.shape, False
    object.__setattr__(self, "shape", shape)
    object.__setattr__(self, "dtype", as_dtype(self.dtype))
    if not integral:
      object.__setattr__(self, "_integral", False)

  @classmethod
  def checked(
    cls, param: str, shape: tuple[int, ...], rank: int, world_size: int, dtype: Any, trainable: bool
  ) -> ParamPlacement:
    """A placement of values already normalised (a tuple of ints, an ``np.dtype``):
    what ``__post_init__`` would make of them, without remaking them. Building a
    target record makes one per parameter."""
    p = object.__new__(cls)
    d = p.__dict__
    d["param"], d["shape"], d["rank"], d["world_size"] = param, shape, rank, world_size
    d["dtype"], d["trainable"] = dtype, trainable
    return p


@dataclasses.dataclass(frozen=True)
class Migration:
  """An explicit migration of one parameter to one target rank.

  Attributes:
    param: the parameter's id.
    shape: its logical shape.
    rank: the target rank.
    world_size: the target world size.
    sources: indices into the archives passed to ``reshard``, one archive per
      original rank of this parameter, in any order.
  """

  param: str
  shape: tuple[int, ...]
  rank: int
  world_size: int
  sources: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "shape", _as_tuple(self.shape))
    object.__setattr__(self, "sources", _as_sources(self.sources))

  def __eq__(self, other: Any) -> Any:
    # The dataclass's own equality, and a tick of ``_EQ_CALLS``: see ``same_migrations``.
    next(_EQ_CALLS)
    if other.__class__ is not self.__class__:
      return NotImplemented
    return (self.param, self.shape, self.rank, self.world_size, self.sources) == (
      other.param,
      other.shape,
      other.rank,
      other.world_size,
      other.sources,
    )

  @classmethod
  def checked(
    cls, param: str, shape: tuple[int, ...], rank: int, world_size: int, sources: tuple[int, ...]
  ) -> Migration:
    """A migration of values already normalised (tuples of ints): what
    ``__post_init__`` would make of them, without remaking them. ``plan`` makes
    one per parameter and target rank."""
    m = object.__new__(cls)
    d = m.__dict__
    d["param"], d["shape"], d["rank"], d["world_size"], d["sources"] = (
      param,
      shape,
      rank,
      world_size,
      sources,
    )
    return m


# Ticks once per call of ``Migration.__eq__``, in any thread (``next`` of a count is atomic).
_EQ_CALLS = itertools.count()


def same_migrations(items: Any, migrations: list | tuple) -> bool:
  """Whether ``items`` is a list (or tuple) holding exactly the objects of
  ``migrations`` (a list or tuple of ``Migration``s) in order: identity of every
  item, never equality, checked in C.

  ``migrations == items`` skips each pair that is one object without calling
  anything, and calls ``__eq__`` on any other pair: the ``Migration``'s own
  (which ticks ``_EQ_CALLS``), or first, for an item of a subclass, the
  subclass's, which is ``Migration.__eq__`` too unless a subclass overrides it.
  So with no override anywhere, a comparison that is true and made no tick
  compared one object to itself at every position. A tick from another thread
  only sends the caller to the check element by element.
  """
  if type(items) is not type(migrations) or type(items) not in (list, tuple):
    return False
  if len(items) != len(migrations) or _eq_overridden():
    return False
  before = next(_EQ_CALLS)
  try:
    equal = migrations == items
  except Exception:  # an item's own ``__eq__`` raised: not one of ours
    return False
  return equal is True and next(_EQ_CALLS) == before + 1


def same_migrations_each(items: Sequence[Any], migrations: Sequence[list]) -> bool:
  """Whether ``items[i]`` holds exactly the objects of ``migrations[i]`` (lists of
  ``Migration``s) for every ``i``: :func:`same_migrations` of each pair, with the
  override check and the tick count taken once around all the comparisons."""
  if len(items) != len(migrations) or _eq_overridden():
    return False
  for a, b in zip(items, migrations):
    if type(a) is not list or type(b) is not list or len(a) != len(b):
      return False
  before = next(_EQ_CALLS)
  try:
    equal = all(map(operator.eq, migrations, items))
  except Exception:  # an item's own ``__eq__`` raised: not one of ours
    return False
  return equal and next(_EQ_CALLS) == before + 1


def _eq_overridden() -> bool:
  """Whether ``Migration.__eq__`` was replaced, or a subclass has an ``__eq__`` of its
  own (looked up the way Python finds it, through the class's MRO)."""
  own = Migration.__dict__.get("__eq__")
  if own is not _MIGRATION_EQ:
    return True
  pending = type.__subclasses__(Migration)
  while pending:
    cls = pending.pop()
    if inspect.getattr_static(cls, "__eq__", None) is not own:
      return True
    pending.extend(type.__subclasses__(cls))
  return False


_MIGRATION_EQ = Migration.__dict__["__eq__"]

"""Placement entries and explicit migrations (frozen, hashable, static)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

__all__ = ["ParamPlacement", "Migration", "SUPPORTED_DTYPES", "as_dtype"]

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def as_dtype(dtype: Any) -> Any:
  """Normalizes anything numpy/jax accept as a dtype; leaves junk as-is.

  Construction never raises: validation happens where a refusal can name the
  parameter and the archive index (see ``_validate``).
  """
  try:
    return np.dtype(dtype)
  except TypeError:
    return dtype


def _as_tuple(value: Any) -> Any:
  try:
    return tuple(operator.index(v) for v in value)
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

  def __post_init__(self):
    object.__setattr__(self, "shape", _as_tuple(self.shape))
    object.__setattr__(self, "dtype", as_dtype(self.dtype))

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
    object.__setattr__(self, "sources", tuple(self.sources))

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

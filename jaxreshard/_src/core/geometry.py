"""Flat-shard geometry: which global flat elements a rank owns.

This is the ZeRO / FSDP layout (``flatten(t).chunk(W)``, each chunk padded to the
first chunk's size): every rank stores ``slots = ceil(count / W)`` elements of
each buffer and owns ``[rank * slots, min((rank + 1) * slots, count))``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

from jaxreshard._src.errors import PlacementError

__all__ = ["FlatShard", "MAX_COUNT", "MAX_WORLD_SIZE", "check_integers", "normalize_shape"]

# Element counts and offsets must fit a signed 64-bit index.
MAX_COUNT = 2**63 - 1
# The most ranks a layout may have: far beyond any data-parallel job, and small
# enough that anything done once per rank (a plan, a line of output, a file)
# stays bounded when a world size is mistyped or comes from hostile metadata.
MAX_WORLD_SIZE = 1 << 20


def _int(value: Any, what: str) -> int:
  """``value`` as a Python int; bools and non-integers are refused by name."""
  if isinstance(value, bool):
    raise PlacementError(f"{what} must be an integer, not the bool {value!r}")
  try:
    return operator.index(value)
  except TypeError:
    raise PlacementError(
      f"{what} must be an integer, not {type(value).__name__} {value!r}"
    ) from None


def normalize_shape(shape: Sequence[int], *, what: str = "shape") -> tuple[int, ...]:
  """Returns ``shape`` as a tuple of Python ints, refusing negative dims."""
  try:
    dims = tuple(operator.index(d) for d in shape)
  except TypeError as e:
    raise PlacementError(f"{what} {shape!r} is not a sequence of integers") from e
  if any(isinstance(d, bool) for d in shape):
    raise PlacementError(f"{what} {tuple(shape)!r} has a bool where a dimension belongs")
  if any(d < 0 for d in dims):
    raise PlacementError(f"{what} {dims} has a negative dimension")
  count = math.prod(dims)
  if count > MAX_COUNT:
    raise PlacementError(
      f"{what} {dims} has {count} elements, more than a 64-bit index can address"
    )
  return dims


def check_integers(shape: Any, rank: Any, world_size: Any) -> None:
  """Refuses, in ``FlatShard``'s words, a shape, rank or world size that is not of
  integers (a bool, a float, ``None``); no range is checked here."""
  try:
    ints = all(type(d) is int for d in shape)
  except TypeError:  # not a sequence
    ints = False
  if not ints:
    normalize_shape(shape)
  _int(rank, "rank")
  _int(world_size, "world_size")


def _check_rank(rank: int, world: int) -> None:
  """A rank of a world size jaxreshard supports."""
  if world < 1:
    raise PlacementError(f"world_size {world} must be at least 1")
  if world > MAX_WORLD_SIZE:
    raise PlacementError(
      f"world_size {world} is more than the {MAX_WORLD_SIZE} ranks jaxreshard supports"
    )
  if not 0 <= rank < world:
    raise PlacementError(f"rank {rank} is outside world_size {world} (0..{world - 1})")


@dataclasses.dataclass(frozen=True)
class FlatShard:
  """The slice of a flattened parameter that one rank of a layout owns.

  Attributes:
    shape: logical shape of the parameter; ``()`` for a scalar.
    rank: this rank, ``0 <= rank < world_size``.
    world_size: number of ranks the parameter is split over.

  Raises:
    PlacementError: for ``world_size < 1``, a rank outside ``[0, world_size)``,
      a negative dimension or an element count beyond a 64-bit index.

  Examples:
    >>> g = FlatShard(shape=(3, 4), rank=1, world_size=5)
    >>> g.count, g.slots, g.start, g.stop
    (12, 3, 3, 6)
    >>> FlatShard(shape=(5,), rank=3, world_size=4).owned
    0
  """

  shape: tuple[int, ...]
  rank: int
  world_size: int

  def __post_init__(self):
    object.__setattr__(self, "shape", normalize_shape(self.shape))
    rank, world = _int(self.rank, "rank"), _int(self.world_size, "world_size")
    _check_rank(rank, world)
    object.__setattr__(self, "rank", rank)
    object.__setattr__(self, "world_size", world)
    # Derived once: planning reads these for every source of every buffer.
    count = math.prod(self.shape)
    object.__setattr__(self, "_count", count)
    object.__setattr__(self, "_slots", -(-count // world))

  @classmethod
  def of_checked_shape(
    cls, shape: tuple[int, ...], count: int, rank: int, world_size: int
  ) -> FlatShard:
    """A geometry whose ``shape`` (and its ``count``) was already checked; the rank
    and world size are checked here. Planning builds one per target parameter."""
    if type(rank) is not int or type(world_size) is not int:
      return cls(shape, rank, world_size)
    _check_rank(rank, world_size)
    g = object.__new__(cls)
    d = g.__dict__
    d["shape"], d["rank"], d["world_size"] = shape, rank, world_size
    d["_count"], d["_slots"] = count, -(-count // world_size)
    return g

  @classmethod
  def checked(cls, shape: tuple[int, ...], rank: int, world_size: int) -> FlatShard:
    """``FlatShard(shape, rank, world_size)``, memoized: geometry is a pure value, and
    planning asks for the same (shape, world size) once per target rank."""
    return _flat_shard(shape, rank, world_size)

  @property
  def count(self) -> int:
    """Elements of the logical parameter (1 for a scalar)."""
    return self._count

  @property
  def slots(self) -> int:
    """Elements every rank stores: ``ceil(count / world_size)``."""
    return self._slots

  @property
  def start(self) -> int:
    """First global flat element this rank owns (clipped to ``count``)."""
    return min(self.rank * self.slots, self.count)

  @property
  def stop(self) -> int:
    """One past the last global flat element this rank owns."""
    return min((self.rank + 1) * self.slots, self.count)

  @property
  def owned(self) -> int:
    """Number of real (non-padding) elements on this rank."""
    return self.stop - self.start


@functools.lru_cache(maxsize=1 << 16)
def _flat_shard(shape: tuple[int, ...], rank: int, world_size: int) -> FlatShard:
  return FlatShard(shape, rank, world_size)

"""``ShardRecord``: one rank's self-describing optimizer archive."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.errors import PlacementError

__all__ = ["CheckpointOf", "ShardRecord", "RECORD_VERSION", "stamped"]

# The version of a ShardRecord's in-memory layout (``ShardRecord.version``), not of
# the files on disk: that is ``_reader.FORMAT_VERSION``.
RECORD_VERSION = 1

# The fields a deferred record makes on first read, and where it keeps their maker.
_DEFERRED = ("placements", "state")
PARTS = "_parts"


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["state"],
  meta_fields=["version", "placements", "roles"],
  drop_fields=["checkpoint_id"],
)
@dataclasses.dataclass(frozen=True)
class ShardRecord:
  """One rank's archive: placements, optax state and the role of each leaf.

  Attributes:
    version: record format version; only ``1`` exists.
    placements: one entry per parameter this archive knows, sorted by param.
    state: the rank's optax state, structured as ``optimizer.init(local_params)``
      where every params leaf is replaced by its ``(slots,)`` shard.
    roles: for each leaf of ``state`` (``jax.tree.leaves`` order), the param id
      whose history buffer it is, or ``None`` for a scalar of the optimizer
      clock. Found with ``optax.tree_map_params`` when the record is made, so
      nothing downstream needs the optimizer. ``None`` (a record built by
      hand) means: infer it (0-d leaves are scalars, and so is every leaf of
      the hyper-parameters ``optax.inject_hyperparams`` keeps; others are
      histories of the listed parameter whose key path ends the leaf's path;
      where two do, a param named after a node of the state, the subtree that
      mirrors the params decides, and a state that does not say is refused:
      pass ``roles``).
    checkpoint_id: the identity of the checkpoint whose state the record holds
      (set by a restore or load: the checkpoint's own, or the first one of the
      reshards its index names; a reshard carries its sources' on), or None:
      not read from a checkpoint. Every call that combines records refuses
      records of two different ones. It is no part of the record's value:
      equality, ``repr`` and the pytree leave it out (a record rebuilt from its
      leaves, by ``jax.tree.map`` or ``jax.device_put``, has None and combines
      with any).

  A record is a pytree whose only children are the arrays of ``state``.

  A record that ``reshard`` builds on the host (or ``load_records`` reads whole)
  keeps its history buffers as one packed buffer per dtype and makes
  ``placements`` and ``state`` from them when either is first read (:meth:`deferred`): resharding many target ranks then
  costs their bytes, and a rank's per-leaf objects are made only for a reader
  that asks for them. Every read returns the same objects, and the record
  compares, prints, flattens, copies and pickles as one built eagerly.
  """

  version: int = dataclasses.field(metadata=dict(static=True))
  placements: tuple[ParamPlacement, ...] = dataclasses.field(metadata=dict(static=True))
  state: Any
  roles: tuple[str | None, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
  checkpoint_id: str | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "placements", tuple(self.placements))
    if self.roles is not None:
      object.__setattr__(self, "roles", tuple(self.roles))

  @classmethod
  def deferred(
    cls, version: int, roles: tuple[str | None, ...], parts: Any, checkpoint_id: str | None = None
  ) -> ShardRecord:
    """A record whose ``placements`` and ``state`` are ``parts.placements()`` and
    ``parts.state()``, each made when first read and kept from then on."""
    record = object.__new__(cls)
    d = record.__dict__
    d["version"], d["roles"], d[PARTS], d["checkpoint_id"] = version, roles, parts, checkpoint_id
    return record

  def __getattr__(self, name: str) -> Any:
    # Reached only when ``name`` is not set: the deferred fields of a record
    # made by ``deferred``. ``setdefault`` keeps the first one made when two
    # threads read the field at once.
    if name in _DEFERRED:
      parts = self.__dict__.get(PARTS)
      if parts is not None:
        return self.__dict__.setdefault(name, getattr(parts, name)())
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def __reduce__(self):
    # Copies and pickles hold the fields themselves, never what made them.
    return (type(self), (self.version, self.placements, self.state, self.roles, self.checkpoint_id))

  def placement(self, param: str) -> ParamPlacement | None:
    """The entry for ``param``, or None when this archive does not list it."""
    return self._placement_index.get(param)

  @functools.cached_property
  def _placement_index(self) -> dict[Any, ParamPlacement]:
    # Placements are frozen: indexed once, not per lookup; the first entry of
    # a param listed twice answers (validation refuses such a record).
    index: dict[Any, ParamPlacement] = {}
    for p in self.placements:
      index.setdefault(getattr(p, "param", None), p)
    return index

  @property
  def params(self) -> tuple[str, ...]:
    """Param ids this archive lists, in placement order."""
    return tuple(p.param for p in self.placements)


def stamped(records: list[ShardRecord], checkpoint_id: str | None) -> list[ShardRecord]:
  """``records`` (just made here: no caller holds them) as records holding the state of
  checkpoint ``checkpoint_id``: the same fields, a deferred one still deferred."""
  if checkpoint_id is None:
    return records
  out = []
  for r in records:
    parts = deferred_parts(r)
    if parts is not None and not any(name in r.__dict__ for name in _DEFERRED):
      out.append(ShardRecord.deferred(r.version, r.roles, parts, checkpoint_id))
    else:
      out.append(ShardRecord(r.version, r.placements, r.state, r.roles, checkpoint_id))
  return out


class CheckpointOf:
  """The one checkpoint whose state a set of records holds, records seen one by one:
  two records of two different checkpoints are refused (parts of two saves are
  never combined, even at the same step); records with no ``checkpoint_id`` (not
  read from a checkpoint) combine with any."""

  def __init__(self):
    self.first: tuple[int, str] | None = None  # the first archive that names one, and it

  def add(self, archive: int, record: Any) -> None:
    checkpoint = getattr(record, "checkpoint_id", None)
    if checkpoint is None:
      return
    if self.first is None:
      self.first = (archive, checkpoint)
    elif checkpoint != self.first[1]:
      raise PlacementError(
        f"archives {self.first[0]} and {archive} hold the states of two checkpoints"
        f" ({self.first[1]} and {checkpoint}): combining parts of two saves is refused"
      )

  @property
  def id(self) -> str | None:
    return None if self.first is None else self.first[1]

  @classmethod
  def of(cls, records: Any) -> str | None:
    """The one checkpoint ``records`` hold the state of (None: none read from one)."""
    seen = cls()
    for i, r in enumerate(records):
      seen.add(i, r)
    return seen.id


def deferred_parts(record: ShardRecord) -> Any:
  """What a deferred record's fields are made from (its packed buffers), or None
  for a record built with its fields."""
  return record.__dict__.get(PARTS)

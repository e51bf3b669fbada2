"""Every refusal of a migration, checked before any byte is copied.

The checks read *sources*: anything that answers, per archive index, which
placement it lists for a parameter, the parameter's history (per optimizer
subtree: a buffer with ``.shape``/``.dtype``, ``MASKED`` or None) and the class
of its optimizer clock. Archives in memory and checkpoints on disk both
answer them (``_sources``, ``_reader``), so every path refuses the same
inputs with the same words.

The source side of a group (shapes, ranks, dtypes, histories, clock) does not
depend on the target; it is checked once per (param, sources) and cached by
the sources object. Only the target geometry is checked per call.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import ids as _ids
from jaxreshard._src.core import masks as _masks
from jaxreshard._src.core import storable as _storable
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.archivecheck import check_version
from jaxreshard._src.core.clock import (
  STRUCTURE,
  ClockClasses,
  clock_difference,
  clock_key,
  clock_mismatch,
)
from jaxreshard._src.core.geometry import FlatShard, check_integers
from jaxreshard._src.core.groups import SourceFacts, SourceGroup
from jaxreshard._src.core.placement import SUPPORTED_DTYPES, Migration, ParamPlacement
from jaxreshard._src.errors import DtypeError, PlacementError, ReshardError, ShapeError

__all__ = [
  "SUPPORTED_NP_DTYPES",
  "SourceFacts",
  "SourceGroup",
  "Sources",
  "check_listed",
  "check_record",
  "listed_twice",
  "nonzero_padding",
  "check_buffer_dtype",
  "not_listed",
  "check_storage_dtype",
  "ClockClasses",
  "STRUCTURE",
  "clock_difference",
  "clock_key",
  "clock_mismatch",
  "source_facts",
]

_SUPPORTED = frozenset(np.dtype(jnp.dtype(n)) for n in SUPPORTED_DTYPES)
# The storage dtypes as numpy dtypes (a history buffer may also be float64 under x64).
SUPPORTED_NP_DTYPES = _SUPPORTED


def check_storage_dtype(dtype: Any, where: str) -> None:
  if not (isinstance(dtype, np.dtype) and dtype in _SUPPORTED):
    raise DtypeError(f"{where}: storage dtype {dtype} is not one of {', '.join(SUPPORTED_DTYPES)}")


_X64_HINT = (
  " (enable jax_enable_x64 to keep float64 exact: jax.config.update('jax_enable_x64',"
  " True), or JAX_ENABLE_X64=1 in the environment, as for the CLI)"
)


def check_buffer_dtype(dtype: Any, where: str) -> None:
  """History buffers must be floating: integer, bool and quantized state is refused."""
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise ShapeError(f"{where}: history buffer dtype {dtype!r} is not a dtype") from None
  if dtype in _SUPPORTED:
    return
  if dtype.name == "float64" and jax.config.jax_enable_x64:
    return
  hint = "" if dtype.name != "float64" else _X64_HINT
  name = dtype.name
  if not dtype.isnative:  # the same name in the other byte order
    name, hint = (
      f"{dtype.str!r} ({name}, {_ORDER[dtype.byteorder]}-endian)",
      (" in this host's byte order; convert it first (e.g. with astype)"),
    )
  raise ShapeError(
    f"{where}: history buffer dtype {name} is not a floating dtype jaxreshard copies"
    f" ({', '.join(SUPPORTED_DTYPES)}){hint}"
  )


_ORDER = {">": "big", "<": "little"}


def trainable_map(trainable: Any, ids: Sequence[str]) -> dict[str, bool]:
  """``shard_state``'s ``trainable`` (None, or param id -> bool) as a dict, checked:
  every key a param of ``ids`` and every value a bool, never read by its truth (the
  string "no" would otherwise mark a param trainable)."""
  if trainable is not None and not isinstance(trainable, Mapping):
    raise PlacementError(f"trainable must map param ids to bools, got {type(trainable).__name__}")
  trainable = dict(trainable or {})
  unknown = sorted(set(trainable) - set(ids))
  if unknown:
    raise PlacementError(f"params {unknown}: named in `trainable` but not in params")
  bad = sorted(pid for pid, v in trainable.items() if not isinstance(v, (bool, np.bool_)))
  if bad:
    v = trainable[bad[0]]
    raise PlacementError(
      f"params {bad}: `trainable` maps a param to a bool, got {type(v).__name__} {v!r}"
    )
  return {pid: bool(v) for pid, v in trainable.items()}


def check_record(
  index: int, record: Any
) -> tuple[_structure.StateParts, dict[str, ParamPlacement]]:
  """One archive on its own: its type, version, placements and histories.

  Returns:
    Its state parts and its placements by param id.
  """
  check_version(index, record)
  placements: dict[str, ParamPlacement] = {}
  for p in record.placements:
    if not isinstance(p, ParamPlacement):
      raise PlacementError(f"archive {index}: placement {p!r} is not a ParamPlacement")
    if p.param in placements:
      raise listed_twice(p.param, index)
    _ids.check_length(p.param, f"archive {index}")
    if not isinstance(p.trainable, (bool, np.bool_)):
      raise PlacementError(
        f"param {p.param!r}: archive {index} marks it trainable={p.trainable!r}, not a bool"
      )
    if not p._integral:
      try:
        check_integers(p.shape, p.rank, p.world_size)
      except PlacementError as e:
        raise PlacementError(f"param {p.param!r}: archive {index}: {e}") from None
    placements[p.param] = p
  try:
    state_parts = _structure.state_parts(record.state, _structure.roles_of(record), placements)
  except _structure.StatePartsError as e:
    raise PlacementError(f"archive {index}: {e}") from None
  except _storable.UnstorableTree as e:  # memory takes no tree that a save refuses
    raise ReshardError(f"archive {index}: {e}") from None
  check_listed(index, state_parts, placements)
  _clock.check_storable(index, state_parts)
  return state_parts, placements


def listed_twice(pid: str, archive: int) -> PlacementError:
  """An archive lists a param more than once."""
  return PlacementError(f"param {pid!r}: archive {archive} lists it twice")


def nonzero_padding(
  pid: str, archive: int, mirror: int, local: int, g: FlatShard, *, read: bool = False
) -> PlacementError:
  """History buffer ``mirror`` of ``pid`` in ``archive`` has nonzero bits at ``local``,
  past the ``g.owned`` elements its rank owns: a save refuses it, and so does a
  reshard that reads it (``read``), as a read from disk would."""
  why = (
    "a read of it from disk would refuse it too"
    if read
    else "a checkpoint holding it would not load"
  )
  return PlacementError(
    f"param {pid!r}: history buffer {mirror} of archive {archive}: padding is not zero"
    f" (nonzero bits at local index {local}); rank {g.rank} of shape {g.shape} over"
    f" world_size {g.world_size} owns {g.owned} of its {g.slots} slots, so the data"
    f" contradicts its placement, and {why}"
  )


def check_listed(archive: int, state_parts: _structure.StateParts, listed: Collection[str]) -> None:
  """Every param an archive holds a history for is one it lists; a ``MaskedNode``
  standing for a subtree stands for listed params (``masks``' rule)."""
  _masks.check_places(archive, state_parts, listed)


class Sources(Protocol):
  """What validation reads of a list of source archives."""

  def __len__(self) -> int: ...
  def placement(self, archive: int, pid: str) -> ParamPlacement | None: ...
  def history(self, archive: int, pid: str) -> tuple[Any, ...]: ...
  def clock_class(self, archive: int) -> int: ...


# A spelling with more than this many ``/`` is only tried as one key and as
# separate keys, not in every grouping (2^k of them).
_MAX_GROUPED_SEPARATORS = 10


def _spellings(pid: str) -> Iterable[str]:
  """The ids ``pid`` may have been meant as, read as a key path written unescaped.

  ``pid`` is unescaped in full, then split at every ``/`` and its pieces
  grouped into keys in each way (``dense/b`` is the keys ``dense``, ``b`` or
  the one key ``dense/b``: the ids ``dense/b`` and ``dense%2Fb``).
  """
  pieces = "/".join(_ids.split_id(pid)).split("/")
  gaps = len(pieces) - 1
  masks = range(2**gaps) if gaps <= _MAX_GROUPED_SEPARATORS else (0, 2**gaps - 1)
  for mask in masks:  # bit j set: gap j separates two keys
    keys, key = [], pieces[0]
    for j, piece in enumerate(pieces[1:]):
      if mask >> j & 1:
        keys.append(key)
        key = piece
      else:
        key = f"{key}/{piece}"
    keys.append(key)
    candidate = "/".join(_ids.escape(k) for k in keys)
    if candidate != pid:
      yield candidate


def not_listed(pid: str, archive: int, src: Sources) -> PlacementError:
  """The refusal of a source archive that does not list ``pid``.

  When the archive lists the same key path spelled with its escaping (a
  ``/`` inside a key is ``%2F``, a ``%`` is ``%25``), the refusal says which.
  """
  hint = ""
  for candidate in _spellings(pid) if isinstance(pid, str) else ():
    if src.placement(archive, candidate) is not None:
      hint = f"; did you mean {candidate!r}? (a / inside a key is written %2F, a % is %25)"
      break
  return PlacementError(f"param {pid!r}: source archive {archive} does not list it{hint}")


def check_flat_buffer(h: Any, source: FlatShard, where: str) -> None:
  """A history buffer is a ``(slots,)`` vector of its flat layout, of a dtype copied."""
  if tuple(np.shape(h)) != (source.slots,):
    raise ShapeError(
      f"{where} has shape {tuple(np.shape(h))}, not ({source.slots},) of its flat"
      f" layout (count {source.count}, world_size {source.world_size}); non-coordinate"
      " optimizer state (factored or matrix statistics) cannot be resharded"
    )
  check_buffer_dtype(h.dtype, where)


def _is_buffer(h: Any) -> bool:
  return h is not None and h is not _structure.MASKED


def _pattern(hist: Sequence[Any]) -> tuple[Any, ...]:
  return tuple(True if _is_buffer(h) else h for h in hist)


def source_facts(pid: str, sources: tuple[int, ...], src: Sources) -> SourceFacts:
  """Checks one parameter's source group, one rule at a time, naming the culprit.

  Raises:
    PlacementError: a source that does not list the parameter, disagreeing
      shapes, world sizes, dtypes, trainability or histories, an incomplete
      group, a repeated rank, or different optimizer clocks.
    ShapeError: a history buffer of the wrong shape or precision.
  """
  entries: list[tuple[int, ParamPlacement]] = []
  for s in sources:
    p = src.placement(s, pid)
    if p is None:
      raise not_listed(pid, s, src)
    entries.append((s, p))
  first_index, first = entries[0]
  for s, p in entries:
    if p.shape != first.shape:
      raise PlacementError(
        f"param {pid!r}: archive {s} has logical shape {p.shape} but archive"
        f" {first_index} has {first.shape}"
      )
  for s, p in entries:
    try:
      FlatShard(p.shape, p.rank, p.world_size)
    except PlacementError as e:
      raise PlacementError(f"param {pid!r}: archive {s}: {e}") from None
  world = first.world_size
  by_rank: dict[int, int] = {}
  for s, p in entries:
    if p.world_size != world:
      raise PlacementError(
        f"param {pid!r}: archive {s} has world_size {p.world_size} but archive"
        f" {first_index} has {world}; these archives are not one group"
      )
    if p.rank in by_rank:
      raise PlacementError(
        f"param {pid!r}: archives {by_rank[p.rank]} and {s} both hold rank {p.rank}"
        f" of world_size {world}"
      )
    by_rank[p.rank] = s
  if len(by_rank) != world:
    missing = sorted(set(range(world)) - set(by_rank))
    raise PlacementError(
      f"param {pid!r}: {len(by_rank)} source archives for world_size {world};"
      f" ranks {missing} are missing (archives {list(sources)})"
    )
  for s, p in entries:
    check_storage_dtype(p.dtype, f"param {pid!r}: archive {s}")
    if p.dtype != first.dtype:
      raise DtypeError(
        f"param {pid!r}: archive {s} stores it as {p.dtype} but archive"
        f" {first_index} as {first.dtype}"
      )
    if bool(p.trainable) != bool(first.trainable):
      raise PlacementError(
        f"param {pid!r}: archive {s} has trainable={p.trainable} but archive"
        f" {first_index} has trainable={first.trainable}"
      )
  source = FlatShard(first.shape, 0, world)
  buffer_dtypes = _check_histories(pid, entries, src, source)
  clock = _check_clocks(pid, [s for s, _ in entries], src)
  return SourceFacts(
    param=pid,
    shape=first.shape,
    source=source,
    by_rank=tuple(by_rank[r] for r in range(world)),
    dtype=first.dtype,
    trainable=bool(first.trainable),
    history=_pattern(src.history(first_index, pid)),
    buffer_dtypes=buffer_dtypes,
    clock=clock,
  )


def uniform_facts(pid: str, sources: tuple[int, ...], src: Any) -> SourceFacts:
  """The facts of a group whose archives are interchangeable (see ``_sources``).

  Archive ``r`` of ``sources`` holds rank ``r``; every archive has the same
  placements, buffer shapes and dtypes, structure and clock, so the checks of
  :func:`source_facts` reduce to those of one archive.
  """
  a0 = sources[0]
  p = src.placement(a0, pid)
  if p is None:
    raise not_listed(pid, a0, src)
  check_storage_dtype(p.dtype, f"param {pid!r}: archive {a0}")
  source = FlatShard.checked(p.shape, 0, p.world_size)
  hist = src.history(a0, pid)
  dtypes = []
  for m, h in enumerate(hist):
    if not _is_buffer(h):
      dtypes.append(None)
      continue
    dtype = getattr(h, "dtype", None)
    shape = getattr(h, "shape", None)
    if (
      type(shape) is not tuple
      or shape != (source.slots,)
      or not isinstance(dtype, np.dtype)
      or dtype not in _SUPPORTED
    ):
      # The rare path: the checks again, with their words.
      check_flat_buffer(h, source, f"param {pid!r}: archive {a0}, history buffer {m}")
    dtypes.append(np.dtype(h.dtype))
  return SourceFacts(
    param=pid,
    shape=p.shape,
    source=source,
    by_rank=sources,
    dtype=p.dtype,
    trainable=bool(p.trainable),
    history=_pattern(hist),
    buffer_dtypes=tuple(dtypes),
    clock=src.clock_class(a0),
  )


def _check_histories(pid, entries, src: Sources, source: FlatShard) -> tuple[Any, ...]:
  first_index = entries[0][0]
  first_hist = src.history(first_index, pid)
  n_first = sum(map(_is_buffer, first_hist))
  pattern = _pattern(first_hist)
  for s, _ in entries:
    hist = src.history(s, pid)
    n = sum(map(_is_buffer, hist))
    if n != n_first:
      raise PlacementError(
        f"param {pid!r}: archive {s} holds {n} history buffers but archive"
        f" {first_index} holds {n_first}"
      )
    if _pattern(hist) != pattern:
      raise PlacementError(
        f"param {pid!r}: its history is present in some optimizer subtrees of"
        f" archive {s} and absent from them in archive {first_index}"
      )
  dtypes = []
  for m, h0 in enumerate(first_hist):
    if not _is_buffer(h0):
      dtypes.append(None)
      continue
    dtype0 = np.dtype(h0.dtype)
    for s, _ in entries:
      buf = src.history(s, pid)[m]
      where = f"param {pid!r}: archive {s}, history buffer {m}"
      check_flat_buffer(buf, source, where)
      if np.dtype(buf.dtype) != dtype0:
        raise ShapeError(
          f"{where} has dtype {np.dtype(buf.dtype).name} but archive {first_index}"
          f" has {dtype0.name}"
        )
    dtypes.append(dtype0)
  return tuple(dtypes)


def _check_clocks(pid: str, archives: Sequence[int], src: Any) -> int:
  ref = archives[0]
  clock = src.clock_class(ref)
  for s in archives[1:]:
    if src.clock_class(s) != clock:
      raise PlacementError(clock_mismatch(src, s, ref, pid))
  return clock


def skeleton_key(state_parts: _structure.StateParts) -> tuple[Any, ...]:
  """The optimizer state's structure, with where each mirror subtree sits."""
  return (
    state_parts.skeleton,
    tuple(
      x.index if isinstance(x, _structure.ParamsSubtreeSlot) else None
      for x in state_parts.skeleton_leaves
    ),
  )


def check_target(migration: Migration) -> FlatShard:
  """A migration's target geometry, or the refusal naming its parameter."""
  try:
    return FlatShard(migration.shape, migration.rank, migration.world_size)
  except PlacementError as e:
    raise PlacementError(f"param {migration.param!r}: invalid target placement: {e}") from None


def rank_sources(pid: str, world: int, pairs: Iterable[tuple[int, int]]) -> tuple[int, ...]:
  """The archive holding each rank ``0..world-1`` of ``pid``: a complete group.

  Args:
    pid: the parameter, for the refusal.
    world: the group's world size.
    pairs: ``(archive, rank)`` of every archive listing the parameter.

  Raises:
    PlacementError: a rank held twice, a rank outside ``world``, or a rank missing.
  """
  by_rank: dict[int, int] = {}
  for archive, rank in pairs:
    if rank in by_rank:
      raise PlacementError(
        f"param {pid!r}: archives {by_rank[rank]} and {archive} both hold rank {rank}"
      )
    by_rank[rank] = archive
  if len(by_rank) != world or any(not 0 <= r < world for r in by_rank):
    missing = (
      sorted(set(range(world)) - set(by_rank))
      if world <= len(by_rank) + 64
      else "(too many to list)"
    )
    raise PlacementError(
      f"param {pid!r}: archives {sorted(by_rank.values())[:16]} hold ranks"
      f" {sorted(by_rank)[:16]} of world_size {world}; missing ranks {missing}"
    )
  return tuple(by_rank[r] for r in range(world))


def check_source_indices(pid: str, sources: tuple[Any, ...], n_archives: int) -> None:
  if not sources:
    raise PlacementError(f"param {pid!r}: the migration names no source archives")
  for s in sources:
    if isinstance(s, (bool, np.bool_)):
      raise PlacementError(f"param {pid!r}: source archive index {s!r} is a bool, not an index")
    if not isinstance(s, (int, np.integer)):
      raise PlacementError(f"param {pid!r}: source archive index {s!r} is not an int")
    if not 0 <= s < n_archives:
      raise PlacementError(
        f"param {pid!r}: source archive index {s!r} is out of range (0..{n_archives - 1})"
      )


def check_flat_history(
  p: ParamPlacement, archive: int, m: int, shape: tuple[int, ...], slots: int
) -> None:
  """History buffer ``m`` of placement ``p`` in ``archive`` has shape ``(slots,)`` of its
  flat layout (``slots`` of ``FlatShard(p.shape, p.rank, p.world_size)``)."""
  if shape != (slots,):
    raise ShapeError(
      f"param {p.param!r}: archive {archive}, history buffer {m} has shape {shape},"
      f" not ({slots},) of its flat layout (shape {p.shape}, world_size {p.world_size})"
    )

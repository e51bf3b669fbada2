"""Every refusal of SPEC.md ("What is refused"), checked before any copy.

The checks only read their inputs. They return the facts the kernels need
(the anatomy of each archive, the source of each rank) so nothing is computed
twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxreshard import _structure
from jaxreshard._errors import DtypeError, PlacementError, ShapeError
from jaxreshard._geometry import FlatShard
from jaxreshard._placement import SUPPORTED_DTYPES, Migration, ParamPlacement
from jaxreshard._record import FORMAT_VERSION, ShardRecord

__all__ = ["SourceGroup", "check_archive", "check_buffer_dtype", "check_clocks", "check_migration"]

_BUFFER_DTYPES = ("float32", "float16", "bfloat16")


# Sets of dtype objects: hashing a dtype is cheap, its ``.name`` is not, and
# these checks run for every source buffer of every migration.
_STORAGE_SET = frozenset(np.dtype(jnp.dtype(n)) for n in SUPPORTED_DTYPES)
_BUFFER_SET = frozenset(np.dtype(jnp.dtype(n)) for n in _BUFFER_DTYPES)


def check_storage_dtype(dtype: Any, where: str) -> None:
  if not (isinstance(dtype, np.dtype) and dtype in _STORAGE_SET):
    raise DtypeError(
        f"{where}: storage dtype {dtype} is not one of {', '.join(SUPPORTED_DTYPES)}"
    )


def check_buffer_dtype(dtype: Any, where: str) -> None:
  """History buffers must be floating: integer, bool and quantized state is refused."""
  if dtype in _BUFFER_SET:
    return
  name = np.dtype(dtype).name
  if name == "float64" and jax.config.jax_enable_x64:
    return
  hint = " (enable jax_enable_x64 to keep float64 exact)" if name == "float64" else ""
  raise ShapeError(
      f"{where}: history buffer dtype {name} is not a floating dtype jaxreshard copies"
      f" ({', '.join(_BUFFER_DTYPES)}){hint}"
  )


def _params_of(record: ShardRecord, limit: int = 3) -> str:
  """``params 'a', 'b', ... (N in all)``: names a whole archive's parameters briefly."""
  ids = [getattr(p, "param", p) for p in record.placements]
  if not ids:
    return "no params listed"
  shown = ", ".join(repr(i) for i in ids[:limit])
  more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
  return f"param {shown}" if len(ids) == 1 else f"params {shown}{more}"


def check_archive(index: int, record: Any) -> _structure.Anatomy:
  """Refusals 2 and 3 for one archive; returns its anatomy."""
  if not isinstance(record, ShardRecord):
    raise PlacementError(f"archive {index}: expected a ShardRecord, got {type(record).__name__}")
  if record.version != FORMAT_VERSION:
    raise PlacementError(
        f"{_params_of(record)}: archive {index} has record version {record.version!r},"
        f" which is not supported (only version {FORMAT_VERSION} exists)"
    )
  seen = set()
  for p in record.placements:
    if not isinstance(p, ParamPlacement):
      raise PlacementError(f"archive {index}: placement {p!r} is not a ParamPlacement")
    if p.param in seen:
      raise PlacementError(f"param {p.param!r}: archive {index} lists it twice")
    seen.add(p.param)
  # A record's fields are frozen but the containers inside its state are not:
  # reuse the anatomy of an earlier call only while the state's structure and
  # every leaf object are the very same.
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  fingerprint = (treedef, tuple(map(id, leaves)))
  cached = record.__dict__.get("_anatomy_cache")
  if cached is not None and cached[0] == fingerprint:
    anatomy = cached[1]
  else:
    try:
      anatomy = _structure.anatomy(record.state, _structure.roles_of(record))
    except _structure.AnatomyError as e:
      raise PlacementError(f"archive {index}: {e}") from None
    # The cache holds the leaves, so their ids cannot be reused while it lives.
    object.__setattr__(record, "_anatomy_cache", (fingerprint, anatomy, leaves))
  for pid in sorted(anatomy.param_set() - seen):
    raise PlacementError(
        f"param {pid!r}: archive {index} holds a history for it but does not list it"
        " in its placements"
    )
  return anatomy


@dataclasses.dataclass(frozen=True)
class SourceGroup:
  """A validated migration: target geometry and one source per original rank."""

  migration: Migration
  target: FlatShard
  source: FlatShard  # geometry of rank 0 of the source layout (slots, count)
  by_rank: tuple[int, ...]  # archive index holding each original rank
  dtype: np.dtype
  trainable: bool
  history: tuple[Any, ...]  # per mirror: MASKED, None (absent) or True (a buffer)


def _history_pattern(hist: Sequence[Any]) -> tuple[Any, ...]:
  return tuple(h if h is None or h is _structure.MASKED else True for h in hist)


def check_migration(
    migration: Migration,
    archives: Sequence[ShardRecord],
    anatomies: Sequence[_structure.Anatomy],
) -> SourceGroup:
  """Refusals 5-11, 13 and 14 for one migration."""
  pid = migration.param
  if not isinstance(migration, Migration):
    raise PlacementError(f"expected a Migration, got {type(migration).__name__}")
  try:
    target = FlatShard(migration.shape, migration.rank, migration.world_size)
  except PlacementError as e:
    raise PlacementError(f"param {pid!r}: invalid target placement: {e}") from None
  sources = migration.sources
  if not sources:
    raise PlacementError(f"param {pid!r}: the migration names no source archives")
  for s in sources:
    if not isinstance(s, (int, np.integer)) or not 0 <= s < len(archives):
      raise PlacementError(
          f"param {pid!r}: source archive index {s!r} is out of range"
          f" (0..{len(archives) - 1})"
      )
  # The source side of a group does not depend on the target rank: reshard
  # of rank after rank over the same archives validates it once. A hit needs
  # the very same anatomies (so the same record objects and state leaves).
  key = ("group", pid, tuple(int(s) for s in sources))
  memo = anatomies[sources[0]].memo
  hit = memo.get(key)
  if (hit is not None and all(anatomies[s] is a for s, a in zip(sources, hit[1]))
      and hit[0].source.shape == target.shape):
    return dataclasses.replace(hit[0], migration=migration, target=target)
  group = _fast_group(migration, target, archives, anatomies)
  if group is None:
    group = _checked_group(migration, target, archives, anatomies)
  memo[key] = (group, tuple(anatomies[s] for s in sources))
  return group


def _source_facts(record: ShardRecord, anatomy: _structure.Anatomy, pid: str):
  """What must agree across one parameter's sources, memoized per archive state."""
  key = ("facts", pid)
  facts = anatomy.memo.get(key)
  if facts is None:
    p = record.placement(pid)
    if p is None:
      return None
    try:
      FlatShard(p.shape, p.rank, p.world_size)
    except PlacementError:
      return None  # the checked path words this refusal
    hist = anatomy.history(pid)
    buffers = tuple((np.shape(h), np.dtype(h.dtype)) for h in hist
                    if h is not None and h is not _structure.MASKED)
    facts = anatomy.memo[key] = (p, (p.shape, p.world_size, p.dtype, bool(p.trainable),
                                     _history_pattern(hist), buffers))
  return facts


def _fast_group(migration, target, archives, anatomies) -> Optional[SourceGroup]:
  """The common case in a few set operations per source; None means "look closer".

  Accepts only when every source agrees on every fact and every rank is held
  once; anything else goes to ``_checked_group``, which finds the culprit and
  words the refusal. Both accept exactly the same groups.
  """
  pid = migration.param
  by_rank: dict[int, int] = {}
  common = None
  for s in migration.sources:
    facts = _source_facts(archives[s], anatomies[s], pid)
    if facts is None:
      return None
    placement, agreed = facts
    if common is None:
      common = agreed
    elif agreed != common:
      return None
    if by_rank.setdefault(placement.rank, int(s)) != s:
      return None
  shape, world, dtype, trainable, pattern, buffers = common
  if (shape != target.shape or len(migration.sources) != world
      or sorted(by_rank) != list(range(world))):
    return None
  try:
    source = FlatShard(shape, 0, world)
    check_storage_dtype(dtype, "")
    for buf_shape, buf_dtype in buffers:
      check_buffer_dtype(buf_dtype, "")
      if buf_shape != (source.slots,):
        return None
  except (PlacementError, ShapeError):
    return None
  return SourceGroup(migration=migration, target=target, source=source,
                     by_rank=tuple(by_rank[r] for r in range(world)), dtype=dtype,
                     trainable=trainable, history=pattern)


def _checked_group(migration, target, archives, anatomies) -> SourceGroup:
  """Every check one at a time, so a refusal names the parameter, archive and values."""
  pid = migration.param
  sources = migration.sources
  entries: list[tuple[int, ParamPlacement]] = []
  for s in sources:
    p = archives[s].placement(pid)
    if p is None:
      raise PlacementError(f"param {pid!r}: source archive {s} does not list it")
    entries.append((int(s), p))

  first_index, first = entries[0]
  for s, p in entries:
    if p.shape != target.shape:
      raise PlacementError(
          f"param {pid!r}: archive {s} has logical shape {p.shape} but the target"
          f" has {target.shape}"
      )
  for s, p in entries:
    try:
      FlatShard(p.shape, p.rank, p.world_size)
    except PlacementError as e:
      raise PlacementError(f"param {pid!r}: archive {s}: {e}") from None
  world = first.world_size
  for s, p in entries:
    if p.world_size != world:
      raise PlacementError(
          f"param {pid!r}: archive {s} has world_size {p.world_size} but archive"
          f" {first_index} has {world}; these archives are not one group"
      )
  by_rank: dict[int, int] = {}
  for s, p in entries:
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

  histories = {s: anatomies[s].history(pid) for s, _ in entries}
  first_hist = histories[first_index]
  n_first = sum(h is not None and h is not _structure.MASKED for h in first_hist)
  for s, _ in entries:
    n = sum(h is not None and h is not _structure.MASKED for h in histories[s])
    if n != n_first:
      raise PlacementError(
          f"param {pid!r}: archive {s} holds {n} history buffers but archive"
          f" {first_index} holds {n_first}"
      )
  for s, _ in entries:
    if _history_pattern(histories[s]) != _history_pattern(first_hist):
      raise PlacementError(
          f"param {pid!r}: its history is present in some optimizer subtrees of"
          f" archive {s} and absent from them in archive {first_index}"
      )

  source = FlatShard(first.shape, 0, world)
  for m, h0 in enumerate(first_hist):
    if h0 is None or h0 is _structure.MASKED:
      continue
    dtype0 = np.dtype(h0.dtype)
    for s, _ in entries:
      buf = histories[s][m]
      where = f"param {pid!r}: archive {s}, history buffer {m}"
      if np.shape(buf) != (source.slots,):
        raise ShapeError(
            f"{where} has shape {np.shape(buf)}, not ({source.slots},) of its flat"
            f" layout (count {source.count}, world_size {world}); non-coordinate"
            " optimizer state (factored or matrix statistics) cannot be resharded"
        )
      check_buffer_dtype(buf.dtype, where)
      if np.dtype(buf.dtype) != dtype0:
        raise ShapeError(
            f"{where} has dtype {np.dtype(buf.dtype).name} but archive {first_index}"
            f" has {dtype0.name}"
        )
  return SourceGroup(
      migration=migration,
      target=target,
      source=source,
      by_rank=tuple(by_rank[r] for r in range(world)),
      dtype=first.dtype,
      trainable=bool(first.trainable),
      history=_history_pattern(first_hist),
  )


def _slots(a: _structure.Anatomy) -> tuple[Any, ...]:
  return tuple(x.index if isinstance(x, _structure.MirrorSlot) else None for x in a.skeleton_leaves)


def _plain(x: Any) -> Any:
  """A clock leaf as numpy; typed PRNG keys (``noisy_sgd``) as their key data."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def _clock_bits(a: _structure.Anatomy) -> tuple[Any, ...]:
  bits = a.memo.get("clock")
  if bits is None:
    bits = a.memo["clock"] = tuple(_scalar_bits(x) for _, x in a.scalars)
  return bits


def _scalar_bits(x: Any) -> tuple[Any, ...]:
  a = _plain(x)
  return (str(getattr(x, "dtype", a.dtype)), a.dtype.str, a.shape, a.tobytes())


def check_clocks(
    indices: Sequence[int],
    anatomies: Sequence[_structure.Anatomy],
    param: Optional[Mapping[int, str]] = None,
) -> None:
  """Refusal 12: every archive merged into one state shares one optimizer clock."""
  if not indices:
    return
  ref = indices[0]
  a0 = anatomies[ref]
  for i in indices[1:]:
    a = anatomies[i]
    name = f"param {param[i]!r}: " if param and i in param else ""
    if a.skeleton != a0.skeleton or _slots(a) != _slots(a0):
      raise PlacementError(
          f"{name}archive {i} has optimizer state structure {a.skeleton} but archive"
          f" {ref} has {a0.skeleton}; these archives are not one checkpoint"
      )
    if _clock_bits(a) == _clock_bits(a0):
      continue
    for (k, x), (_, y) in zip(a.scalars, a0.scalars):
      if _scalar_bits(x) != _scalar_bits(y):
        raise PlacementError(
            f"{name}archive {i} has optimizer scalar #{k} = {_plain(x)!r} but"
            f" archive {ref} has {_plain(y)!r}; these archives are not one checkpoint"
        )

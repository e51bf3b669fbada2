"""The public pure functions: shard_state, unshard_state, plan, reshard."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from jaxreshard import _kernels, _structure, _validate
from jaxreshard._errors import PlacementError, ShapeError
from jaxreshard._geometry import FlatShard
from jaxreshard._placement import Migration, ParamPlacement
from jaxreshard._record import FORMAT_VERSION, ShardRecord

__all__ = ["shard_state", "unshard_state", "plan", "reshard"]


def shard_state(
    optimizer: Any,
    params: Any,
    state: Any,
    world_size: int,
    *,
    trainable: Optional[Mapping[str, bool]] = None,
) -> list[ShardRecord]:
  """Splits a full optax state into per-rank flat-shard archives.

  Args:
    optimizer: the optax ``GradientTransformation`` that built ``state``; used
      only to learn which leaves mirror the params (``optax.tree_map_params``).
    params: the full params pytree (any pytree of float32/float16/bfloat16
      arrays; ids are key paths joined with ``/``).
    state: ``optimizer.init(params)`` or any later state of that optimizer.
    world_size: number of data-parallel ranks.
    trainable: optional ``param id -> bool``; parameters not named are trainable.

  Returns:
    ``world_size`` records in rank order. Record ``r`` holds rank ``r``'s
    ``(slots,)`` slice of every history buffer, zero-padded, with the scalars
    of ``state`` unchanged.

  Raises:
    PlacementError: an invalid world size, colliding ids, unknown ``trainable`` keys.
    ShapeError: a history buffer that is not shaped like its parameter
      (non-coordinate state such as Adafactor's factored statistics) or not floating.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = shard_state(opt, params, opt.init(params), world_size=2)
    >>> [r.state[0].mu["w"].shape for r in records]
    [(3,), (3,)]
  """
  FlatShard((), 0, world_size)  # validates world_size
  ids, leaves, _ = _structure.param_ids(params)
  if len(set(ids)) != len(ids):
    dup = sorted({i for i in ids if ids.count(i) > 1})
    raise PlacementError(f"params {dup}: two parameters have the same key path id")
  shapes = {pid: tuple(np.shape(x)) for pid, x in zip(ids, leaves)}
  trainable = dict(trainable or {})
  unknown = sorted(set(trainable) - set(ids))
  if unknown:
    raise PlacementError(f"params {unknown}: named in `trainable` but not in params")
  for pid, x in zip(ids, leaves):
    _validate.check_storage_dtype(np.dtype(x.dtype), f"param {pid!r}")

  try:
    roles = _structure.history_roles(optimizer, params, state)
  except (ValueError, TypeError, IndexError, KeyError) as e:
    if isinstance(e, PlacementError):
      raise
    # optax.tree_map_params cannot pair a subtree with the params when its
    # leaves are not one per parameter (SM3's per-axis lists, for example).
    raise ShapeError(
        f"params {ids[:3]}{'...' if len(ids) > 3 else ''}: the optimizer state does not"
        " mirror the params leaf for leaf (optax.tree_map_params failed:"
        f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); non-coordinate"
        " optimizer state (factored or matrix statistics) cannot be sharded flat"
    ) from e
  state_leaves, state_def = jax.tree_util.tree_flatten(state)
  if len(state_leaves) != len(roles):
    raise PlacementError("the optimizer's own description of its state does not match `state`")
  for path_leaf, pid in zip(jax.tree_util.tree_flatten_with_path(state)[0], roles):
    if pid is None:
      continue
    path, leaf = path_leaf
    where = f"param {pid!r}: history buffer at {jax.tree_util.keystr(path)}"
    if tuple(np.shape(leaf)) != shapes[pid]:
      raise ShapeError(
          f"{where} has shape {tuple(np.shape(leaf))}, not the parameter's {shapes[pid]};"
          " non-coordinate optimizer state (factored or matrix statistics) cannot be"
          " sharded flat"
      )
    _validate.check_buffer_dtype(leaf.dtype, where)

  placements_of = lambda r: tuple(sorted(
      (ParamPlacement(pid, shapes[pid], r, world_size, np.dtype(x.dtype),
                      bool(trainable.get(pid, True)))
       for pid, x in zip(ids, leaves)),
      key=lambda p: p.param,
  ))
  records = []
  for rank in range(world_size):
    outputs = []
    for leaf, pid in zip(state_leaves, roles):
      if pid is None:
        continue
      g = FlatShard(shapes[pid], rank, world_size)
      outputs.append(_kernels.Output(
          (g.slots,), np.dtype(leaf.dtype), (_kernels.Piece(leaf, g.start, g.owned),)))
    built = iter(_kernels.assemble(outputs))
    new_leaves = [leaf if pid is None else next(built) for leaf, pid in zip(state_leaves, roles)]
    records.append(ShardRecord(
        version=FORMAT_VERSION,
        placements=placements_of(rank),
        state=jax.tree_util.tree_unflatten(state_def, new_leaves),
        roles=roles,
    ))
  return records


def plan(records: Sequence[ShardRecord], world_size: int, rank: int) -> list[Migration]:
  """Explicit migrations of every parameter the archives list to one target rank.

  For each parameter, the sources are the archives that list it, checked for
  completeness (one archive per original rank). ``reshard`` itself never
  infers anything; this is the convenience that writes its input.

  Args:
    records: the source archives.
    world_size: the target world size.
    rank: the target rank.

  Returns:
    One ``Migration`` per parameter, sorted by param id.

  Raises:
    PlacementError: no archives, an invalid target, or a parameter whose
      archives do not form exactly one complete group.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> records = shard_state(opt, params, opt.init(params), world_size=4)
    >>> plan(records, world_size=3, rank=2)
    [Migration(param='w', shape=(5,), rank=2, world_size=3, sources=(0, 1, 2, 3))]
  """
  records = list(records)
  if not records:
    raise PlacementError("no archives supplied")
  FlatShard((), rank, world_size)
  migrations = []
  for pid, shape, sources in _complete_groups(records):
    try:
      FlatShard(shape, rank, world_size)
    except PlacementError as e:
      raise PlacementError(f"param {pid!r}: {e}") from None
    migrations.append(Migration(pid, shape, rank, world_size, sources))
  return migrations


def _complete_groups(records: list[Any]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
  """(param, shape, archive index of each original rank) per param, sorted.

  The grouping does not depend on the target, so planning rank after rank over
  the same archives (frozen records) groups them once.
  """
  first_record = records[0]
  memo = first_record.__dict__.get("_plan_memo") if isinstance(first_record, ShardRecord) else None
  if (memo is not None and len(memo[0]) == len(records)
      and all(a is b for a, b in zip(memo[0], records))):
    return memo[1]
  groups: dict[str, list[tuple[int, ParamPlacement]]] = {}
  for i, rec in enumerate(records):
    for p in getattr(rec, "placements", ()):
      groups.setdefault(p.param, []).append((i, p))
  out = []
  for pid in sorted(groups):
    entries = groups[pid]
    first_index, first = entries[0]
    ranks: dict[int, int] = {}
    for i, p in entries:
      if p.world_size != first.world_size or p.shape != first.shape:
        raise PlacementError(
            f"param {pid!r}: archive {i} has shape {p.shape} over world_size"
            f" {p.world_size} but archive {first_index} has {first.shape} over"
            f" {first.world_size}; pass explicit migrations to pick one group"
        )
      if p.rank in ranks:
        raise PlacementError(
            f"param {pid!r}: archives {ranks[p.rank]} and {i} both hold rank {p.rank}"
        )
      ranks[p.rank] = i
    if sorted(ranks) != list(range(first.world_size)):
      missing = sorted(set(range(first.world_size)) - set(ranks))
      raise PlacementError(
          f"param {pid!r}: archives {sorted(ranks.values())} hold ranks"
          f" {sorted(ranks)} of world_size {first.world_size}; missing ranks {missing}"
      )
    out.append((pid, first.shape, tuple(ranks[r] for r in sorted(ranks))))
  if isinstance(first_record, ShardRecord):
    object.__setattr__(first_record, "_plan_memo", (tuple(records), out))
  return out


def reshard(records: Sequence[ShardRecord], migrations: Sequence[Migration]) -> ShardRecord:
  """Builds one target rank's archive from source archives and explicit migrations.

  Args:
    records: the source archives; migrations refer to them by index.
    migrations: one per target parameter, each naming the target placement and
      the source archives that hold that parameter's complete history.

  Returns:
    A version-1 ``ShardRecord``: placements sorted by param, every history
    buffer the target rank's ``(new_slots,)`` slice of the original flat buffer
    (bit for bit, zero-padded, original dtype), scalars unchanged.

  Raises:
    PlacementError: ownership, grouping, metadata or optimizer-clock errors.
    ShapeError: buffer shapes or precision that cannot be resharded.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = shard_state(opt, params, opt.init(params), world_size=4)
    >>> target = reshard(records, plan(records, world_size=3, rank=2))
    >>> target.placements[0].rank, target.state[0].mu["w"].shape
    (2, (2,))
  """
  return _reshard(records, migrations, logical=False)


def _reshard(records, migrations, *, logical: bool) -> ShardRecord:
  records = list(records)
  if not records:
    raise PlacementError("no archives supplied")
  anatomies = [_validate.check_archive(i, r) for i, r in enumerate(records)]
  groups = validate_migrations(records, anatomies, migrations)
  requests = copy_requests(groups, anatomies, logical=logical)
  outputs = [
      _kernels.Output(r.shape, r.dtype, tuple(
          _kernels.Piece(buf, lo, hi - lo) for buf, lo, hi in r.ranges))
      for r in requests
  ]
  return build_record(groups, anatomies, requests, _kernels.assemble(outputs))


def validate_migrations(
    records: Sequence[ShardRecord],
    anatomies: Sequence[_structure.Anatomy],
    migrations: Sequence[Migration],
) -> list[_validate.SourceGroup]:
  """Refusals 4-14 for a migration list (refusals 1-3 are ``check_archive``'s).

  Returns:
    One validated group per migration, sorted by param id.
  """
  seen: dict[str, Migration] = {}
  for m in migrations:
    if m.param in seen:
      raise PlacementError(
          f"param {m.param!r}: two migrations target it (from archives"
          f" {list(seen[m.param].sources)} and {list(m.sources)}); pass one per parameter"
      )
    seen[m.param] = m
  groups = sorted(
      (_validate.check_migration(m, records, anatomies) for m in migrations),
      key=lambda g: g.migration.param,
  )
  involved: dict[int, str] = {}
  for g in groups:
    for s in g.by_rank:
      involved.setdefault(s, g.migration.param)
  _validate.check_clocks(sorted(involved), anatomies, involved)
  return groups


class CopyRequest(NamedTuple):
  """One target buffer: the source ranges it is made of, in order.

  ``ranges`` holds ``(source buffer, lo, hi)`` in the source's local flat
  elements; the buffer is whatever the archive holds (an array in memory, or a
  lazy handle on disk that the caller reads ``[lo, hi)`` of).
  """

  param: str
  mirror: int
  shape: tuple[int, ...]
  dtype: np.dtype
  ranges: tuple[tuple[Any, int, int], ...]


def copy_requests(
    groups: Sequence[_validate.SourceGroup],
    anatomies: Sequence[_structure.Anatomy],
    *,
    logical: bool = False,
) -> list[CopyRequest]:
  """For each target history buffer, the overlapping ranges of its sources."""
  requests = []
  for g in groups:
    pid = g.migration.param
    t, src = g.target, g.source
    # Only the overlapping source ranks are looked at (1 to a few of W).
    history_of = lambda r, pid=pid, g=g: anatomies[g.by_rank[r]].history(pid)
    dtypes = [np.dtype(h.dtype) if h is not None and h is not _structure.MASKED else None
              for h in history_of(0)]
    for m, present in enumerate(g.history):
      if present is not True:
        continue
      ranges = []
      if t.stop > t.start:  # only the source ranks that overlap [start, stop)
        for r in range(t.start // src.slots, (t.stop - 1) // src.slots + 1):
          lo = max(t.start, r * src.slots)
          hi = min(t.stop, (r + 1) * src.slots, src.count)
          if lo < hi:
            ranges.append((history_of(r)[m], lo - r * src.slots, hi - r * src.slots))
      shape = t.shape if logical else (t.slots,)
      requests.append(CopyRequest(pid, m, shape, dtypes[m], tuple(ranges)))
  return requests


def build_record(
    groups: Sequence[_validate.SourceGroup],
    anatomies: Sequence[_structure.Anatomy],
    requests: Sequence[CopyRequest],
    buffers: Sequence[Any],
) -> ShardRecord:
  """The target record: ``buffers[i]`` is the result of ``requests[i]``."""
  built = {(r.param, r.mirror): b for r, b in zip(requests, buffers)}
  template = anatomies[groups[0].by_rank[0]] if groups else anatomies[0]
  n_mirrors = len(template.mirrors)
  histories: dict[str, list[Any]] = {}
  role_histories: dict[str, list[Any]] = {}
  for g in groups:
    pid = g.migration.param
    histories[pid] = [built.get((pid, m), g.history[m]) for m in range(n_mirrors)]
    role_histories[pid] = [pid if g.history[m] is True else g.history[m] for m in range(n_mirrors)]
  state = _structure.build_state(template, histories)
  role_tree = _structure.build_state(
      template, role_histories, scalars=[_SCALAR] * len(template.scalars))
  roles = tuple(None if x is _SCALAR else x for x in jax.tree.leaves(role_tree))
  placements = tuple(
      ParamPlacement(g.migration.param, g.target.shape, g.target.rank, g.target.world_size,
                     g.dtype, g.trainable)
      for g in groups
  )
  return ShardRecord(version=FORMAT_VERSION, placements=placements, state=state, roles=roles)


class _ScalarRole:
  pass


_SCALAR = _ScalarRole()


def unshard_state(records: Sequence[ShardRecord]) -> Any:
  """Rebuilds the full (unsharded) optax state from a complete set of archives.

  Args:
    records: archives that together hold every rank of every parameter.

  Returns:
    The optax state structured as the original, with every history buffer in
    its parameter's logical shape and the scalars unchanged.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = shard_state(opt, params, opt.init(params), world_size=3)
    >>> unshard_state(records)[0].mu["w"].shape
    (5,)
  """
  return _reshard(records, plan(records, world_size=1, rank=0), logical=True).state

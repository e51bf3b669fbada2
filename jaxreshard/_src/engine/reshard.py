"""The public pure functions: shard_state, unshard_state, plan, reshard."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import ids as _ids
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import storable as _storable
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.gcpause import no_gc
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import Migration, ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.engine import devicefetch as _devicefetch
from jaxreshard._src.engine import padcheck as _padcheck
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.errors import DtypeError, PlacementError, ReshardError, ShapeError

__all__ = ["coordinate_roles", "shard_state", "unshard_state", "plan", "reshard", "reshard_ranks"]


@_deleted.names_deleted
def shard_state(
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  state: optax.OptState,
  world_size: int,
  *,
  trainable: Mapping[str, bool] | None = None,
) -> list[ShardRecord]:
  """Splits a full optax state into per-rank flat-shard archives.

  Args:
    optimizer: the optax ``GradientTransformation`` that built ``state``; used
      only to learn which leaves mirror the params (``optax.tree_map_params``).
    params: the full params pytree (any pytree of float32/float16/bfloat16
      arrays; ids are key paths joined with ``/``), or Flax NNX's
      ``nnx.state(model, nnx.Param)``.
    state: ``optimizer.init(params)`` or any later state of that optimizer,
      or an ``nnx.Optimizer``'s ``opt_state``.
    world_size: number of data-parallel ranks.
    trainable: optional ``param id -> bool``; parameters not named are trainable.

  Flax NNX trees are taken in their plain form, the one the archives store:
  every ``nnx.State`` a dict with the same keys (an ``nnx.List``'s integer keys
  stay integers), every ``nnx.Variable`` its value, bit for bit. Param ids
  then read ``layers/10/kernel``, and the records (and ``unshard_state`` of
  them) hold that plain tree, not the NNX containers.

  Returns:
    ``world_size`` records in rank order. Record ``r`` holds rank ``r``'s
    ``(slots,)`` slice of every history buffer, zero-padded, with the scalars
    of ``state`` unchanged.

  Raises:
    ReshardError: a state tree no checkpoint can hold (a registered custom pytree
      node, dict keys other than str, int or tuples of them, a tree nested too deep),
      named by its node's key path, as a save would refuse it.
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
  params, state = _plain.plain(params), _plain.plain(state)
  ids, leaves, shapes, roles = coordinate_roles(optimizer, params, state)
  trainable = _validate.trainable_map(trainable, ids)
  state_leaves, state_def = jax.tree_util.tree_flatten(state)

  # The full state is the one archive of a world of size 1; every rank is resharded from it.
  placements = tuple(
    sorted(
      (
        ParamPlacement(pid, shapes[pid], 0, 1, np.dtype(x.dtype), bool(trainable.get(pid, True)))
        for pid, x in zip(ids, leaves)
      ),
      key=lambda p: p.param,
    )
  )
  whole = _whole_record(state_leaves, state_def, roles, placements)
  return reshard_ranks(
    [whole], [plan([whole], world_size=world_size, rank=r) for r in range(world_size)]
  )


def coordinate_roles(
  optimizer: Any, params: Any, state: Any
) -> tuple[list[str], list[Any], dict[str, tuple[int, ...]], tuple[str | None, ...]]:
  """Checks that ``state`` can be sharded flat; returns (ids, leaves, shapes, roles).

  A state can be sharded flat when every param id is unique, every param has a
  supported storage dtype, and every history buffer (``_structure.history_roles``) is
  floating and shaped exactly like its parameter: coordinate-wise state.
  ``params`` and ``state`` may hold arrays or ``jax.ShapeDtypeStruct``s.

  Raises:
    PlacementError: colliding ids, or a state optax cannot describe.
    DtypeError: a parameter dtype other than float32/float16/bfloat16.
    ShapeError: non-coordinate state (factored or matrix statistics), or a
      history buffer that is not floating.
  """
  _check_arguments(optimizer, params)
  ids, leaves, _ = _structure.param_ids(params)
  if len(set(ids)) != len(ids):
    dup = sorted({i for i in ids if ids.count(i) > 1})
    raise PlacementError(f"params {dup}: two parameters have the same key path id")
  shapes = {pid: tuple(np.shape(x)) for pid, x in zip(ids, leaves)}
  for pid, x in zip(ids, leaves):
    _validate.check_storage_dtype(np.dtype(x.dtype), f"param {pid!r}")

  try:
    roles = _structure.history_roles(optimizer, params, state)
  except (ValueError, TypeError, IndexError, KeyError) as e:
    if isinstance(e, ReshardError):  # a refusal of the roles' own, with its words
      raise
    # optax.tree_map_params cannot pair a subtree with the params when its
    # leaves are not one per parameter (SM3's per-axis lists, for example).
    raise ShapeError(
      f"params {ids[:3]}{'...' if len(ids) > 3 else ''}: the optimizer state does not"
      " mirror the params leaf for leaf (optax.tree_map_params failed:"
      f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); state whose"
      " leaves are not one per parameter (factored or matrix statistics, per-axis"
      " lists, or params of another tree, as optax.lookahead's) cannot be sharded flat"
    ) from e
  with_path, state_def = jax.tree_util.tree_flatten_with_path(state)
  if len(with_path) != len(roles):
    raise PlacementError("the optimizer's own description of its state does not match `state`")
  for (path, leaf), pid in zip(with_path, roles):
    if pid is None:
      continue
    where = f"param {pid!r}: history buffer at {jax.tree_util.keystr(path)}"
    if tuple(np.shape(leaf)) != shapes[pid]:
      # optax.scale_by_factored_rms (adafactor's) keeps these per param, factored or not.
      factored = any(getattr(k, "name", None) in ("v_row", "v_col") for k in path)
      raise ShapeError(
        f"{where} has shape {tuple(np.shape(leaf))}, not the parameter's {shapes[pid]};"
        " non-coordinate optimizer state (factored or matrix statistics"
        f"{': adafactor keeps v_row and v_col, factored or not' if factored else ''})"
        " cannot be sharded flat"
      )
    _validate.check_buffer_dtype(leaf.dtype, where)
  # A tree or an id no checkpoint can hold, before any copy: every way in (shard_state,
  # shard_to_mesh, flat_sharded's init) takes none a save refuses. A save stores the
  # plain form (``nnx.State`` nodes as dicts).
  try:
    stored = _plain.plain(state)  # ``state`` itself when it holds no NNX node
    stored_def = state_def if stored is state else jax.tree_util.tree_structure(stored)
    _storable.check_structure(stored_def, stored)
  except _storable.UnstorableTree as e:
    raise ReshardError(str(e)) from None
  for pid in ids:
    _ids.check_length(pid, "the params")
  return ids, leaves, shapes, roles


def _check_arguments(optimizer: Any, params: Any) -> None:
  """Refuses arguments of the wrong kind by name, before anything uses them."""
  _structure.require_optimizer(optimizer, "; the arguments are (optimizer, params, state)")
  check_params(params)


def check_params(params: Any) -> None:
  """Refuses params that are not a pytree of float arrays, naming the first leaf that
  is not (a Python number, a string, an integer or PRNG key array)."""
  leaves = jax.tree_util.tree_leaves(params)
  if not leaves:
    raise PlacementError(f"params ({type(params).__name__}) holds no arrays")
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
      raise PlacementError(
        f"params{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array;"
        " params must be the model's parameter pytree"
      )
    if not jnp.issubdtype(dtype, jnp.floating):
      raise DtypeError(
        f"param {_structure.path_id(path)!r} has dtype {getattr(dtype, 'name', dtype)}: params must be"
        " the model's float parameters (were params and state swapped? the arguments are"
        " (optimizer, params, state))"
      )


def _whole_record(leaves, treedef, roles, placements) -> ShardRecord:
  """The full state as the one archive of a world of size 1 (flat history buffers)."""
  on_device = any(
    isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices())
    for x, pid in zip(leaves, roles)
    if pid is not None
  )
  flat = [
    x if pid is None else (x.reshape(-1) if on_device else np.asarray(x).reshape(-1))
    for x, pid in zip(leaves, roles)
  ]
  return ShardRecord(
    version=RECORD_VERSION,
    placements=placements,
    state=jax.tree_util.tree_unflatten(treedef, flat),
    roles=roles,
  )


@_deleted.names_deleted
def plan(records: Sequence[ShardRecord], *, world_size: int, rank: int) -> list[Migration]:
  """Explicit migrations of every parameter the archives list to one target rank.

  For each parameter, the sources are the archives that list it, checked for
  completeness (one archive per original rank). ``reshard`` itself never
  infers anything; this is the convenience that writes its input. The
  grouping is computed once per list of records: planning rank after rank
  costs time in the number of parameters only. A plan of the same records,
  world size and rank holds the same (frozen) ``Migration`` objects each
  time, so resharding it again validates nothing twice.

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
  src = _sources.record_sources(records)
  with no_gc():  # the groups: many small objects, no cycles
    groups = src.complete_groups()
  # The target rank and world size; each parameter's own geometry is checked
  # when its migration is validated.
  FlatShard((), rank, world_size)
  with no_gc():
    rank, world_size = operator.index(rank), operator.index(world_size)
    return src.plan_cache.migrations(groups, world_size, rank)


def plan_groups(groups, *, world_size: int, rank: int) -> list[Migration]:
  """Migrations of complete groups ``(param, shape, sources)`` to one target rank."""
  # The target rank and world size; each parameter's own geometry is checked
  # when its migration is validated.
  FlatShard((), rank, world_size)
  with no_gc():
    rank, world_size = operator.index(rank), operator.index(world_size)
    return [
      Migration.checked(pid, shape, rank, world_size, sources) for pid, shape, sources in groups
    ]


@_deleted.names_deleted
def reshard(
  records: Sequence[ShardRecord], migrations: Sequence[Migration], *, executor: str = "auto"
) -> ShardRecord:
  """Builds one target rank's archive from source archives and explicit migrations.

  Sources in host memory (numpy arrays, arrays of the CPU backend) are copied
  with numpy into one buffer per dtype, and the target's history buffers are
  views of it: nothing is compiled. Sources on a GPU/TPU are gathered there
  by jitted kernels whose number does not grow with the parameters.

  Args:
    records: the source archives; migrations refer to them by index.
    migrations: one per target parameter, each naming the target placement and
      the source archives that hold that parameter's complete history.
    executor: "auto" (where the bytes are), "host" or "device" (forced).

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
  return reshard_ranks(records, [migrations], executor=executor)[0]


@_deleted.names_deleted
def reshard_ranks(
  records: Sequence[ShardRecord], plans: Sequence[Sequence[Migration]], *, executor: str = "auto"
) -> list[ShardRecord]:
  """Builds several target ranks in one pass, validating the sources once.

  Args:
    records: the source archives.
    plans: one migration list per target rank (e.g. ``plan`` of each rank).
    executor: as in :func:`reshard`.

  Returns:
    One ``ShardRecord`` per migration list, in order; each equal to
    ``reshard(records, migrations)``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = shard_state(opt, params, opt.init(params), world_size=4)
    >>> targets = reshard_ranks(records, [plan(records, world_size=3, rank=r) for r in range(3)])
    >>> [t.state[0].mu["w"].shape for t in targets]
    [(2,), (2,), (2,)]
  """
  with no_gc():  # no reference cycles are made; see no_gc
    return _reshard_ranks(records, plans, executor)


def _reshard_ranks(records, plans, executor) -> list[ShardRecord]:
  src = _sources.record_sources(records)
  if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence):
    raise PlacementError(f"plans must be a list of migration lists, got {type(plans).__name__}")
  validated = _pipeline.validate_ranks(src, plans)
  # Each archive packed on a device at most once per call, by the check or the copy.
  packs = _devicefetch.Packs(src)
  fetch = _pipeline.memory_fetch(src, executor, packs)  # refuses an unknown executor first
  rows: dict = {}  # source rows the check reads as one array, which the copy reuses
  _padcheck.check(src, validated, executor, rows, packs)
  built = _pipeline.build_ranks(src, validated, executor, rows)
  if built is None:
    built = [_pipeline.build(src, groups, fetch) for groups in validated]
  return _record.stamped(built, src.checkpoint_id)


@_deleted.names_deleted
def unshard_state(records: Sequence[ShardRecord]) -> optax.OptState:
  """Rebuilds the full (unsharded) optax state from a complete set of archives.

  Args:
    records: archives that together hold every rank of every parameter.

  Returns:
    The optax state structured as the original, with every history buffer in
    its parameter's logical shape and the scalars unchanged. A state sharded
    from Flax NNX containers comes back in the plain form its records hold
    (dicts for ``nnx.State`` nodes, integer keys kept, values for Variables).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = shard_state(opt, params, opt.init(params), world_size=3)
    >>> unshard_state(records)[0].mu["w"].shape
    (5,)
  """
  src = _sources.record_sources(records)
  groups = _pipeline.validate(src, plan(records, world_size=1, rank=0))
  packs = _devicefetch.Packs(src)
  _padcheck.check(src, [groups], "auto", packs=packs)
  state = _pipeline.build(src, groups, _pipeline.memory_fetch(src, packs=packs), logical=True).state
  # A full state goes back into training: its numpy arrays become jax arrays
  # (numpy arrays would pull optax's math into numpy's own arithmetic), all in
  # one ``device_put``; ``jnp.asarray`` of a numpy array compiles a program per
  # shape and dtype (~20 ms each on XLA:CPU). A 64-bit clock scalar while x64 is
  # off stays as it is: jax would cut it to 32 bits.
  leaves, treedef = jax.tree.flatten(state)
  host = [
    i for i, x in enumerate(leaves) if isinstance(x, np.ndarray) and not _clock.stays_on_host(x)
  ]
  for i, x in zip(host, jax.device_put([leaves[i] for i in host])):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)

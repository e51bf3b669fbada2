"""Flat-shard records <-> global ``jax.Array``s laid out on a device mesh.

On a mesh whose axis ``axis`` has ``M`` devices, the flat-shard layout of a
parameter over ``M`` ranks *is* a 1-D global array of shape ``(M * slots,)``
sharded over ``axis``: the device at coordinate ``r`` along ``axis`` holds rank
``r``'s ``(slots,)`` buffer, and devices that differ only along the other mesh
axes hold copies. Clock scalars are replicated everywhere. This module moves
between that global form, per-rank :class:`ShardRecord`s and the full optax
state, touching only the devices this process can address.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.distributed import leafshards as _leafshards
from jaxreshard._src.distributed.shapes import placements_for, shape_of
from jaxreshard._src.engine import reshard as _reshard
from jaxreshard._src.errors import PlacementError, ShapeError

__all__ = [
  "MeshState",
  "gather_from_mesh",
  "mesh_ranks",
  "records_from_mesh",
  "records_to_mesh",
  "shard_to_mesh",
]


class MeshState(NamedTuple):
  """An optax state laid out on a mesh, and the placements of its ranks.

  Attributes:
    state: the optax state; every history leaf is a global ``(M * slots,)``
      array sharded over the mesh axis, every scalar a replicated array.
    placements: target rank -> that rank's placements (sorted by param), for
      the ranks this process addresses. ``{p.param: p for p in
      placements[r]}`` is a ``shapes`` mapping for :func:`save_sharded`.
  """

  state: Any
  placements: Mapping[int, tuple[ParamPlacement, ...]]


DEFAULT_AXIS = "fsdp"


def axis_size(mesh: Mesh, axis: str) -> int:
  """The size of mesh axis ``axis``: the flat shards' world size.

  Raises:
    PlacementError: ``axis`` is not an axis of ``mesh``, naming the mesh's
      axes; for the default axis, saying it is the default and to pass ``axis=``.
  """
  if not isinstance(mesh, Mesh):
    raise PlacementError(
      f"mesh must be a jax.sharding.Mesh (jax.make_mesh makes one), got {type(mesh).__name__}"
    )
  if axis not in mesh.axis_names:
    names = ", ".join(repr(n) for n in mesh.axis_names)
    if axis == DEFAULT_AXIS:
      raise PlacementError(
        f"mesh axis {axis!r} is not one of the mesh's axes ({names}); {axis!r} is the"
        " default of axis=: pass axis= naming the mesh axis the flat shards are split"
        f" over (one of {names})"
      )
    raise PlacementError(
      f"mesh axis {axis!r} is not one of the mesh's axes ({names}); pass axis= naming"
      " the mesh axis the flat shards are split over"
    )
  return int(mesh.shape[axis])


def mesh_ranks(mesh: Mesh, axis: str = "fsdp") -> dict[int, list[Any]]:
  """This process's addressable devices, grouped by their rank along ``axis``.

  Args:
    mesh: the device mesh.
    axis: the mesh axis the flat shards are split over.

  Returns:
    ``rank -> devices`` (mesh order) for every rank that has at least one
    device in this process; the first device of each list is where that rank
    is built.

  Examples:
    >>> import jax, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "fsdp"))
    >>> ranks = mesh_ranks(mesh, "fsdp")
    >>> sorted(ranks) == list(range(jax.device_count())), ranks[0] == [jax.devices()[0]]
    (True, True)
  """
  axis_size(mesh, axis)
  a = mesh.axis_names.index(axis)
  me = jax.process_index()
  out: dict[int, list[Any]] = {}
  for index, device in np.ndenumerate(mesh.devices):
    if device.process_index == me:
      out.setdefault(int(index[a]), []).append(device)
  return dict(sorted(out.items()))


def writer_ranks(mesh: Mesh, axis: str = "fsdp") -> list[int]:
  """Ranks whose archive this process writes: those whose first device is local.

  Every rank has exactly one writer across all processes, so no process writes
  another's files even when the other mesh axes replicate ranks across hosts.
  """
  axis_size(mesh, axis)
  a = mesh.axis_names.index(axis)
  first: dict[int, Any] = {}
  for index, device in np.ndenumerate(mesh.devices):
    first.setdefault(int(index[a]), device)
  me = jax.process_index()
  return sorted(r for r, d in first.items() if d.process_index == me)


def _check_layout(records: Mapping[int, ShardRecord]) -> tuple[Any, tuple]:
  treedef, roles = None, None
  for rank, rec in records.items():
    _archivecheck.check_is_record(rec, f"rank {rank}")
    leaves, td = jax.tree_util.tree_flatten(rec.state)
    try:
      r = _structure.roles_of(rec)
    except _structure.StatePartsError as e:
      raise PlacementError(f"rank {rank}: {e}") from None
    if treedef is None:
      treedef, roles = td, r
    elif td != treedef or r != roles:
      raise PlacementError(
        f"rank {rank}: its state is structured differently from the other ranks';"
        " these records are not one layout"
      )
  return treedef, roles


@_deleted.names_deleted
def records_to_mesh(records: Mapping[int, ShardRecord], mesh: Mesh, axis: str = "fsdp") -> Any:
  """Global state from the records of this process's ranks (see :func:`mesh_ranks`).

  A history leaf whose pieces are numpy arrays goes onto all its local devices in
  one ``jax.make_array_from_callback`` (each piece copied: the array owns its
  bits); other leaves (jax arrays, clock scalars) are put on each local device of
  their rank and assembled with ``jax.make_array_from_single_device_arrays``.

  Args:
    records: rank -> that rank's record, for every rank in ``mesh_ranks``.
    mesh: the device mesh.
    axis: the mesh axis of the flat shards; its size is the world size.

  Returns:
    The optax state with global history arrays of shape ``(M * slots,)``
    sharded over ``axis`` and replicated scalars; a scalar that is a Python
    number or of a dtype jax cannot hold (64-bit while x64 is off) is kept as
    it is (``_clock.stays_on_host``), never cut to 32 bits.

  Raises:
    PlacementError: a rank of this process without a record, records of
      different layouts, or a record that is not rank ``r`` of ``M``.
  """
  world = axis_size(mesh, axis)
  local = mesh_ranks(mesh, axis)
  missing = sorted(set(local) - set(records))
  if missing:
    raise PlacementError(f"ranks {missing} of this process have no record")
  records = {r: records[r] for r in local}
  treedef, roles = _check_layout(records)
  for r, rec in records.items():
    for p in rec.placements:
      if (p.rank, p.world_size) != (r, world):
        raise PlacementError(
          f"param {p.param!r}: the record for rank {r} holds rank {p.rank} of"
          f" world_size {p.world_size}, not rank {r} of the mesh axis's {world}"
        )
  ranks = list(records)
  leaves_of = [jax.tree_util.tree_leaves(rec.state) for rec in records.values()]
  sharded = NamedSharding(mesh, PartitionSpec(axis))
  replicated = NamedSharding(mesh, PartitionSpec())
  rank_of = {d: r for r, ds in local.items() for d in ds}
  new_leaves = []
  for i, role in enumerate(roles):
    pieces = [leaves[i] for leaves in leaves_of]  # in the order of ``ranks``
    if role is None and _clock.stays_on_host(pieces[0]):
      # A Python number, or a 64-bit value jax would cut to 32 bits while x64
      # is off: handed back as it is, as ``restore`` does.
      new_leaves.append(pieces[0])
      continue
    if role is None:
      shape, sharding = tuple(np.shape(pieces[0])), replicated
    else:
      shapes = set(map(np.shape, pieces))
      if len(shapes) > 1 or len(next(iter(shapes))) != 1:
        raise ShapeError(
          f"param {role!r}: history buffers of ranks {sorted(ranks)} have shapes"
          f" {[np.shape(x) for x in pieces]}, not one (slots,)"
        )
      shape, sharding = (world * int(next(iter(shapes))[0]),), sharded
    per_rank = dict(zip(ranks, pieces))
    first = pieces[0]
    dtype = first.dtype  # not np.dtype: typed PRNG keys have none
    if role is not None and _leafshards.held_as_is(pieces):
      made = _leafshards.put_from_host(per_rank, shape[0] // world, shape, sharding, dtype)
    else:
      arrays = []
      # A clock leaf is the caller's own array: copied, so that a step donating
      # the state made here leaves the caller's whole.
      alias = role is not None
      for device in sharding.addressable_devices_indices_map(shape):
        arrays.append(jax.device_put(per_rank[rank_of[device]], device, may_alias=alias))
      made = jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)
    new_leaves.append(made if role is not None else _clock.keep_weak(made, first))
  return jax.tree_util.tree_unflatten(treedef, new_leaves)


def _placeholder_params(state: Any, shapes: Mapping[str, Any]) -> Any:
  """Params with ids ``shapes`` (leaves: their ids), in the tree the state's mirrors hold.

  Nested dicts keyed by the ids' segments when no subtree of the state has
  exactly these ids (a state with no history at all).
  """
  found = _structure.params_in(state, list(shapes))
  if found is not None:
    return found
  ids = sorted(shapes)
  return _structure.nested(ids, {pid: pid for pid in ids})


def optimizer_roles(
  optimizer: Any, state: Any, shapes: Mapping[str, Any]
) -> tuple[str | None, ...]:
  """Per-leaf roles of a state of ``optimizer`` over params with ids ``shapes``."""
  _structure.require_optimizer(optimizer)
  if not isinstance(shapes, Mapping) or not all(type(k) is str for k in shapes):
    raise PlacementError(
      f"shapes must map each param id (a str) to its shape, got {type(shapes).__name__}"
      + (" with keys that are not all str" if isinstance(shapes, Mapping) else "")
    )
  try:
    roles = _structure.history_roles(optimizer, _placeholder_params(state, shapes), state)
  except (ValueError, TypeError) as e:
    raise PlacementError(
      f"the optimizer's state does not mirror params with ids {sorted(shapes)}: {e}"
    ) from None
  unknown = sorted({r for r in roles if r is not None} - set(shapes))
  if unknown:
    raise PlacementError(f"params {unknown}: histories in the state but not in `shapes`")
  return roles


def records_from_mesh(
  optimizer: Any,
  state: Any,
  shapes: Mapping[str, Any],
  mesh: Mesh,
  axis: str = "fsdp",
  ranks: Sequence[int] | None = None,
  *,
  roles: tuple[str | None, ...] | None = None,
) -> dict[int, ShardRecord]:
  """The records of this process's ranks, read from a global state's local shards.

  Args:
    optimizer: the optax transformation whose state this is (says which
      leaves are histories).
    state: the global state (as returned by :func:`shard_to_mesh` or
      :func:`restore_sharded`).
    shapes: param id -> logical shape, or a placement / array with ``.shape``.
    mesh: the device mesh.
    axis: the mesh axis of the flat shards.
    ranks: which ranks (default: every rank with a local device).
    roles: the state's ``optimizer_roles``, when the caller has them.

  Returns:
    rank -> ``ShardRecord`` holding that rank's local device buffers.
  """
  world = axis_size(mesh, axis)
  if roles is None:
    roles = optimizer_roles(optimizer, state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  of = placements_for(shapes, roles, leaves, world)
  ranks = sorted(mesh_ranks(mesh, axis) if ranks is None else ranks)
  # Per history leaf, when first met: its slots and its local shards by first
  # element (a leaf's shard list is made once, not once per rank).
  local: dict[int, tuple[int, dict[int, Any]]] = {}
  clocks = _leafshards.clocks_whole(state, leaves, roles)
  out = {}
  for rank in ranks:
    rank_leaves = []
    rank_checked = False
    for i, (leaf, role) in enumerate(zip(leaves, roles)):
      if role is None:
        rank_leaves.append(clocks[i])
        continue
      found = local.get(i)
      if found is None:
        g = FlatShard(shape_of(shapes[role], role), rank, world)
        if tuple(np.shape(leaf)) != (world * g.slots,):
          raise ShapeError(
            f"param {role!r}: global history buffer of shape {tuple(np.shape(leaf))} is not"
            f" ({world} * {g.slots},) of its shape {g.shape} over mesh axis {axis!r}"
          )
        found = local[i] = (g.slots, _leafshards.shards_by_start(leaf, g.slots))
      elif not rank_checked:  # the rank itself, at its first leaf: an integer in [0, world)
        FlatShard(shape_of(shapes[role], role), rank, world)
      rank_checked = True
      slots, by_start = found
      data = by_start.get(rank * slots)
      if data is None:
        raise _leafshards.no_shard(leaf, rank, slots, role, axis)
      rank_leaves.append(data)
    out[rank] = ShardRecord(
      version=RECORD_VERSION,
      placements=of(rank),
      state=jax.tree_util.tree_unflatten(treedef, rank_leaves),
      roles=roles,
    )
  return out


@_deleted.names_deleted
def shard_to_mesh(
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  state: optax.OptState,
  mesh: Mesh,
  axis: str = "fsdp",
  *,
  trainable: Mapping[str, bool] | None = None,
) -> MeshState:
  """Lays a full (unsharded) optax state out on a mesh, flat-sharded over ``axis``.

  Every process passes the same full state; each builds only the ranks of its
  own devices, exactly as ``shard_state(..., world_size=M)`` would.

  Args:
    optimizer: the optax transformation that built ``state``.
    params: the full params pytree (ids are key paths joined with ``/``), or
      Flax NNX's ``nnx.state(model, nnx.Param)``.
    state: the full optax state, or an ``nnx.Optimizer``'s ``opt_state``
      (NNX trees are taken in plain form, as ``shard_state`` takes them).
    mesh: the device mesh.
    axis: the mesh axis to split over; its size ``M`` is the world size.
    trainable: optional ``param id -> bool``.

  Returns:
    A :class:`MeshState`: global ``(M * slots,)`` history arrays sharded over
    ``axis``, replicated scalars, and the placements of the local ranks. The
    state's tree is the plain form of ``state`` (for an NNX state: dicts and
    values, not ``nnx.State`` nodes and Variables).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> sharded = shard_to_mesh(opt, params, opt.init(params), mesh)
    >>> mu = sharded.state[0].mu["w"]
    >>> mu.sharding.spec, mu.shape[0] % jax.device_count()
    (P('fsdp',), 0)
    >>> sharded.placements[0][0].world_size == jax.device_count()
    True
  """
  world = axis_size(mesh, axis)
  whole = _reshard.shard_state(optimizer, params, state, 1, trainable=trainable)
  local = mesh_ranks(mesh, axis)
  records = {}
  for rank, devices in local.items():
    with jax.default_device(devices[0]):  # the kernels run where the rank lives
      records[rank] = _reshard.reshard(whole, _reshard.plan(whole, world_size=world, rank=rank))
  return MeshState(
    records_to_mesh(records, mesh, axis), {r: rec.placements for r, rec in records.items()}
  )


def _copied(leaf: Any) -> Any:
  """A jax array as a copy of its buffers (a transfer: nothing is compiled)."""
  return jax.device_put(leaf, may_alias=False) if isinstance(leaf, jax.Array) else leaf


@_deleted.names_deleted
def gather_from_mesh(
  optimizer: optax.GradientTransformation,
  state: optax.OptState,
  shapes: Mapping[str, Any],
  mesh: Mesh,
  axis: str = "fsdp",
) -> optax.OptState:
  """The full (unsharded) optax state of a global flat-sharded state, on every process.

  The inverse of :func:`shard_to_mesh`. In a multi-process run every process
  calls it (it all-gathers) and every process gets the whole state.

  Args:
    optimizer: the optax transformation whose state this is.
    state: the global state.
    shapes: param id -> logical shape (or anything with ``.shape``).
    mesh: the device mesh.
    axis: the mesh axis of the flat shards.

  An ``nnx.Optimizer``'s ``opt_state`` is taken in its plain form, as
  :func:`shard_to_mesh` takes it (``nnx.State`` nodes as dicts, Variables as
  their values), and the full state comes back in that form.

  Returns:
    The optax state with every history buffer in its parameter's logical shape,
    bit-identical to ``unshard_state`` of the equivalent records. Its clock
    leaves are copies: a step that donates ``state`` leaves them whole.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> sharded = shard_to_mesh(opt, params, opt.init(params), mesh)
    >>> gather_from_mesh(opt, sharded.state, {"w": (5,)}, mesh)[0].trace["w"].shape
    (5,)
  """
  world = axis_size(mesh, axis)
  state = _plain.plain(state)
  roles = optimizer_roles(optimizer, state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  of = placements_for(shapes, roles, leaves, world, recorded=False)
  host = [
    _leafshards.gather_bits(leaf) if role is not None else _copied(leaf)
    for leaf, role in zip(_leafshards.clocks_whole(state, leaves, roles), roles)
  ]
  records = []
  for rank in range(world):
    rank_leaves = []
    for leaf, role in zip(host, roles):
      if role is None:
        rank_leaves.append(leaf)
        continue
      g = FlatShard(shape_of(shapes[role], role), rank, world)
      if leaf.shape != (world * g.slots,):
        raise ShapeError(
          f"param {role!r}: global history buffer of shape {leaf.shape} is not"
          f" ({world} * {g.slots},) of its shape {g.shape} over mesh axis {axis!r}"
        )
      rank_leaves.append(leaf[rank * g.slots : (rank + 1) * g.slots])
    records.append(
      ShardRecord(
        RECORD_VERSION, of(rank), jax.tree_util.tree_unflatten(treedef, rank_leaves), roles
      )
    )
  full = jax.tree_util.tree_leaves(_reshard.unshard_state(records))
  # Assembled from host bytes, a history is strongly typed: weak where the state's was.
  return jax.tree_util.tree_unflatten(
    treedef,
    [
      _clock.keep_weak(x, like) if isinstance(x, jax.Array) else x
      for x, like in zip(full, leaves, strict=True)
    ],
  )

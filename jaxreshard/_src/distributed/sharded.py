"""Multi-host restore of flat-sharded optax state on a JAX mesh, and what a
multi-host save needs to know of the mesh (its host records and global index).

Every process calls the same function (SPMD). On restore each process builds
only the target ranks of its own devices, reading only the source archives and
chunks they overlap. The save itself (``save_sharded``) is an orbax save of the
``ReshardCheckpointHandler`` and lives with it (``_src/orbax``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import writer as _writer
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.distributed import leafshards as _leafshards
from jaxreshard._src.distributed import mesh as _mesh
from jaxreshard._src.distributed import optimizer_check as _optimizer_check
from jaxreshard._src.distributed import restore_agreement as _agreement
from jaxreshard._src.distributed import shapes as _shapes
from jaxreshard._src.distributed import target_restore as _target_restore
from jaxreshard._src.distributed.mesh import MeshState
from jaxreshard._src.errors import PlacementError, ShapeError
from jaxreshard._src.progress import ProgressCallback, check_callback

__all__ = ["global_index", "host_record", "restore_sharded", "reshard_to_mesh", "stamped_index"]


@_deleted.names_deleted
def reshard_to_mesh(records: Sequence[ShardRecord], mesh: Mesh, axis: str = "fsdp") -> MeshState:
  """In-memory source archives -> global state on ``mesh``, resharded to its axis size.

  Each process builds only the target ranks of its own devices, each with the
  core's kernels on the first device of that rank.

  Args:
    records: every source archive (a list of ``ShardRecord``, any world sizes).
    mesh: the target mesh.
    axis: the mesh axis of the flat shards; its size is the target world size.

  Returns:
    A :class:`MeshState` bit-identical, rank by rank, to ``reshard(records,
    plan(records, M, r))``.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=3)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    >>> out = reshard_to_mesh(records, mesh)
    >>> out.placements[0][0].world_size == jax.device_count()
    True
  """
  from jaxreshard._src.engine import reshard as _reshard  # pylint: disable=g-import-not-at-top

  records = list(records)
  world = _mesh.axis_size(mesh, axis)
  built = {}
  for rank, devices in _mesh.mesh_ranks(mesh, axis).items():
    with jax.default_device(devices[0]):
      built[rank] = _reshard.reshard(records, _reshard.plan(records, world_size=world, rank=rank))
  return MeshState(
    _mesh.records_to_mesh(built, mesh, axis), {r: rec.placements for r, rec in built.items()}
  )


@_deleted.names_deleted
def restore_sharded(
  directory: os.PathLike | str,
  mesh: Mesh,
  axis: str = "fsdp",
  *,
  target: optax.OptState | None = None,
  optimizer: optax.GradientTransformation | None = None,
  params: optax.Params | None = None,
  like: Any = None,
  progress: ProgressCallback | None = None,
) -> MeshState:
  """Restores a checkpoint onto a mesh, each process reading only what its devices need.

  Call it in every process with the same arguments. With ``M`` the size of
  ``axis``, each process builds the target ranks of its addressable devices
  (their coordinates along ``axis``): it reads every archive's small metadata,
  then only the chunks of the source buffers that overlap those ranks, and
  runs the gather kernels on the device of each rank.

  With ``target``, the state comes back in logical form instead: every history
  leaf in its parameter's shape, every leaf laid out as ``target`` says, and
  each process reads only the chunks holding the elements its own devices
  hold (each device's index box of a leaf, as row-major flat ranges, mapped
  to the source flat shards; devices holding the same box share one read).

  With ``optimizer`` and ``params`` (the flat layout only), the checkpoint is
  first checked against the state ``flat_sharded(optimizer, mesh, axis)``
  will update: its params must be ``params``' ids and shapes, and its saved
  state leaf for leaf ``jax.eval_shape(optimizer.init, params)`` (the same
  tree, each history buffer of its parameter's shape and of the dtype the
  optimizer gives it, each clock scalar of its dtype). A restore that passes
  returns exactly what it returns without them.

  Args:
    directory: a checkpoint written by ``save_records`` or :func:`save_sharded`
      (any source world size).
    mesh: the target mesh (e.g. ``jax.make_mesh((M,), ("fsdp",))``).
    axis: the mesh axis the flat shards are split over.
    target: None (the flat layout above), or an abstract optax state: the
      tree ``optimizer.init(params)`` builds, each leaf a
      ``jax.ShapeDtypeStruct`` (or array) with ``.sharding`` set, any
      sharding per leaf, over any mesh. ``mesh`` and ``axis`` are then not
      used: the target's shardings say where everything goes. A target in
      Flax NNX form (an ``nnx.Optimizer``'s abstract ``opt_state``) is
      restored as its plain form and returned in its own tree (``like``
      defaults to it).
    optimizer: with ``params``, the optax transformation the restored state
      will feed (or its ``flat_sharded`` wrapper); not with ``target``.
    params: with ``optimizer``, the params pytree the state is for (arrays or
      ``jax.ShapeDtypeStruct``s).
    like: optional tree whose structure the restored state takes, matched by
      key path (flat layout or ``target``): e.g. an ``nnx.Optimizer``'s
      ``opt_state`` made for ``mesh``, whose ``nnx.State`` nodes and Variables
      come back holding the restored leaves, ready for
      ``nnx.update(optimizer.opt_state, nnx.state(restored))``. Its plain form
      (``nnx.State`` nodes as dicts, integer keys kept, Variables as their
      values) must be the restored state's tree.
    progress: called with a :class:`jaxreshard.Progress` after each target
      rank this process builds (with ``target``: after each source archive it
      reads); each is also logged at DEBUG, the call at INFO, to the
      ``"jaxreshard"`` logger.

  Returns:
    A :class:`MeshState`: ``state`` is the optax state whose history leaves are
    global ``(M * slots,)`` arrays sharded over ``axis`` (replicated over the
    other axes) and whose scalars are replicated (a Python number, or a 64-bit
    scalar while x64 is off, comes back as it is, as ``restore`` gives it: jax
    would cut it to 32 bits); ``placements`` maps each
    local target rank to its placements. Every local shard is bit-identical
    to ``reshard(load_records(directory), plan(..., M, rank))``.

    With ``target``: ``state`` is the full optax state, bit-identical to the
    state that was saved, each leaf a global array with the target leaf's
    shape, dtype and sharding (a 64-bit scalar while x64 is off stays a numpy
    value, a Python number stays one); ``placements`` is ``{0: ...}``, every
    parameter as the one rank of world_size 1 (logical shape, storage dtype,
    trainability), since a logical state has no flat ranks.

    With ``like``: ``state`` is in ``like``'s tree; ``placements`` as above.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: every refusal of ``restore``. With ``target``, a target
      that disagrees with the checkpoint, naming the leaf's key path:
      ``PlacementError`` (tree structure, a missing or extra leaf, a missing
      or unusable sharding), ``ShapeError`` (a leaf's shape), ``DtypeError``
      (a leaf's dtype).
    PlacementError: with ``optimizer`` and ``params``, a checkpoint that does
      not hold the state the optimizer builds for the params, naming each
      param or leaf (its key path) and what differs: a param missing from
      either side, a param's shape, the tree (another optimizer), a leaf's
      shape, a leaf's dtype (then a ``DtypeError``, also a ``PlacementError``).
    PlacementError: with ``like``, a tree whose plain form is not the restored
      state's tree (another optimizer, other params, string keys for integer
      ones).
    PlacementError: onto devices of several processes, processes that opened
      checkpoints of two saves or were given two meshes (in every process); a
      process that holds none of the mesh's (or target's) devices.
    ArchiveError: onto devices of several processes, another process refused
      the restore, before reading or while it read its part (named, with its
      error), or did not come to it in time.

  Examples:
    >>> import os, tempfile, jax, jax.numpy as jnp, numpy as np, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    >>> state, placements = restore_sharded(path, mesh)
    >>> state[0].mu["w"].sharding.spec
    P('fsdp',)
    >>> abstract = jax.eval_shape(opt.init, params)
    >>> everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> abstract = jax.tree.map(
    ...     lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), abstract)
    >>> state, _ = restore_sharded(path, mesh, target=abstract)
    >>> state[0].mu["w"].shape, state[0].count.sharding == everywhere
    ((10,), True)
  """
  # Every process whose devices the restore places on opens a checkpoint of one save,
  # and a refusal of its arguments in one process is one in every process.
  devices = list(_agreement.restore_devices(mesh, target))
  processes = _agreement.processes_of(devices)
  ckpt, plain, like = _agreement.opened_everywhere(
    processes,
    lambda: _checked_and_opened(
      directory, (mesh, axis, devices), target, optimizer, params, like, progress
    ),
    directory,
    _agreement.target_words(target) if target is not None else _agreement.mesh_words(mesh, axis),
  )
  # What a process refuses while it reads its part is refused in every process too.
  if target is not None:
    restored = _agreement.done_everywhere(
      processes,
      lambda: _target_restore.restore_to_target(
        directory, plain, progress=progress, checkpoint=ckpt
      ),
      directory,
    )
    return _in_like(like, restored)
  world = _mesh.axis_size(mesh, axis)
  ranks = list(_mesh.mesh_ranks(mesh, axis))
  records = _agreement.done_everywhere(
    processes,
    lambda: _restore.restore_reported(
      "restore_sharded", directory, ranks, world_size=world, checkpoint=ckpt, progress=progress
    ),
    directory,
  )
  built = dict(zip(ranks, records))
  restored = MeshState(
    _mesh.records_to_mesh(built, mesh, axis), {r: rec.placements for r, rec in built.items()}
  )
  return _in_like(like, restored)


def _checked_and_opened(directory, where, target, optimizer, params, like, progress):
  """``restore_sharded``'s arguments checked and its checkpoint opened (and checked
  against ``optimizer`` and ``like``): ``(checkpoint, plain target, like)``.
  ``where`` is ``(mesh, axis, the devices the restore places on)``."""
  mesh, axis, devices = where
  check_callback(progress)
  if (optimizer is None) != (params is None):
    raise PlacementError("restore_sharded: optimizer= and params= go together; pass both")
  if target is None:
    _mesh.axis_size(mesh, axis)
  elif optimizer is not None:
    raise PlacementError(
      "restore_sharded: target= is checked against the checkpoint itself; optimizer="
      " and params= check the flat layout, without target="
    )
  # None (a target without shardings): refused by the target's leaf checks.
  if devices and not any(d.process_index == jax.process_index() for d in devices):
    raise PlacementError(
      f"restore_sharded: process {jax.process_index()} holds none of the"
      f" {'target' if target is not None else 'mesh'}'s devices; the processes whose"
      " devices it holds restore onto them"
    )
  plain = None
  if target is not None:
    plain = _plain.plain(target)
    if like is None and plain is not target:
      # A target in Flax NNX form (an ``nnx.Optimizer``'s abstract ``opt_state``):
      # restored as its plain form, handed back in its own tree, as ``like=`` does.
      like = target
    if like is not None:  # the restored state takes the target's tree
      _plain.check_like(like, jax.tree_util.tree_structure(plain))
    return _reader.open_checkpoint(directory), plain, like
  ckpt = _reader.open_checkpoint(directory)
  if optimizer is not None:
    _optimizer_check.check_optimizer(ckpt, optimizer, params)
  if like is not None:  # the restored state takes the saved state's tree
    saved = _target_restore.checkpoint_state(ckpt)[1]
    _plain.check_like(like, jax.tree_util.tree_structure(saved))
  return ckpt, plain, like


def _in_like(like: Any, restored: MeshState) -> MeshState:
  """``restored`` with its state in ``like``'s tree (``_plain.like``); as it is without ``like``.

  The one rule of ``like=`` (``ReshardRestore(like=...)`` comes here through ``restore_sharded``).

  Raises:
    PlacementError: the restored state's tree is not ``like``'s plain form.
  """
  if like is None:
    return restored
  return MeshState(_plain.like(like, restored.state), restored.placements)


def host_record(record: ShardRecord) -> ShardRecord:
  """A snapshot of the record on the host: every array leaf copied.

  ``jax.Array`` leaves become host numpy arrays (device-to-host transfers of all
  leaves start before the first is awaited; a replicated array is read from one
  of its device buffers, bit for bit), and numpy arrays are copied too: the
  caller may change its arrays in place as soon as a save returns, while the
  snapshot is still being written. Immutable leaves (Python and numpy scalars)
  are kept.
  """
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  single = [
    x.addressable_data(0)
    if isinstance(x, jax.Array) and x.is_fully_replicated and len(x.sharding.device_set) > 1
    else x
    for x in leaves
  ]
  for x in single:
    if isinstance(x, jax.Array):
      x.copy_to_host_async()
  host = [_snapshot(x) for x in single]
  return ShardRecord(
    record.version, record.placements, jax.tree_util.tree_unflatten(treedef, host), record.roles
  )


def _snapshot(x: Any) -> Any:
  """A copy of one leaf that nothing the caller does later can change."""
  if isinstance(x, jax.Array):
    if _clock.is_key(x):
      # A typed PRNG key (``noisy_sgd``): its key data copied, wrapped as the same kind.
      data = np.array(jax.random.key_data(x), copy=True)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.array(x, copy=True)
    # A weakly typed scalar (``jnp.asarray(3)``) stays a jax array: numpy has no
    # weak type, and the index and each archive record it.
    return _clock.keep_weak(jax.device_put(host), x) if x.weak_type else host
  if isinstance(x, np.ndarray):
    return np.array(x, copy=True)
  return x  # Python and numpy scalars are immutable


def global_index(optimizer, state, shapes, mesh, axis, checkpoint_id: str, roles=None) -> dict:
  """The index of every rank, from the state's layout alone (no other process's data).

  Every rank of a global flat-sharded state has the same tree, the same
  ``(slots,)`` buffers and the same (replicated) clock; only placements'
  ranks differ, so the primary describes all ``M`` archives itself, the first
  leaf by leaf and the others from it (``IndexBuilder.add_ranks``): its cost
  follows the params and the ranks, never their product. ``roles``: the
  state's ``optimizer_roles`` when the caller has them.
  """
  world = _mesh.axis_size(mesh, axis)
  if roles is None:
    roles = _mesh.optimizer_roles(optimizer, state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  of = _shapes.placements_for(shapes, roles, leaves, world)
  abstract = []
  for leaf, role in zip(_leafshards.clocks_whole(state, leaves, roles), roles):
    if role is None:
      abstract.append(leaf)
    else:
      slots = FlatShard(_shapes.shape_of(shapes[role], role), 0, world).slots
      if tuple(np.shape(leaf)) != (world * slots,):
        raise ShapeError(
          f"param {role!r}: global history buffer of shape {tuple(np.shape(leaf))} is not"
          f" ({world} * {slots},) of its shape over mesh axis {axis!r}"
        )
      abstract.append(jax.ShapeDtypeStruct((slots,), leaf.dtype))
  builder = _reader.IndexBuilder(checkpoint_id)
  tree_state = jax.tree_util.tree_unflatten(treedef, abstract)
  builder.add_ranks(
    range(world), lambda rank: ShardRecord(RECORD_VERSION, of(rank), tree_state, roles)
  )
  return builder.index()


def stamped_index(
  template: dict, checkpoint_id: str, leaves: Sequence[Any], roles: Sequence[Any]
) -> dict:
  """``global_index`` of the state whose flattened leaves are ``leaves``, made from
  ``template``: the ``global_index`` of a state of the same layout (tree, roles, params,
  mesh axis) under another identity and clock.

  Every archive of a global index shares its one clock entry, and nothing else in the
  index depends on the checkpoint's identity or the clock's values, so the two
  differ in those two fields alone: a save makes its index once, when it is checked.
  """
  clocks, archives = template["clocks"], template["archives"]
  if len(clocks) != 1 or any(clock != 0 for _, _, clock in archives):
    raise AssertionError("a global index has one clock, shared by every archive")
  if len(leaves) != len(roles):
    raise AssertionError("the state is not the one whose layout the template describes")
  leaves = [
    _leafshards.clock_whole(x, lambda i=i: f"state leaf {i}") if r is None else None
    for i, (x, r) in enumerate(zip(leaves, roles))
  ]
  return {
    **template,
    "checkpoint": checkpoint_id,
    "clocks": [_writer.clock_scalars(0, leaves, roles)],
  }

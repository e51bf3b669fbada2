"""Multi-host save and restore of flat-sharded optax state on a JAX mesh.

Every process calls the same function (SPMD). On restore each process builds
only the target ranks of its own devices, reading only the source archives and
chunks they overlap. On save each process writes only the archives of the
ranks it owns and the primary process writes the index; the save is an orbax
save of the ``ReshardCheckpointHandler`` (``_orbax_hook``), so orbax's
barriers and its commit (a temporary directory renamed into place by the
primary once every process finished) make it atomic across hosts.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxreshard import _archive_io, _mesh, _restore, _target_restore
from jaxreshard import _checkpoint
from jaxreshard._errors import ArchiveError, ArchiveExistsError, ReshardError, ShapeError
from jaxreshard._mesh import MeshState
from jaxreshard._geometry import FlatShard
from jaxreshard._record import RECORD_VERSION, ShardRecord
from jaxreshard._report import ProgressCallback, check_callback

__all__ = ["restore_sharded", "save_sharded", "reshard_to_mesh"]

DEFAULT_TIMEOUT_S = 300


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
  from jaxreshard import _reshard  # pylint: disable=g-import-not-at-top

  records = list(records)
  world = _mesh.axis_size(mesh, axis)
  built = {}
  for rank, devices in _mesh.mesh_ranks(mesh, axis).items():
    with jax.default_device(devices[0]):
      built[rank] = _reshard.reshard(records, _reshard.plan(records, world_size=world, rank=rank))
  return MeshState(_mesh.records_to_mesh(built, mesh, axis),
                   {r: rec.placements for r, rec in built.items()})


def restore_sharded(directory: os.PathLike | str, mesh: Mesh, axis: str = "fsdp", *,
                    target: Optional[optax.OptState] = None,
                    progress: Optional[ProgressCallback] = None) -> MeshState:
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

  Args:
    directory: a checkpoint written by ``save_records`` or :func:`save_sharded`
      (any source world size).
    mesh: the target mesh (e.g. ``jax.make_mesh((M,), ("fsdp",))``).
    axis: the mesh axis the flat shards are split over.
    target: None (the flat layout above), or an abstract optax state: the
      tree ``optimizer.init(params)`` builds, each leaf a
      ``jax.ShapeDtypeStruct`` (or array) with ``.sharding`` set, any
      sharding per leaf, over any mesh. ``mesh`` and ``axis`` are then not
      used: the target's shardings say where everything goes.
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

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: every refusal of ``restore``. With ``target``, a target
      that disagrees with the checkpoint, naming the leaf's key path:
      ``PlacementError`` (tree structure, a missing or extra leaf, a missing
      or unusable sharding), ``ShapeError`` (a leaf's shape), ``DtypeError``
      (a leaf's dtype).

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
  check_callback(progress)
  if target is not None:
    return _target_restore.restore_to_target(directory, target, progress=progress)
  world = _mesh.axis_size(mesh, axis)
  ranks = list(_mesh.mesh_ranks(mesh, axis))
  records = _restore.restore_reported("restore_sharded", directory, ranks, world_size=world,
                                      progress=progress)
  built = dict(zip(ranks, records))
  return MeshState(_mesh.records_to_mesh(built, mesh, axis),
                   {r: rec.placements for r, rec in built.items()})


def save_sharded(
    directory: os.PathLike | str,
    optimizer: optax.GradientTransformation,
    state: optax.OptState,
    shapes: Mapping[str, Any],
    mesh: Mesh,
    axis: str = "fsdp",
    *,
    chunk_bytes: int = _archive_io.DEFAULT_CHUNK_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Optional[ProgressCallback] = None,
) -> None:
  """Saves a global flat-sharded state as one checkpoint of ``M`` archives, from every process.

  Call it in every process with the same arguments. It is an orbax
  ``AsyncCheckpointer`` save of :class:`ReshardSave` to ``directory``, waited
  for: each process writes the archives of the ranks whose first device (in
  mesh order) it owns, from host copies of its own device buffers; the primary
  process writes the index; orbax commits (renames its temporary directory to
  ``directory``) on the primary only after every process finished writing. A
  failed or killed process leaves no ``directory``.

  Args:
    directory: the checkpoint directory to create; it must not exist and must
      be on storage every process sees.
    optimizer: the optax transformation whose state this is (it says which
      leaves are histories).
    state: the global state (history leaves ``(M * slots,)`` sharded over
      ``axis``), e.g. from :func:`restore_sharded` or :func:`shard_to_mesh`.
    shapes: param id -> logical shape, or anything with ``.shape`` (and then
      its ``.dtype`` / ``.trainable``): ``{p.param: p for p in
      placements[r]}`` of a :class:`MeshState` keeps dtypes and trainability.
    mesh: the mesh of ``state``.
    axis: the mesh axis of the flat shards.
    chunk_bytes: bytes per stored chunk, the granularity of partial reads.
    timeout_s: how long a process waits for the others to finish writing (a
      process whose write fails tells the others at once, and they raise).
    progress: called with a :class:`jaxreshard.Progress` after each archive
      this process writes (from orbax's writer thread; the save returns after
      the last); each is also logged at DEBUG, the save at INFO, to the
      ``"jaxreshard"`` logger.

  Raises:
    ArchiveExistsError: ``directory`` already exists (raised on every process),
      or another save of it is in progress.
    FileNotFoundError: its parent directory does not exist.
    ReshardError: a state that does not match ``shapes`` (raised before
      anything is written); ``ArchiveError`` when the checkpoint was not
      committed (a process failed, or did not finish within ``timeout_s``).

  Examples:
    >>> import os, tempfile, jax, jax.numpy as jnp, numpy as np, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    >>> sharded = jr.shard_to_mesh(opt, params, opt.init(params), mesh)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_sharded(path, opt, sharded.state, {"w": (10,)}, mesh)
    >>> len(jr.load_records(path)) == jax.device_count()
    True
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jaxreshard import _orbax_hook  # pylint: disable=g-import-not-at-top

  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
    raise ReshardError(f"chunk_bytes {chunk_bytes!r} must be a positive integer")
  check_callback(progress)
  final = os.path.abspath(os.fspath(directory))
  # Every process looks before any of them can commit (a commit needs all of
  # them), so all of them agree on this refusal.
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} already exists; jaxreshard never overwrites a checkpoint")
  if not os.path.isdir(os.path.dirname(final)):
    raise FileNotFoundError(f"parent directory {os.path.dirname(final)} of {final} does not exist")
  args = _orbax_hook.ReshardSave(optimizer=optimizer, state=state, shapes=shapes, mesh=mesh,
                                 axis=axis, chunk_bytes=chunk_bytes)
  # Refusals of the state, host copies and the index, before any directory exists.
  reporter = _orbax_hook.prepare(args, progress=progress, where=final).reporter
  timeout = max(1, int(timeout_s))
  checkpointer = ocp.AsyncCheckpointer(
      _orbax_hook.ReshardCheckpointHandler(timeout_secs=timeout), timeout_secs=timeout)
  try:
    checkpointer.save(final, args=args)
    checkpointer.wait_until_finished()
    reporter.finish()
  except ReshardError:
    raise
  except FileExistsError as e:  # another save of ``directory`` made orbax's directories first
    raise ArchiveExistsError(
        f"save_sharded: {final} was not committed: another save is writing it ({e})") from e
  except Exception as e:  # orbax's and the runtime's error types
    raise ArchiveError(
        f"save_sharded: {final} was not committed ({type(e).__name__}: {e})") from e
  finally:
    try:
      checkpointer.close()
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # the error, if any, was raised above


def host_record(record: ShardRecord) -> ShardRecord:
  """The record with every ``jax.Array`` leaf copied to a host numpy array.

  Device-to-host transfers of all leaves start before the first is awaited.
  A replicated array is read from one of its device buffers, bit for bit.
  """
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  single = [x.addressable_data(0) if isinstance(x, jax.Array) and x.is_fully_replicated
            and len(x.sharding.device_set) > 1 else x for x in leaves]
  for x in single:
    if isinstance(x, jax.Array):
      x.copy_to_host_async()
  host = [np.array(x) if isinstance(x, jax.Array) else x for x in single]
  return ShardRecord(record.version, record.placements,
                     jax.tree_util.tree_unflatten(treedef, host), record.roles)


def global_index(optimizer, state, shapes, mesh, axis, checkpoint_id: str) -> dict:
  """The index of every rank, from the state's layout alone (no other process's data).

  Every rank of a global flat-sharded state has the same tree, the same
  ``(slots,)`` buffers and the same (replicated) clock; only placements'
  ranks differ, so the primary describes all ``M`` archives itself.
  """
  world = _mesh.axis_size(mesh, axis)
  roles = _mesh.roles_of(optimizer, state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  of = _mesh.placements_for(shapes, roles, leaves, world)
  abstract = []
  for leaf, role in zip(leaves, roles):
    if role is None:
      abstract.append(leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf)
    else:
      slots = FlatShard(_mesh.shape_of(shapes[role], role), 0, world).slots
      if tuple(np.shape(leaf)) != (world * slots,):
        raise ShapeError(
            f"param {role!r}: global history buffer of shape {tuple(np.shape(leaf))} is not"
            f" ({world} * {slots},) of its shape over mesh axis {axis!r}")
      abstract.append(jax.ShapeDtypeStruct((slots,), leaf.dtype))
  builder = _checkpoint.IndexBuilder(checkpoint_id)
  tree_state = jax.tree_util.tree_unflatten(treedef, abstract)
  for rank in range(world):
    builder.add(rank, ShardRecord(RECORD_VERSION, of(rank), tree_state, roles), pack=False)
  return builder.index()

"""Multi-host save and restore of flat-sharded optax state on a JAX mesh.

Every process calls the same function (SPMD). On restore each process builds
only the target ranks of its own devices, reading only the source archives and
chunks they overlap; on save each process writes only the archives of the
ranks it owns, and the primary process commits the checkpoint (writes its
index and renames it into place) once every process has reported success, the
way orbax commits a multi-host checkpoint. Processes agree through the
key-value store of ``jax.distributed``'s coordination service.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from jaxreshard import _archive_io, _global, _restore, _target_restore
from jaxreshard import _checkpoint
from jaxreshard._errors import ArchiveError, ArchiveExistsError, PlacementError, ReshardError
from jaxreshard._global import MeshState
from jaxreshard._geometry import FlatShard
from jaxreshard._record import FORMAT_VERSION, ShardRecord

__all__ = ["restore_sharded", "save_sharded", "reshard_to_mesh"]

DEFAULT_TIMEOUT_S = 300
# Every process calls save_sharded the same number of times, so the n-th call
# has the same number everywhere: it names that save's keys in the shared store.
_SAVES = itertools.count()


def reshard_to_mesh(records: Any, mesh: Mesh, axis: str = "fsdp") -> MeshState:
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
  world = _global._axis_size(mesh, axis)  # pylint: disable=protected-access
  built = {}
  for rank, devices in _global.mesh_ranks(mesh, axis).items():
    with jax.default_device(devices[0]):
      built[rank] = _reshard.reshard(records, _reshard.plan(records, world_size=world, rank=rank))
  return MeshState(_global.records_to_mesh(built, mesh, axis),
                   {r: rec.placements for r, rec in built.items()})


def restore_sharded(directory: Any, mesh: Mesh, axis: str = "fsdp", *,
                    target: Any = None) -> MeshState:
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

  Returns:
    A :class:`MeshState`: ``state`` is the optax state whose history leaves are
    global ``(M * slots,)`` arrays sharded over ``axis`` (replicated over the
    other axes) and whose scalars are replicated; ``placements`` maps each
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
  if target is not None:
    return _target_restore.restore_to_target(directory, target)
  world = _global._axis_size(mesh, axis)  # pylint: disable=protected-access
  ckpt = _archive_io.open_checkpoint(directory)  # shared: the index is read once
  built = {}
  for rank in _global.mesh_ranks(mesh, axis):
    built[rank] = _restore.restore_ranks(directory, [rank], world_size=world, checkpoint=ckpt)[0]
  return MeshState(_global.records_to_mesh(built, mesh, axis),
                   {r: rec.placements for r, rec in built.items()})


def _client():
  # The coordination service client that jax.distributed.initialize started
  # (orbax's multihost utilities reach it the same way).
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  client = distributed.global_state.client
  if client is None:
    raise PlacementError(
        "this mesh spans several processes but jax.distributed is not initialized;"
        " call jax.distributed.initialize() first")
  return client


class _Sync:
  """Key-value agreement between the processes of one save (no device collectives)."""

  def __init__(self, directory: str, timeout_s: float):
    self.multi = jax.process_count() > 1
    self.prefix = f"jaxreshard/save/{next(_SAVES)}/{uuid.uuid5(uuid.NAMESPACE_URL, directory)}"
    self.timeout_ms = int(timeout_s * 1000)

  def put(self, key: str, value: str) -> None:
    if self.multi:
      _client().key_value_set(f"{self.prefix}/{key}", value)
    else:
      self.local = getattr(self, "local", {})
      self.local[key] = value

  def get(self, key: str) -> str:
    if not self.multi:
      return self.local[key]
    try:
      return _client().blocking_key_value_get(f"{self.prefix}/{key}", self.timeout_ms)
    except Exception as e:  # the runtime's error types are not public
      raise ArchiveError(
          f"save_sharded: no answer from the other processes for {key!r} within"
          f" {self.timeout_ms // 1000} s ({type(e).__name__}: {e}); nothing was committed"
      ) from None


def _outcome(text: str, what: str) -> str:
  kind, _, detail = text.partition(":")
  if kind == "ok":
    return detail
  if kind == "exists":
    raise ArchiveExistsError(detail)
  raise ArchiveError(f"save_sharded: {what}: {detail}")


def save_sharded(
    directory: Any,
    optimizer: Any,
    state: Any,
    shapes: Mapping[str, Any],
    mesh: Mesh,
    axis: str = "fsdp",
    *,
    chunk_bytes: int = _archive_io.DEFAULT_CHUNK_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
  """Saves a global flat-sharded state as one checkpoint of ``M`` archives, from every process.

  Call it in every process with the same arguments. Each process writes the
  archives of the ranks whose first device (in mesh order) it owns, from its
  own device buffers; no process writes another's files. Archives go to a
  temporary sibling directory; the primary process (process 0) writes the
  index and renames the directory into place only after every process has
  reported success. A failed or killed process leaves no ``directory``.

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
    timeout_s: how long a process waits for the others before giving up.

  Raises:
    ArchiveExistsError: ``directory`` already exists (raised on every process).
    ReshardError: a state that does not match ``shapes``, a process that
      failed, or a process that did not answer within ``timeout_s``.

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
  if chunk_bytes < 1:
    raise ReshardError(f"chunk_bytes {chunk_bytes} must be positive")
  world = _global._axis_size(mesh, axis)  # pylint: disable=protected-access
  final = os.path.abspath(os.fspath(directory))
  sync = _Sync(final, timeout_s)
  primary = jax.process_index() == 0

  if primary:  # 1. the primary picks (and creates) the temporary directory
    try:
      tmp = _archive_io.new_temp_dir(final)
      sync.put("tmp", f"ok:{uuid.uuid4().hex}:{tmp}")
    except ArchiveExistsError as e:
      sync.put("tmp", f"exists:{e}")
      raise
    except Exception as e:
      sync.put("tmp", f"error:{type(e).__name__}: {e}")
      raise
  # Every archive of one save carries the identity the primary picked.
  checkpoint_id, _, tmp = _outcome(sync.get("tmp"), "the primary process could not start the save"
                                   ).partition(":")

  # 2. every process writes its own ranks' archives.
  try:
    ranks = _global.writer_ranks(mesh, axis)
    records = _global.records_from_mesh(optimizer, state, shapes, mesh, axis, ranks=ranks)
    builder = _checkpoint.IndexBuilder(checkpoint_id)
    for rank in ranks:
      _write_rank(tmp, rank, records[rank], chunk_bytes, builder)
    sync.put(f"done/{jax.process_index()}", "ok:")
  except BaseException as e:
    message = f"error:process {jax.process_index()}: {type(e).__name__}: {e}"
    sync.put(f"done/{jax.process_index()}", message)
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
      sync.put("commit", message)
    raise

  # 3. the primary commits once every process succeeded; everyone learns the outcome.
  if primary:
    try:
      for p in range(jax.process_count()):
        _outcome(sync.get(f"done/{p}"), f"process {p} failed")
      names = [f"archive_{r:05d}" for r in range(world)]
      missing = [n for n in names
                 if not os.path.isfile(os.path.join(tmp, n, _checkpoint.ARCHIVE_FILE))]
      if missing:
        raise ArchiveError(f"archives {missing} were not written")
      _checkpoint.dump(os.path.join(tmp, _checkpoint.INDEX_FILE),
                       _global_index(optimizer, state, shapes, mesh, axis, checkpoint_id))
      if os.path.lexists(final):
        raise ArchiveExistsError(f"{final} appeared while it was being written")
      os.rename(tmp, final)
      sync.put("commit", "ok:")
    except BaseException as e:
      shutil.rmtree(tmp, ignore_errors=True)
      sync.put("commit", f"error:{type(e).__name__}: {e}")
      raise
  _outcome(sync.get("commit"), "the checkpoint was not committed")


def _write_rank(tmp: str, rank: int, record: ShardRecord, chunk_bytes: int,
                builder: "_checkpoint.IndexBuilder") -> None:
  # Host copies of this rank's device buffers; the archive writer takes numpy.
  host = jax.tree.map(np.asarray, record.state)
  record = ShardRecord(record.version, record.placements, host, record.roles)
  _checkpoint.write_archive(tmp, rank, record, builder, chunk_bytes)


def _global_index(optimizer, state, shapes, mesh, axis, checkpoint_id: str) -> dict:
  """The index of every rank, from the state's layout alone (no other process's data).

  Every rank of a global flat-sharded state has the same tree, the same
  ``(slots,)`` buffers and the same (replicated) clock; only placements'
  ranks differ, so the primary describes all ``M`` archives itself.
  """
  world = _global._axis_size(mesh, axis)  # pylint: disable=protected-access
  roles = _global.roles_of(optimizer, state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  of = _global.placements_for(shapes, roles, leaves, world)
  abstract = []
  for leaf, role in zip(leaves, roles):
    if role is None:
      abstract.append(leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf)
    else:
      slots = FlatShard(_global._shape_of(shapes[role], role), 0, world).slots  # pylint: disable=protected-access
      abstract.append(jax.ShapeDtypeStruct((slots,), leaf.dtype))
  builder = _checkpoint.IndexBuilder(checkpoint_id)
  tree_state = jax.tree_util.tree_unflatten(treedef, abstract)
  for rank in range(world):
    builder.add(rank, ShardRecord(FORMAT_VERSION, of(rank), tree_state, roles), pack=False)
  return builder.index()

"""jaxreshard archives as an asynchronous, multi-host orbax checkpoint item.

``ReshardSave`` and ``ReshardRestore`` are ``CheckpointArgs`` registered with
``ReshardCheckpointHandler`` through ``ocp.args.register_with_handler``, so an
``ocp.CheckpointManager`` (or ``Checkpointer``, ``AsyncCheckpointer``, or one
item of a ``Composite``) picks the handler from the arguments alone.

The handler is an ``AsyncCheckpointHandler``. ``async_save`` runs in every
process, synchronously: it takes host copies of the buffers this process
writes (so the caller may mutate or donate its state as soon as ``save``
returns) and, on the primary process, the checkpoint's index. It returns a
commit future that writes the archives in a background thread once orbax has
created the directory. Orbax owns the rest: it waits for every process's
futures, then on the primary calls ``finalize`` (which writes the index, the
checkpoint's last file) and renames the temporary directory into place. A
process that fails leaves nothing committed.

A save that will be refused is refused when its ``ReshardSave`` is made:
its construction checks the records, or the state against the optimizer,
the params and the mesh (no device-to-host copy, no collective), so the
refusal comes before orbax creates any temporary directory.

In a multi-process save every process's commit future ends by telling the
others, through the ``jax.distributed`` key-value store, that its archives
are written or why they are not, and waits until every process has told.
When one process's write fails, the others raise an ``ArchiveError`` naming
that process and its error as soon as it is told (within a second), instead
of waiting at orbax's barrier until its timeout. A process that hangs or
dies without telling is waited for until the handler's ``timeout_secs``
(orbax's default asynchronous timeout unless given), as orbax's barrier
would. Without a ``jax.distributed`` client (one process) there is nothing
to wait for.

Two saves racing on one directory: orbax names the temporary directory
after the final one, so both saves use the same, and creating it removes
one found there. A collision inside it (an archive directory the other save
already made) is an ``ArchiveExistsError``; a save whose directory the other
removed is an ``ArchiveError``. ``save_sharded`` also turns orbax's own
``FileExistsError`` (from creating the temporary directory) into an
``ArchiveExistsError``; a ``CheckpointManager``'s ``save`` cannot be
reached there, so two managers racing on one step may still see orbax's
``FileExistsError`` (orbax supports one manager per directory).

Who writes what:

* a mesh state (``ReshardSave(state=..., mesh=...)``): each process writes
  the archives of the ranks whose first device it owns
  (``_mesh.writer_ranks``); the primary writes the index, made from the
  state's layout alone.
* records (``ReshardSave(records)``): every process passes the same records;
  the primary writes them all and the index.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from typing import Any, Iterable, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxreshard._src.checkpoint import store as _archive_io
from jaxreshard._src.checkpoint import reader as _checkpoint
from jaxreshard._src.distributed import mesh as _mesh
from jaxreshard._src.distributed import sharded as _multihost
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, PlacementError, ReshardError
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.progress import ProgressCallback, Reporter

__all__ = ["ReshardCheckpointHandler", "ReshardRestore", "ReshardSave"]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What one process writes for one save, with every byte already on the host."""

  checkpoint_id: str  # the same in every process of the save
  archives: tuple[tuple[int, ShardRecord], ...]  # (archive index, host record)
  index: Optional[dict]  # the primary's; None elsewhere
  chunk_bytes: Optional[int]
  reporter: Reporter  # told of each archive written


@dataclasses.dataclass(frozen=True)
class _Checked:
  """What checking a ``ReshardSave`` found, kept for its save."""

  shapes: Optional[Mapping[str, Any]]  # state: param id -> shape or placement
  views: Optional[dict[int, ShardRecord]]  # state: this process's archives, device buffers


def _is_primary(primary_host: Optional[int]) -> bool:
  return ocp.multihost.is_primary_host(primary_host)


def _shared_checkpoint_id(primary_host: Optional[int]) -> str:
  """One new identity for this save, the same in every process (the primary's)."""
  raw = np.frombuffer(uuid.uuid4().bytes, np.uint8).astype(np.int32)
  if jax.process_count() > 1:
    raw = np.asarray(ocp.multihost.broadcast_one_to_all(
        raw, is_source=_is_primary(primary_host)))
  return bytes(raw.astype(np.uint8).tolist()).hex()


def _shapes_of(args: "ReshardSave") -> Mapping[str, Any]:
  if args.shapes is not None:
    return args.shapes
  ids, leaves, _ = _structure.param_ids(args.params)
  trainable = dict(args.trainable or {})
  unknown = sorted(set(trainable) - set(ids))
  if unknown:
    raise PlacementError(f"params {unknown}: named in `trainable` but not in params")
  return {pid: ParamPlacement(pid, tuple(np.shape(x)), 0, 1, np.dtype(x.dtype),
                              trainable.get(pid, True)) for pid, x in zip(ids, leaves)}


def check(args: "ReshardSave") -> _Checked:
  """Every refusal of a save of ``args``, in every process, with nothing copied or written.

  Records: each record as an archive of the index. A state: its structure
  against the optimizer and the params, each history buffer against its
  parameter's shape over the mesh axis, this process's shards of its own
  ranks, and the index of every rank (made with a placeholder identity).
  """
  if args.state is None:
    builder = _checkpoint.IndexBuilder()
    for i, record in enumerate(args.records):
      builder.add(i, record, pack=False)
    builder.index()
    return _Checked(None, None)
  shapes = _shapes_of(args)
  views = _mesh.records_from_mesh(args.optimizer, args.state, shapes, args.mesh, args.axis,
                                  ranks=_mesh.writer_ranks(args.mesh, args.axis))
  # The clock's device scalars as zeros of their dtype and shape (what storing
  # one depends on): checking never waits for the step that computes them.
  roles = _mesh.roles_of(args.optimizer, args.state, shapes)
  leaves, treedef = jax.tree_util.tree_flatten(args.state)
  leaves = [np.zeros(x.shape, x.dtype) if role is None and isinstance(x, jax.Array)
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for x, role in zip(leaves, roles)]
  _multihost.global_index(args.optimizer, jax.tree_util.tree_unflatten(treedef, leaves), shapes,
                          args.mesh, args.axis, "0" * 32)
  return _Checked(shapes, views)


def prepare(args: "ReshardSave", primary_host: Optional[int] = 0, *,
            progress: Optional[ProgressCallback] = None, where: Any = "") -> _Plan:
  """Everything a save needs from the caller's buffers, taken now (see the module doc).

  The plan is kept on ``args`` until the handler's ``async_save`` takes it,
  so a caller may prepare first to take the host copies before orbax creates
  any directory. Each save gets its own plan and checkpoint identity, the
  same in every process. Its reporter tells ``progress`` (and the logger)
  of each archive written.
  """
  plan = args.__dict__.get("_plan")
  if plan is not None:
    return plan
  checked = args.__dict__.get("_checked") or check(args)
  primary = _is_primary(primary_host)
  what = "save_sharded" if args.state is not None else "ReshardSave"
  checkpoint_id = _shared_checkpoint_id(primary_host)
  index = None
  try:
    if args.state is not None:
      archives = tuple(sorted((r, _multihost.host_record(v)) for r, v in checked.views.items()))
      if primary:
        index = _multihost.global_index(args.optimizer, args.state, checked.shapes, args.mesh,
                                        args.axis, checkpoint_id)
    elif primary:
      archives = tuple((i, _multihost.host_record(r)) for i, r in enumerate(args.records))
      builder = _checkpoint.IndexBuilder(checkpoint_id)
      for i, record in archives:
        builder.add(i, record, pack=False)
      index = builder.index()
    else:
      archives = ()
  except BaseException as e:
    _tell_peers(checkpoint_id, e)  # the others stop waiting for this process
    raise
  reporter = Reporter(what, progress, where=where, total=len(archives),
                      total_bytes=sum(_archive_io.history_bytes(r) for _, r in archives))
  plan = _Plan(checkpoint_id, archives, index, args.chunk_bytes, reporter)
  object.__setattr__(args, "_plan", plan)
  return plan


_PEERS_KEY = "jaxreshard/save"
_POLL_S = 0.2


def _distributed_client() -> Any:
  """The ``jax.distributed`` client of a multi-process job, or None."""
  if jax.process_count() < 2:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return distributed.global_state.client


def _tell_peers(checkpoint_id: str, error: Optional[BaseException]) -> None:
  """Tells the other processes of this save that this one's archives are written, or why not."""
  client = _distributed_client()
  if client is None:
    return
  value = "ok" if error is None else f"failed: {type(error).__name__}: {error}"[:2000]
  try:
    client.key_value_set(f"{_PEERS_KEY}/{checkpoint_id}/{jax.process_index()}", value)
  except Exception:  # pylint: disable=broad-exception-caught
    pass  # the others then wait for this process until their timeout, as orbax would


def _await_peers(checkpoint_id: str, directory: str, timeout_s: float) -> None:
  """Returns when every process of this save told that its archives are written.

  Raises:
    ArchiveError: a process told that its write failed (naming it and its
      error), or not every process told within ``timeout_s``.
  """
  client = _distributed_client()
  if client is None:
    return
  prefix = f"{_PEERS_KEY}/{checkpoint_id}/"
  others = set(range(jax.process_count())) - {jax.process_index()}
  deadline = time.monotonic() + timeout_s
  while True:
    told = {}
    for key, value in client.key_value_dir_get(prefix):
      tail = key.rsplit("/", 1)[-1]
      if tail.isdigit():
        told[int(tail)] = value
    failed = sorted(p for p in others if told.get(p, "ok") != "ok")
    if failed:
      p = failed[0]
      raise ArchiveError(f"{directory}: process {p} did not write its archives"
                         f" ({told[p][len('failed: '):]}); nothing is committed")
    waiting = sorted(others - set(told))
    if not waiting:
      return
    if time.monotonic() > deadline:
      raise ArchiveError(f"{directory}: processes {waiting} did not finish writing their archives"
                         f" within {timeout_s:g} s; nothing is committed")
    time.sleep(_POLL_S)


class ReshardCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves archives asynchronously from every process; restores them resharded.

  Args:
    chunk_bytes: bytes per stored chunk (the granularity of partial reads),
      unless ``ReshardSave.chunk_bytes`` says otherwise.
    multiprocessing_options: orbax's; its ``primary_host`` writes the index.
    timeout_secs: how long a process of a multi-process save waits for the
      others to tell that their archives are written (a process whose write
      fails tells at once); None: orbax's default asynchronous timeout.
  """

  def __init__(self, chunk_bytes: int = _archive_io.DEFAULT_CHUNK_BYTES, *,
               multiprocessing_options: ocp.options.MultiprocessingOptions = (
                   ocp.options.MultiprocessingOptions()),
               timeout_secs: Optional[float] = None):
    self._chunk_bytes = chunk_bytes
    self._primary_host = multiprocessing_options.primary_host
    self._timeout_s = (ocp.options.AsyncOptions().timeout_secs if timeout_secs is None
                       else timeout_secs)
    self._lock = threading.Lock()
    # Item directory -> (save identity, the index its finalize writes) (primary only).
    self._pending: dict[str, tuple[str, dict]] = {}

  async def async_save(self, directory: epath.Path, args: "ReshardSave"):
    """Takes host copies now; returns the future that writes them (see the module doc)."""
    plan = prepare(args, self._primary_host)
    args.__dict__.pop("_plan", None)  # a second save of these args is a new save
    key = os.fspath(directory)
    if not plan.reporter.where:  # a manager's save: its logs name the item directory
      plan.reporter.where = key
    if plan.index is not None:
      with self._lock:
        self._pending[key] = (plan.checkpoint_id, plan.index)
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write(key, plan), name="jaxreshard_save")]

  async def _write(self, directory: str, plan: _Plan) -> None:
    """Writes this process's archives, tells the others, and waits for theirs."""
    chunk_bytes = plan.chunk_bytes if plan.chunk_bytes is not None else self._chunk_bytes
    builder = _checkpoint.IndexBuilder(plan.checkpoint_id)
    try:
      for index, record in plan.archives:
        try:
          nbytes = _checkpoint.write_archive(directory, index, record, builder, chunk_bytes)
        except FileExistsError as e:
          raise ArchiveExistsError(
              f"{e.filename} already exists: another save is writing {directory}") from None
        except FileNotFoundError:
          if os.path.isdir(directory):
            raise
          raise ArchiveError(f"{directory} was removed while this save wrote it: another save"
                             " of the same checkpoint made it anew") from None
        plan.reporter.step(nbytes, archive=index)
    except BaseException as e:
      _tell_peers(plan.checkpoint_id, e)
      raise
    _tell_peers(plan.checkpoint_id, None)
    _await_peers(plan.checkpoint_id, directory, self._timeout_s)

  def save(self, directory: epath.Path, args: "ReshardSave") -> None:
    """The synchronous save: ``async_save`` and its futures, waited for."""

    async def run():
      for f in await self.async_save(directory, args) or []:
        f.result()

    _run_sync(run())

  def finalize(self, directory: epath.Path) -> None:
    """On the primary, after every process wrote its archives: the index, last.

    Raises:
      ArchiveError: an archive the index lists was not written.
    """
    key = os.fspath(directory)
    with self._lock:
      checkpoint_id, index = self._pending.pop(key, ("", None))
    if index is None:
      return
    client = _distributed_client()
    if client is not None:  # every process told and was heard: the keys may go
      try:
        client.key_value_delete(f"{_PEERS_KEY}/{checkpoint_id}/")
      except Exception:  # pylint: disable=broad-exception-caught
        pass
    missing = [name for name, _, _ in index["archives"]
               if not os.path.isfile(os.path.join(key, name, _checkpoint.ARCHIVE_FILE))]
    if missing:
      raise ArchiveError(f"{key}: archives {missing[:8]} were not written; nothing is committed")
    _checkpoint.dump(os.path.join(key, _checkpoint.INDEX_FILE), index)

  def restore(self, directory: epath.Path, args: Optional["ReshardRestore"] = None) -> Any:
    """Every archive, one target rank's archive, or the state laid out on a mesh.

    Raises:
      ArchiveError: the item directory is a symbolic link (see ``_item_directory``).
    """
    directory = _item_directory(directory)
    args = args if args is not None else ReshardRestore()
    if args.mesh is not None:
      extra = {} if args.target is None else {"target": args.target}
      return _multihost.restore_sharded(directory, args.mesh, args.axis, **extra).state
    if args.rank is None:
      return _archive_io.load_records(directory)
    return _restore.restore(directory, world_size=args.world_size, rank=args.rank)

  def metadata(self, directory: epath.Path) -> Any:
    """Every archive's placements, clocks and lazy buffers (no array data read)."""
    return _archive_io.open_checkpoint(_item_directory(directory))


def _item_directory(directory: Any) -> str:
  """The item directory orbax gives the handler, refused when it is a symbolic link.

  Orbax names the item directory inside its step directory; what is found
  there is part of the checkpoint, which is untrusted: a link would make the
  restore read another checkpoint (or anything) in its place.
  """
  path = os.fspath(directory)
  if os.path.islink(path):
    raise ArchiveError(f"{path}: the checkpoint item is a symbolic link (to"
                       f" {os.readlink(path)!r}); a checkpoint's item directory is never one")
  return path


def _run_sync(coro) -> None:
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  asyncio_utils.run_sync(coro)


@ocp.args.register_with_handler(ReshardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ReshardSave(ocp.args.CheckpointArgs):
  """Save archives as one orbax checkpoint item: given records, or a state on a mesh.

  Either ``records`` (every rank's archive, the same in every process; the
  primary writes them) or the training loop's sharded state: ``state``,
  ``optimizer``, ``mesh``, ``axis`` and the params' ids and shapes, as
  ``shapes`` (``param id -> shape or placement``, as :func:`save_sharded`
  takes) or ``params`` (the params pytree, or its ``jax.ShapeDtypeStruct``s;
  ``trainable`` optionally marks frozen ones). Each process then writes the
  archives of its own ranks.

  Making one checks everything a save of it would refuse (see the module
  doc), so a bad save raises here, before orbax creates its temporary
  directory. Records given as an iterator are read into a tuple. The check
  copies nothing and never waits for the device, but it walks the whole
  layout (for a state, every local shard of every history leaf): a training
  loop that saves now and then makes one only when ``manager.should_save(step)``.

  Attributes:
    records: the archives, any iterable.
    chunk_bytes: bytes per stored chunk (the granularity of partial reads);
      None keeps the handler's default.
    state: the optax state, history leaves ``(M * slots,)`` sharded over ``axis``.
    optimizer: the optax transformation of ``state``.
    shapes: param id -> logical shape, or anything with ``.shape`` (and then
      its ``.dtype`` / ``.trainable``).
    params: instead of ``shapes``: the params pytree (ids are its key paths,
      storage dtypes its leaves' dtypes).
    trainable: with ``params``: optional ``param id -> bool``.
    mesh: the mesh of ``state``.
    axis: the mesh axis of the flat shards.

  Examples:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, jaxreshard as jr
    >>> params = {"w": jnp.arange(8.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=4)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    ...   _ = manager.save(100, args=ReshardSave(records))
    ...   manager.wait_until_finished()
    ...   target = manager.restore(100, args=ReshardRestore(world_size=3, rank=0))
    >>> target.state[0].mu["w"].shape
    (3,)
  """

  records: Optional[Iterable[ShardRecord]] = None
  chunk_bytes: Optional[int] = None
  _: dataclasses.KW_ONLY
  state: Any = None
  optimizer: Any = None
  shapes: Optional[Mapping[str, Any]] = None
  params: Any = None
  trainable: Optional[Mapping[str, bool]] = None
  mesh: Optional[jax.sharding.Mesh] = None
  axis: str = "fsdp"

  def __post_init__(self):
    cb = self.chunk_bytes
    if cb is not None and (isinstance(cb, bool) or not isinstance(cb, int) or cb < 1):
      raise ReshardError(f"chunk_bytes {cb!r} must be a positive integer")
    if (self.records is None) == (self.state is None):
      raise PlacementError("ReshardSave takes records, or a state (with optimizer, mesh and"
                           " shapes or params), not both and not neither")
    if self.state is not None:
      missing = [n for n in ("optimizer", "mesh") if getattr(self, n) is None]
      if (self.shapes is None) == (self.params is None):
        missing.append("exactly one of shapes and params")
      if missing:
        raise PlacementError(f"ReshardSave(state=...) also needs {', '.join(missing)}")
      if self.trainable is not None and self.params is None:
        raise PlacementError("ReshardSave: trainable goes with params; with shapes, give each"
                             " value a .trainable")
    else:
      self.records = tuple(self.records)  # an iterator is read once, here
    # Every refusal of the save, now: before orbax creates any directory.
    self.__dict__["_checked"] = check(self)

  def __setattr__(self, name: str, value: Any) -> None:
    # A changed field is checked again when the save prepares.
    super().__setattr__(name, value)
    self.__dict__.pop("_checked", None)
    self.__dict__.pop("_plan", None)


@ocp.args.register_with_handler(ReshardCheckpointHandler, for_restore=True)
@dataclasses.dataclass(kw_only=True)
class ReshardRestore(ocp.args.CheckpointArgs):
  """What to restore: a state on a mesh, one target rank, or every archive.

  * ``mesh`` (and ``axis``): the optax state laid out on ``mesh``, every
    history leaf a global ``(M * slots,)`` array sharded over ``axis`` (M its
    size), ready for the training step: ``restore_sharded(...).state``. Every
    process restores only its own ranks. ``target`` (an abstract state whose
    shardings say the layout) is passed on to ``restore_sharded``.
  * ``world_size`` and ``rank``: that target rank's ``ShardRecord``.
  * nothing: every archive, as saved (``load_records``).

  Every field is keyword-only.

  Attributes:
    world_size: the target world size (with ``rank``).
    rank: the target rank to build.
    mesh: the target mesh.
    axis: the mesh axis of the flat shards.
    target: optional abstract target for ``restore_sharded(..., target=)``.
  """

  world_size: Optional[int] = None
  rank: Optional[int] = None
  mesh: Optional[jax.sharding.Mesh] = None
  axis: str = "fsdp"
  target: Any = None

  def __post_init__(self):
    if self.mesh is not None and (self.rank is not None or self.world_size is not None):
      raise PlacementError("ReshardRestore takes a mesh, or world_size and rank, not both")
    if self.target is not None and self.mesh is None:
      raise PlacementError("ReshardRestore(target=...) needs the mesh as well")
    if (self.rank is None) != (self.world_size is None):
      raise PlacementError("ReshardRestore(world_size=...) needs rank as well, and the reverse")

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
process that fails leaves nothing committed. Orbax's rename is not fsync'ed:
a manager made with
``CheckpointManagerOptions(temporary_path_class=DurableRenameTemporaryPath)``
commits each step and item durably (``durable``), as ``save_sharded`` does.

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

Orbax gives up on a save past its timeout by no longer waiting for its
commit futures, and tells the handler nothing else: the handler's future
then ends the save's archive writes, those of every item of a ``Composite``
(orbax asks none of the futures after the one that timed out; the archive
being written is each one's last), and returns once they stopped, so that
orbax's failed save, and a save of the same step it starts next, find nothing
of it still writing.

Two saves racing on one directory: orbax names the temporary directory
after the final one, so both saves use the same, and creating it removes
one found there. A collision inside it (an archive directory the other save
already made) is an ``ArchiveExistsError``; a save whose directory the other
removed is an ``ArchiveError``; and ``finalize`` commits nothing whose
archives are not all this save's (an ``ArchiveError``: the other save wrote
them). ``save_sharded`` also turns orbax's own
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
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxreshard._src.checkpoint import historycheck as _historycheck
from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import store as _store
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.distributed import sharded as _sharded
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, PlacementError, ReshardError
from jaxreshard._src.orbax import agreement as _agreement
from jaxreshard._src.orbax import args as _args
from jaxreshard._src.orbax import creation as _creation
from jaxreshard._src.orbax import peers as _peers
from jaxreshard._src.orbax.args import ReshardRestore, ReshardSave
from jaxreshard._src.orbax.inflight import Deferred, InFlight, StoppingFuture, one_save
from jaxreshard._src.progress import ProgressCallback, Reporter

__all__ = ["ReshardCheckpointHandler", "ReshardRestore", "ReshardSave"]


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """What one process writes for one save, with every byte already on the host."""

  checkpoint_id: str  # the same in every process of the save
  archives: tuple[tuple[int, ShardRecord], ...]  # (archive index, host record)
  index: dict | None  # the primary's; None elsewhere
  chunk_bytes: int | None
  reporter: Reporter  # told of each archive written
  # This process's refusal of its own data (or failure to copy it), in a
  # multi-process save: raised when its write begins, where every other process
  # hears of it (``_tell_peers``); raised in ``prepare_save`` it would leave
  # them waiting at orbax's barriers.
  refusal: BaseException | None = None


def _is_primary(primary_host: int | None) -> bool:
  return ocp.multihost.is_primary_host(primary_host)


def prepare_save(
  args: ReshardSave,
  primary_host: int | None = 0,
  *,
  progress: ProgressCallback | None = None,
  where: Any = "",
) -> SavePlan:
  """Everything a save needs from the caller's buffers, taken now (see the module doc).

  Each call is a new save: its own host copies and checkpoint identity, the
  same in every process. Its reporter tells ``progress`` (and the logger) of
  each archive written.
  """
  # The caller's arrays are read from here on: one freed since ``args`` was made
  # (a donating step) is named, as ``save_records`` names it.
  with _args.naming_deleted(args):
    checked = args._checks()
    clock = _agreement.clock_digest(checked) if args.state is not None else bytes(32)
    layout = _agreement.save_layout_digest(args, checked)
  primary = _is_primary(primary_host)
  what = "save_sharded" if args.state is not None else "ReshardSave"
  checkpoint_id, primary_clock, primary_layout = _agreement.shared_checkpoint_id(
    primary_host, clock, layout
  )
  index = None
  refusal = None
  try:
    if args.state is not None:
      try:
        with _args.naming_deleted(args):
          archives = tuple(sorted((r, _sharded.host_record(v)) for r, v in checked.views.items()))
        # A state's padding is data, seen first in these host copies; and every
        # process's clock must be the primary's, from which the index is made.
        for r, record in archives:
          _historycheck.check_record_data(r, record)
        if layout != primary_layout and primary_layout != bytes(32):
          raise PlacementError(
            f"process {jax.process_index()}'s state layout (its tree structure, params'"
            " shapes and dtypes, trainability, placements over the mesh axis) or mesh (its"
            " devices, their order, its axes) differs from the primary process's: the"
            " processes hold different states or pass different meshes"
          )
        if clock != bytes(32) and primary_clock != bytes(32) and clock != primary_clock:
          raise PlacementError(
            f"process {jax.process_index()}'s optimizer clock (its scalars' bits) differs"
            " from the primary process's: the processes hold states of different steps"
          )
      except Exception as e:  # pylint: disable=broad-exception-caught
        if jax.process_count() < 2:
          raise  # one process: refused before any directory is made (save_sharded)
        refusal, archives = e, ()
      if primary:
        # ``checked.tree`` holds the state's leaves now (``_checks`` made sure of it).
        index = _sharded.stamped_index(checked.index, checkpoint_id, checked.tree[1], checked.roles)
    elif primary:
      with _args.naming_deleted(args):
        archives = tuple((i, _sharded.host_record(r)) for i, r in enumerate(args.records))
      builder = _reader.IndexBuilder(checkpoint_id, _args.source_of(args.records))
      for i, record in archives:
        builder.add(i, record, pack=False)
      index = builder.index()
    else:
      archives = ()
      if layout != primary_layout:  # the primary's archives would not be this process's
        refusal = PlacementError(
          f"process {jax.process_index()}'s records (their placements, structure, dtypes"
          " or bits) differ from the primary process's, which writes every archive: a"
          " save of records needs the same records in every process"
        )
  except BaseException as e:
    _peers.tell_peers(checkpoint_id, e)  # the others stop waiting for this process
    raise
  reporter = Reporter(
    what,
    progress,
    where=where,
    total=len(archives),
    total_bytes=sum(_store.history_bytes(r) for _, r in archives),
  )
  return SavePlan(checkpoint_id, archives, index, args.chunk_bytes, reporter, refusal)


# How long a process whose directory went away looks for another process of its save
# having told a failure (whose cleanup removed it) before blaming another save.
_PEER_FAILURE_WAIT_S = 2.0

# A save that is over (failed or timed out in this process) says so to its writes.
_STOPPED = "the save failed (or timed out) in this process; its archive writes stopped"


def _unloadable(directory: str) -> Exception | None:
  """Why the checkpoint in ``directory`` would not load, or None: its index and every
  archive's metadata and files checked as a restore checks them (no chunk is read),
  and its archives one restorable set (ranks, clocks, structures, dtypes).
  Orbax makes it visible once ``finalize`` returns."""
  try:
    ckpt = _reader.open_unfinished(directory)
    for i in range(len(ckpt)):
      ckpt.check_archive(i)
      ckpt.check_files(i)
    if ckpt.source is None:  # a part of a reshard's output merges first
      _restore.validated_whole(ckpt)
  except ReshardError as e:
    return e
  return None


class ReshardCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves archives asynchronously from every process; restores them resharded.

  Args:
    chunk_bytes: bytes per stored chunk (the granularity of partial reads),
      unless ``ReshardSave.chunk_bytes`` says otherwise.
    multiprocessing_options: orbax's; its ``primary_host`` writes the index.
    timeout_secs: how long a process of a multi-process save waits for the
      others to tell that their archives are written (a process whose write
      fails tells at once); None: orbax's default asynchronous timeout.
    daemon_commits: whether the commit futures' threads are daemon threads,
      which a process's exit does not wait for. Orbax's own are not: a save
      left running finishes before the process ends. A caller that waits for
      every save itself (``save_sharded``) can let them be daemons, so that a
      save refused while orbax made its directory (whose commit thread then
      waits for that creation's signal until orbax's coordination timeout)
      does not hold the process's exit for minutes.
  """

  def __init__(
    self,
    chunk_bytes: int = _store.DEFAULT_CHUNK_BYTES,
    *,
    multiprocessing_options: ocp.options.MultiprocessingOptions = (
      ocp.options.MultiprocessingOptions()
    ),
    timeout_secs: float | None = None,
    daemon_commits: bool = False,
  ):
    _index.check_chunk_bytes(chunk_bytes)
    self._daemon_commits = daemon_commits
    self._chunk_bytes = chunk_bytes
    self._primary_host = multiprocessing_options.primary_host
    self._timeout_s = (
      ocp.options.AsyncOptions().timeout_secs if timeout_secs is None else timeout_secs
    )
    self._lock = threading.Lock()
    # Item directory -> (save identity, the index its finalize writes) (primary only).
    self._pending: dict[str, tuple[str, dict]] = {}
    # id(args) -> (args, what checking them found, their prepared save): the
    # saves ``prepare_save`` took ahead of ``async_save``, each taken by the next.
    self._prepared: dict[int, tuple[ReshardSave, Any, SavePlan]] = {}
    # The archive writes of its commit futures (each save's part of them), which
    # ``stop_writes`` ends.
    self._writes = InFlight()

  def stop_writes(self) -> None:
    """The saves of this handler are over (``save_sharded``'s, failed or not): every
    archive write still running stops at its next archive and is waited for (a
    minute at most), and none starts after. Orbax gives up on a save that timed out
    while its writes go on in their own thread."""
    self._writes.stop()

  def prepare_save(
    self, args: ReshardSave, *, progress: ProgressCallback | None = None, where: Any = ""
  ) -> SavePlan:
    """Takes the host copies of the next save of ``args`` now, before orbax makes a directory.

    The next ``async_save`` of the same ``args`` (unchanged since) writes
    this prepared save instead of taking new copies.
    """
    prepared = prepare_save(args, self._primary_host, progress=progress, where=where)
    with self._lock:
      self._prepared[id(args)] = (args, args._checks(), prepared)
    return prepared

  def _take_prepared(self, args: ReshardSave) -> SavePlan:
    """The save ``prepare_save`` took for ``args``, or a new one; either way a second is new."""
    with self._lock:
      found = self._prepared.pop(id(args), None)
    if found is not None and found[0] is args and found[1] is args._checks():
      return found[2]
    return prepare_save(args, self._primary_host)

  async def async_save(self, directory: epath.Path, args: ReshardSave):
    """Takes host copies now; returns the future that writes them (see the module doc).

    A refusal is raised once orbax's making of this save's directories is over.
    """
    key = os.fspath(directory)
    try:
      prepared = self._take_prepared(args)
      _store.check_save_path(_tempname.committed_path(key))  # as save_records checks
    except Exception:
      await _creation.await_directory_creation()
      raise
    if not prepared.reporter.where:  # a manager's save: its logs name the item directory
      prepared.reporter.where = key
    if prepared.index is not None:
      with self._lock:
        self._pending[key] = (prepared.checkpoint_id, prepared.index)
    work = InFlight(self._writes)
    # Made when orbax runs it: orbax runs none of a save refused in its directory's creation.
    write = Deferred(lambda: self._write(key, prepared, work))
    future = _commit_future(write, daemon=self._daemon_commits)
    # Orbax gives up on a save (its timeout) by no longer waiting for this future.
    return [StoppingFuture(future, one_save(_creation.operation_id(), work))]

  async def _write(self, directory: str, prepared: SavePlan, work: InFlight) -> None:
    """Writes this process's archives, tells the others, and waits for theirs; stops at
    the next archive once ``work`` (the save) is over."""
    chunk_bytes = prepared.chunk_bytes if prepared.chunk_bytes is not None else self._chunk_bytes
    builder = _reader.IndexBuilder(prepared.checkpoint_id)
    started = work.start()
    try:
      try:
        if not started:
          raise ArchiveError(f"{directory}: {_STOPPED}")
        if prepared.refusal is not None:
          raise prepared.refusal
        for index, record in prepared.archives:
          if work.stopped:
            raise ArchiveError(f"{directory}: {_STOPPED}")
          nbytes = _write_archive(
            directory, index, record, builder, chunk_bytes, prepared.checkpoint_id
          )
          prepared.reporter.step(nbytes, archive=index)
      except BaseException as e:
        _peers.tell_peers(prepared.checkpoint_id, e)
        raise
      _peers.tell_peers(prepared.checkpoint_id, None)
      _peers.await_peers(
        prepared.checkpoint_id,
        directory,
        self._timeout_s,
        lambda: _STOPPED if work.stopped else None,
      )
    finally:
      if started:
        work.done()

  def save(self, directory: epath.Path, args: ReshardSave) -> None:
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
    _peers.forget(checkpoint_id)  # every process told and was heard
    missing = [
      name
      for name, _, _ in index["archives"]
      if not os.path.isfile(os.path.join(key, name, _reader.ARCHIVE_FILE))
    ]
    if missing:
      raise ArchiveError(f"{key}: archives {missing[:8]} were not written; nothing is committed")
    _reader.dump_index(key, index)
    # Checked as a restore checks it, this save's index beside the archives found
    # there: an archive another save of this directory wrote (orbax gives both the
    # same temporary directory) belongs to another checkpoint, and is refused.
    problem = _unloadable(key)
    if problem is not None:
      for name in (_reader.INDEX_FILE, _table.TABLE_FILE):
        try:
          os.unlink(os.path.join(key, name))
        except FileNotFoundError:
          pass
      raise ArchiveError(
        f"{key}: the checkpoint written does not load ({problem}); nothing is committed"
      )

  def restore(self, directory: epath.Path, args: ReshardRestore | None = None) -> Any:
    """Every archive, one target rank's archive, or the state laid out on a mesh.

    Raises:
      ArchiveError: the item directory is a symbolic link (see ``_item_directory``).
    """
    directory = _item_directory(directory)
    args = args if args is not None else ReshardRestore()
    if args.mesh is not None:
      extra = {} if args.target is None else {"target": args.target}
      if args.optimizer is not None:
        extra.update(optimizer=args.optimizer, params=args.params)
      return _sharded.restore_sharded(
        directory, args.mesh, args.axis, like=args.like, **extra
      ).state
    if args.rank is None:
      return _store.load_records(directory)
    return _restore.restore(directory, world_size=args.world_size, rank=args.rank)

  def metadata(self, directory: epath.Path) -> Any:
    """Every archive's placements, clocks and lazy buffers (no array data read)."""
    return _store.open_checkpoint(_item_directory(directory))


def _write_archive(
  directory: str, index: int, record: Any, builder: Any, chunk_bytes: int, checkpoint_id: str
) -> int:
  """``write_archive``: its bytes written; a file or directory another save made or
  removed under it is named as that save's doing, or as the failure of another
  process of this save (which removes what the save made) when one told it."""
  try:
    return _reader.write_archive(directory, index, record, builder, chunk_bytes)
  except FileExistsError as e:
    raise ArchiveExistsError(
      f"{e.filename} already exists: another save is writing {directory}"
    ) from None
  except FileNotFoundError:
    if os.path.isdir(directory):
      raise
    told = _peers.failure_told(checkpoint_id, _PEER_FAILURE_WAIT_S)
    if told is not None:
      raise ArchiveError(
        f"{directory} was removed while this save wrote it: {told}; nothing is committed"
      ) from None
    raise ArchiveError(
      f"{directory} was removed while this save wrote it: another save"
      " of the same checkpoint made it anew"
    ) from None


def _commit_future(coro, *, daemon: bool) -> ocp.future.Future:
  """Orbax's commit future of ``coro``, made in a daemon thread when its thread
  is to be a daemon (a thread is one when the thread that makes it is)."""

  def make():
    return ocp.future.CommitFutureAwaitingContractedSignals(coro, name="jaxreshard_save")

  if not daemon:
    return make()
  made: list = []

  def make_into() -> None:
    try:
      made.append(make())
    except BaseException as e:  # pylint: disable=broad-exception-caught
      made.append(e)

  maker = threading.Thread(target=make_into, name="jaxreshard_save_maker", daemon=True)
  maker.start()
  maker.join()
  if isinstance(made[0], BaseException):
    coro.close()
    raise made[0]
  return made[0]


def _item_directory(directory: Any) -> str:
  """The item directory orbax gives the handler, refused when it is a symbolic link.

  Orbax names the item directory inside its step directory; what is found
  there is part of the checkpoint, which is untrusted: a link would make the
  restore read another checkpoint (or anything) in its place.
  """
  path = os.fspath(directory)
  if os.path.islink(path):
    raise ArchiveError(
      f"{path}: the checkpoint item is a symbolic link (to"
      f" {os.readlink(path)!r}); a checkpoint's item directory is never one"
    )
  return path


def _run_sync(coro) -> None:
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  asyncio_utils.run_sync(coro)


# The arguments name this handler, so an orbax manager picks it from them alone.
ocp.args.register_with_handler(ReshardCheckpointHandler, for_save=True)(ReshardSave)
ocp.args.register_with_handler(ReshardCheckpointHandler, for_restore=True)(ReshardRestore)

"""Multi-host save of flat-sharded optax state on a JAX mesh.

Each process writes only the archives of the ranks it owns and the primary
process writes the index; the save is an orbax save of the
``ReshardCheckpointHandler``, so orbax's barriers and its commit (a temporary
directory renamed into place by the primary once every process finished) make
it atomic across hosts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from jaxreshard._src.checkpoint import archives as _archives
from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import store as _store
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, ReshardError
from jaxreshard._src.orbax import durable as _durable
from jaxreshard._src.orbax import handler as _handler
from jaxreshard._src.orbax import peers as _peers
from jaxreshard._src.progress import ProgressCallback, check_callback

__all__ = ["save_sharded"]

# How long a process waits for the others to finish writing, by default.
DEFAULT_TIMEOUT_S = 300
# The longest wait: orbax and the runtime take timeouts as 32-bit milliseconds or
# ``timedelta``s, and a longer one made the save fail inside orbax (an
# ``OverflowError``); 24.8 days stands for any longer one.
MAX_TIMEOUT_S = (2**31 - 1) // 1000


@_deleted.names_deleted
def save_sharded(
  directory: os.PathLike | str,
  optimizer: optax.GradientTransformation,
  state: optax.OptState,
  shapes: Mapping[str, Any],
  mesh: Mesh,
  axis: str = "fsdp",
  *,
  chunk_bytes: int = _store.DEFAULT_CHUNK_BYTES,
  timeout_s: float = DEFAULT_TIMEOUT_S,
  progress: ProgressCallback | None = None,
) -> None:
  """Saves a global flat-sharded state as one checkpoint of ``M`` archives, from every process.

  Call it in every process with the same arguments (the processes meet by the
  directory's last two components, symbolic links resolved, and how many saves of
  them each made before: a process that misses a save fails only that save in the
  others, once ``timeout_s`` passes). It is an orbax
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
      A bare shape takes the storage dtype the param's history buffers share;
      a param with none, or with several (``adam(mu_dtype=...)``), is refused
      (``DtypeError``): give its dtype.
    mesh: the mesh of ``state``.
    axis: the mesh axis of the flat shards.
    chunk_bytes: bytes per stored chunk, the granularity of partial reads.
    timeout_s: how long a process waits for the others to come to the save,
      and to finish writing (a process whose write fails tells the others at
      once, and they raise); one longer than ``MAX_TIMEOUT_S`` (24.8 days)
      waits that long.
    progress: called with a :class:`jaxreshard.Progress` after each archive
      this process writes (from orbax's writer thread; the save returns after
      the last); each is also logged at DEBUG, the save at INFO, to the
      ``"jaxreshard"`` logger.

  Raises:
    ArchiveExistsError: ``directory`` already exists, or another save of it is
      in progress. Each process looks on its own; the first process that
      refuses is named, and every process raises the same error at once.
    FileNotFoundError: its parent directory does not exist (likewise).
    ReshardError: a state that does not match ``shapes``, or a clock leaf
      (not a history) whose parts other processes hold: every archive holds the
      whole clock, so replicate it (raised before anything is written; one laid
      out over this process's devices alone is saved whole); ``ArchiveError``
      when the checkpoint was not committed (a process failed, or did not
      finish within ``timeout_s``), or not started (a process did not come to
      it within ``timeout_s``). Arguments of the wrong kind (a directory
      that is not a path, ``timeout_s`` not a positive number, ``shapes`` not
      a mapping of str ids, an optimizer not called) are refused by name; in
      every process at once, naming it, when one process refuses its own
      (except a directory that is not a path, which gives that process no name
      to meet the others by: it raises at once, the others once ``timeout_s``
      passes).

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
  try:
    final = _checked(directory, chunk_bytes, progress, timeout_s)
  except ReshardError as e:
    # Every process takes part in each save's agreement, this refusal included: one
    # that left it out would put its later saves of this name out of step.
    _agree(e, _where(directory), DEFAULT_TIMEOUT_S)
    raise
  timeout_s = min(timeout_s, MAX_TIMEOUT_S)
  commit = _durable.one_save()  # its temporary directories' locks go when the save ends
  args, looked = _agree_to_start(
    final,
    commit,
    timeout_s,
    optimizer=optimizer,
    state=state,
    shapes=shapes,
    mesh=mesh,
    axis=axis,
    chunk_bytes=chunk_bytes,
  )
  timeout = max(1, int(timeout_s))
  # This call waits for its save: nothing is left for the process's exit to wait for
  # but the commit thread of a save refused while orbax made its directory.
  handler = _handler.ReshardCheckpointHandler(timeout_secs=timeout, daemon_commits=True)
  # Refusals of the state, host copies and the index, before any directory exists.
  checkpointer = ocp.AsyncCheckpointer(handler, timeout_secs=timeout, temporary_path_class=commit)
  try:
    prepared = handler.prepare_save(args, progress=progress, where=final)
    looked()  # every process is past the agreement (prepare_save's collective)
    checkpointer.save(final, args=args)
    checkpointer.wait_until_finished()
    if ocp.multihost.is_primary_host(0):  # the process that renamed it
      _check_committed(final, prepared.checkpoint_id)
    prepared.reporter.finish()
  except ReshardError:
    raise
  except FileExistsError as e:  # another save of ``directory`` made orbax's directories first
    raise ArchiveExistsError(
      f"save_sharded: {final} was not committed: another save is writing it ({e})"
    ) from e
  except Exception as e:  # orbax's and the runtime's error types
    why = f"{type(e).__name__}: {e}"
    if os.path.lexists(final):  # another process's rename came before the failure
      raise ArchiveError(
        f"save_sharded: {final} exists, but this process could not see its save through"
        f" ({why}); it may be complete or another save's: read it (a restore, or"
        " jaxreshard verify) before trusting it or saving there again"
      ) from e
    raise ArchiveError(f"save_sharded: {final} was not committed ({why})") from e
  finally:
    # A directory creation orbax still runs for a failed save needs orbax's
    # threads: it ends before orbax closes, and what it made goes with the rest
    # once orbax's last writes into the directory are done.
    commit.end_creations()
    # Orbax gives up on a save that timed out while its archive writes go on in
    # their thread: they stop before the directory is removed (or saved again).
    handler.stop_writes()
    try:
      checkpointer.close()
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # the error, if any, was raised above
    commit.let_go()


def _checked(directory: Any, chunk_bytes: Any, progress: Any, timeout_s: Any) -> str:
  """``directory`` as an absolute path, once the arguments checked before the save
  starts are good; raises ``ReshardError`` naming the first that is not."""
  _index.check_chunk_bytes(chunk_bytes)
  check_callback(progress)
  final = _archives.path_arg(directory)
  _store.check_save_path(final)
  if (
    isinstance(timeout_s, bool)
    or not isinstance(timeout_s, (int, float))
    or not (0 < timeout_s < math.inf)
  ):
    raise ReshardError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
  return final


def _agree_to_start(final: str, commit: Any, timeout_s: float, **save: Any) -> tuple[Any, Any]:
  """The save's ``ReshardSave`` of ``save``, and the function that forgets the agreement,
  once every process agreed to start it (``_peers.agree_to_start``).

  Each process looks on its own (another job's save may commit the directory
  between two looks) and checks its arguments (without a collective): a refusal of
  any process is every process's, at once, where one refusing alone would leave the
  others waiting in the save's collectives. An error while it looks (the storage's
  ``OSError``, say) is its refusal too: raised unchanged in a single process.
  """
  args = None
  try:
    refusal = _refusal(final, os.fspath(commit.from_final(epath.Path(final)).get()))
  except Exception as e:  # pylint: disable=broad-exception-caught
    refusal = e
  if refusal is None:
    try:
      args = _handler.ReshardSave(**save)
    except Exception as e:  # pylint: disable=broad-exception-caught
      refusal = e  # raised unchanged in a single process
  return args, _agree(refusal, final, timeout_s)


def _agree(refusal: BaseException | None, where: str, timeout_s: float) -> Any:
  """``_peers.agree_to_start``: the save's verdict raised as it comes (one process:
  its own refusal, unchanged); where the runtime fails to tell it, this process's
  refusal, or an ``ArchiveError`` that the save was not started."""
  try:
    return _peers.agree_to_start(refusal, where, timeout_s)
  except (ReshardError, FileNotFoundError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    if e is refusal:
      raise
    if refusal is not None:
      raise refusal from e
    raise ArchiveError(f"save_sharded: {where} was not started ({type(e).__name__}: {e})") from e


def _where(directory: Any) -> str:
  """``directory`` as words, whatever it is: the save's name in its agreement, where the
  arguments were refused before it became a path."""
  try:
    return os.fsdecode(os.fspath(directory))
  except Exception:  # pylint: disable=broad-exception-caught
    return str(directory)


def _refusal(final: str, tmp: str) -> Exception | None:
  """Why this process refuses to save to ``final`` (``tmp``: orbax's temporary
  directory of it), or None."""
  if os.path.lexists(final):
    return ArchiveExistsError(f"{final} already exists; jaxreshard never overwrites a checkpoint")
  if not os.path.isdir(os.path.dirname(final)):
    return FileNotFoundError(f"parent directory {os.path.dirname(final)} of {final} does not exist")
  try:
    _durable.refuse_if_held(tmp, final)  # a live save of it
  except ArchiveExistsError as e:
    return e
  return None


def _check_committed(final: str, checkpoint_id: str) -> None:
  """The directory orbax committed holds this save's index (read as a restore reads
  it). Another save of the same directory shares orbax's temporary directory and
  may remove and make it anew between this save's last check and the rename:
  then what was committed is not this save, and the save is not reported done."""
  try:
    found = _store.open_checkpoint(final).id
  except (ReshardError, OSError) as e:
    raise ArchiveError(
      f"save_sharded: {final} was committed without this save's index ({e})"
    ) from e
  if found != checkpoint_id:
    raise ArchiveError(
      f"save_sharded: {final} holds checkpoint {found!r}, not this save's {checkpoint_id!r}:"
      " another save of it raced with this one"
    )

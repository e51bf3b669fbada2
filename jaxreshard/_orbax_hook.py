"""jaxreshard archives as an orbax checkpoint item, registered the way orbax expects.

``ReshardSave`` and ``ReshardRestore`` are ``CheckpointArgs`` registered with
``ReshardCheckpointHandler`` through ``ocp.args.register_with_handler``, so an
``ocp.CheckpointManager`` (or ``Checkpointer``, or one item of a
``Composite``) picks the handler from the arguments alone. Orbax owns the step
directories, the atomic commit and ``max_to_keep``; the handler writes and
reads the jaxreshard layout inside the item directory it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import orbax.checkpoint as ocp
from etils import epath

from jaxreshard import _archive_io, _restore
from jaxreshard._errors import ArchiveExistsError
from jaxreshard._record import ShardRecord

__all__ = ["ReshardCheckpointHandler", "ReshardRestore", "ReshardSave"]


class ReshardCheckpointHandler(ocp.CheckpointHandler):
  """Saves every rank's archive; restores all of them or one resharded target rank."""

  def __init__(self, chunk_bytes: int = _archive_io.DEFAULT_CHUNK_BYTES):
    self._chunk_bytes = chunk_bytes

  def save(self, directory: epath.Path, args: "ReshardSave") -> None:
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
      raise ArchiveExistsError(f"{directory} is not empty")
    _archive_io.write_checkpoint(
        directory, args.records,
        chunk_bytes=args.chunk_bytes if args.chunk_bytes is not None else self._chunk_bytes)

  def restore(self, directory: epath.Path, args: Optional["ReshardRestore"] = None) -> Any:
    if args is None or args.rank is None:
      return _archive_io.load_records(directory)
    if args.world_size is None:
      raise ValueError("ReshardRestore(rank=...) needs world_size as well")
    return _restore.restore(directory, rank=args.rank, world_size=args.world_size)

  def metadata(self, directory: epath.Path) -> Any:
    """Every archive's placements, clocks and lazy buffers (no array data read)."""
    return _archive_io.open_checkpoint(directory)


@ocp.args.register_with_handler(ReshardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ReshardSave(ocp.args.CheckpointArgs):
  """Save every rank's archive as one orbax checkpoint item.

  Attributes:
    records: the archives, any iterable (written one at a time).
    chunk_bytes: bytes per stored chunk (the granularity of partial reads);
      None keeps the handler's default.

  Examples:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, jaxreshard as jr
    >>> params = {"w": jnp.arange(8.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=4)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    ...   _ = manager.save(100, args=ReshardSave(records))
    ...   manager.wait_until_finished()
    ...   target = manager.restore(100, args=ReshardRestore(rank=0, world_size=3))
    >>> target.state[0].mu["w"].shape
    (3,)
  """

  records: Iterable[ShardRecord]
  chunk_bytes: Optional[int] = None


@ocp.args.register_with_handler(ReshardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ReshardRestore(ocp.args.CheckpointArgs):
  """Restore one target rank (``rank`` and ``world_size``), or every archive (both None).

  Attributes:
    rank: the target rank to build, or None for ``load_records``.
    world_size: the target world size.
  """

  rank: Optional[int] = None
  world_size: Optional[int] = None

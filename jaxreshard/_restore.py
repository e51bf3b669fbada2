"""Restore target ranks straight from a checkpoint, reading only what they need.

The core's validation runs on records whose history buffers are still on disk
(``LazyBuffer``: shape and dtype, no data), so every refusal of ``reshard``
holds. Only then are the overlapping ``[lo, hi)`` ranges of the overlapping
source buffers read (tensorstore partial reads, chunk-granular) and handed to
the core's gather kernels as ``Piece(partial, 0, hi - lo)``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax

from jaxreshard import _kernels, _reshard, _validate
from jaxreshard._archive_io import Checkpoint, LazyBuffer, Reader, open_checkpoint
from jaxreshard._errors import PlacementError
from jaxreshard._record import ShardRecord
from jaxreshard._reshard import plan

__all__ = ["restore", "restore_ranks"]


def restore(directory: Any, rank: int, world_size: int) -> ShardRecord:
  """One target rank's archive, built from a checkpoint on disk.

  Reads the metadata of every archive (small JSON: placements, clocks), then
  only the history buffers of source archives that overlap the target rank,
  and inside those only the chunks covering the overlapping ranges.

  Args:
    directory: a checkpoint written by ``save_records``.
    rank: the target rank.
    world_size: the target world size (every parameter).

  Returns:
    The same record as ``reshard(load_records(directory), plan(..., world_size, rank))``.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: every refusal of ``reshard`` (``PlacementError``,
      ``ShapeError``) and every archive fault of ``load_records``.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0)}
    >>> opt = optax.adam(1e-3)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
    >>> target = restore(path, rank=1, world_size=3)
    >>> target.placements[0].rank, target.state[0].mu["w"].shape
    (1, (4,))
  """
  return restore_ranks(directory, [rank], world_size)[0]


def restore_ranks(
    directory: Any,
    ranks: Sequence[int],
    world_size: int,
    *,
    checkpoint: Optional[Checkpoint] = None,
    reader: Optional[Reader] = None,
) -> list[ShardRecord]:
  """Several target ranks of one layout, opening each source array at most once.

  For one process that hosts several target ranks (multi-host restore): the
  metadata is read and validated once, every source array opened at most once
  (``reader`` caches open arrays), and each rank reads only its own ranges.

  Args:
    directory: a checkpoint written by ``save_records``.
    ranks: target ranks to build, in the order returned.
    world_size: the target world size of every parameter.
    checkpoint: the result of ``_archive_io.open_checkpoint(directory)``, when
      the caller already has it (skips re-reading the metadata).
    reader: an ``_archive_io.Reader`` to share open arrays across calls.

  Returns:
    One ``ShardRecord`` per entry of ``ranks``.

  Raises:
    FileNotFoundError, ReshardError: as ``restore``.
  """
  ckpt = checkpoint if checkpoint is not None else open_checkpoint(directory)
  records = list(ckpt.records)
  if not records:
    raise PlacementError("no archives supplied")
  anatomies = [_validate.check_archive(i, r) for i, r in enumerate(records)]
  reader = reader if reader is not None else Reader()
  return [_restore_one(records, anatomies, plan(records, world_size, rank), reader)
          for rank in ranks]


def _restore_one(records, anatomies, migrations, reader: Reader) -> ShardRecord:
  groups = _reshard.validate_migrations(records, anatomies, migrations)
  # Every buffer of every involved archive against its file's size (a stat,
  # no read), so no metadata size is trusted before anything is allocated.
  for s in sorted({s for g in groups for s in g.by_rank}):
    for leaf in jax.tree.leaves(records[s].state):
      if isinstance(leaf, LazyBuffer):
        leaf.check_file()
  requests = _reshard.copy_requests(groups, anatomies)
  flat = [rng for r in requests for rng in r.ranges]
  data = iter(reader.read(flat))
  outputs = []
  for r in requests:
    parts = [next(data) for _ in r.ranges]
    outputs.append(_kernels.Output(
        r.shape, r.dtype, tuple(_kernels.Piece(d, 0, len(d)) for d in parts)))
  buffers = _kernels.assemble(outputs)
  del outputs, data
  return _reshard.build_record(groups, anatomies, requests, buffers)

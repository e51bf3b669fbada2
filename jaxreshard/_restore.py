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
import numpy as np

from jaxreshard import _kernels, _structure, _validate
from jaxreshard._archive_io import Checkpoint, LazyBuffer, Reader, open_checkpoint
from jaxreshard._errors import PlacementError
from jaxreshard._placement import ParamPlacement
from jaxreshard._record import FORMAT_VERSION, ShardRecord
from jaxreshard._reshard import plan

__all__ = ["restore", "restore_ranks"]


class _ScalarRole:
  pass


_SCALAR = _ScalarRole()


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
  # Validation: exactly the core's sequence in ``reshard``.
  groups = sorted(
      (_validate.check_migration(m, records, anatomies) for m in migrations),
      key=lambda g: g.migration.param,
  )
  involved: dict[int, str] = {}
  for g in groups:
    for s in g.by_rank:
      involved.setdefault(s, g.migration.param)
  _validate.check_clocks(sorted(involved), anatomies, involved)
  # Every buffer of every involved archive against its file's size (a stat,
  # no read), so no metadata size is trusted before anything is allocated.
  for s in sorted(involved):
    for leaf in jax.tree.leaves(records[s].state):
      if isinstance(leaf, LazyBuffer):
        leaf.check_file()

  requests: list[tuple[LazyBuffer, int, int]] = []
  plans = []  # per output: (pid, mirror, shape, dtype, [request index, ...])
  for g in groups:
    pid = g.migration.param
    t, src = g.target, g.source
    histories = [anatomies[s].history(pid) for s in g.by_rank]
    for m, present in enumerate(g.history):
      if present is not True:
        continue
      parts = []
      for r, hist in enumerate(histories):
        lo = max(t.start, r * src.slots)
        hi = min(t.stop, (r + 1) * src.slots, src.count)
        if lo < hi:
          parts.append(len(requests))
          requests.append((hist[m], lo - r * src.slots, hi - r * src.slots))
      plans.append((pid, m, (t.slots,), np.dtype(histories[0][m].dtype), parts))
  data = reader.read(requests)
  outputs = [
      _kernels.Output(shape, dtype, tuple(_kernels.Piece(data[k], 0, len(data[k])) for k in parts))
      for _, _, shape, dtype, parts in plans
  ]
  built = dict(zip([(pid, m) for pid, m, *_ in plans], _kernels.assemble(outputs)))
  del data

  template = anatomies[groups[0].by_rank[0]] if groups else anatomies[0]
  n_mirrors = len(template.mirrors)
  histories: dict[str, list[Any]] = {}
  role_histories: dict[str, list[Any]] = {}
  for g in groups:
    pid = g.migration.param
    histories[pid] = [built.get((pid, m), g.history[m]) for m in range(n_mirrors)]
    role_histories[pid] = [pid if g.history[m] is True else g.history[m] for m in range(n_mirrors)]
  state = _structure.build_state(template, histories)
  role_tree = _structure.build_state(
      template, role_histories, scalars=[_SCALAR] * len(template.scalars))
  roles = tuple(None if x is _SCALAR else x for x in jax.tree.leaves(role_tree))
  placements = tuple(
      ParamPlacement(g.migration.param, g.target.shape, g.target.rank, g.target.world_size,
                     g.dtype, g.trainable)
      for g in groups
  )
  return ShardRecord(version=FORMAT_VERSION, placements=placements, state=state, roles=roles)

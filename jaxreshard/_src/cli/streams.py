"""What the commands that read whole checkpoints stream, counted on a progress bar."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import store as _store
from jaxreshard._src.checkpoint import summary as _summary

__all__ = ["counted", "targets"]


def counted(path: str, name: str, bar: Any, task: Any) -> Iterator[Any]:
  """The records of the whole checkpoint at ``path`` (``verify`` reads it), the
  bar named ``name`` and advanced by each record's history bytes once it is taken
  (a typed PRNG key in the clock has no numpy form to count)."""
  bar.update(task, description=name)
  for record in _summary.complete_records(path, "verify"):
    yield record
    bar.advance(task, _store.history_bytes(record))


def targets(
  source: Any, ckpt: Any, ranks: Any, world_size: int, total: int, bar: Any, task: Any
) -> Iterator[Any]:
  """The target ranks, restored a batch at a time (each source buffer read once per
  batch; a batch holds about ``BATCH_BYTES``) and handed on one at a time, the
  progress bar naming and counting each rank as the save takes it (and the whole
  batch while it is read, so that a refusal there names no one rank)."""
  # Each rank is planned once, by its restore, which also counts the bytes it moved.
  n = max(1, _restore.BATCH_BYTES // max(1, -(-total // len(ranks))))
  for at in range(0, len(ranks), n):
    batch = ranks[at : at + n]
    named = f"rank {batch[0]}" if len(batch) == 1 else f"ranks {batch[0]}-{batch[-1]}"
    bar.update(task, description=f"{named}/{world_size}")
    done: list[Any] = []
    built = _restore.restore_ranks(
      source, batch, world_size=world_size, checkpoint=ckpt, progress=done.append
    )
    moved = 0
    for r, record, step in zip(batch, built, done):
      bar.update(task, description=f"rank {r}/{world_size}")
      yield record
      bar.advance(task, step.done_bytes - moved)  # after save_records has taken this rank
      moved = step.done_bytes

"""Saving and loading whole checkpoints: every rank's archive, atomically.

The on-disk format (index, archives, one buffer per rank and dtype) is
``_checkpoint``'s; this module adds the atomic commit: a checkpoint is written
into a hidden sibling directory and renamed into place only when complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Iterable

from jaxreshard._checkpoint import DEFAULT_CHUNK_BYTES, open_checkpoint, write_checkpoint
from jaxreshard._errors import ArchiveExistsError, ReshardError
from jaxreshard._record import ShardRecord

__all__ = ["DEFAULT_CHUNK_BYTES", "load_records", "new_temp_dir", "open_checkpoint",
           "save_records", "write_checkpoint"]


def new_temp_dir(final: str) -> str:
  """Creates the hidden sibling a checkpoint is written into before its rename.

  Raises:
    ArchiveExistsError: ``final`` exists (a checkpoint is never overwritten).
    FileNotFoundError: its parent directory does not exist.
  """
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} already exists; jaxreshard never overwrites a checkpoint")
  parent = os.path.dirname(final)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"parent directory {parent} of {final} does not exist")
  tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex}")
  os.mkdir(tmp)
  return tmp


def save_records(directory: Any, records: Iterable[ShardRecord], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
  """Saves every rank's archive as one checkpoint directory, atomically.

  Each archive is one buffer per dtype (all of the rank's history buffers back
  to back, a crc32c per chunk) plus a small metadata file; one index describes
  the whole layout. Files grow with ranks x dtypes, not with parameters.

  Args:
    directory: the checkpoint directory to create; it must not exist.
    records: the archives, in any iterable (a generator is written one record
      at a time, so a whole reshard never needs every rank in memory). Archive
      ``i`` is the ``i``-th record yielded.
    chunk_bytes: bytes per stored chunk, the granularity of partial reads.

  Raises:
    ArchiveExistsError: ``directory`` already exists.
    FileNotFoundError: its parent directory does not exist.
    ReshardError: a record that cannot be stored (no records, an invalid
      archive, a state node type the format cannot re-create).

  Everything is written into a temporary sibling directory that is renamed to
  ``directory`` at the very end: a failed or killed save leaves no
  ``directory`` behind (at most a ``.NAME.tmp-*`` sibling, never loadable).

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, records)
    >>> [r.state[0].mu["w"].shape for r in load_records(path)]
    [(3,), (3,)]
  """
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
    raise ReshardError(f"chunk_bytes {chunk_bytes!r} must be a positive integer")
  final = os.path.abspath(os.fspath(directory))
  tmp = new_temp_dir(final)
  try:
    write_checkpoint(tmp, records, chunk_bytes=chunk_bytes)
    if os.path.lexists(final):
      raise ArchiveExistsError(f"{final} appeared while it was being written")
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def load_records(directory: Any) -> list[ShardRecord]:
  """Loads every archive of a checkpoint, exactly as it was saved.

  Needs neither the optimizer nor the model: the state's tree structure,
  placements, roles and clock scalars come from the checkpoint's index. Each
  archive's history buffers are numpy views of its buffers, read straight from
  the files and checked chunk by chunk.

  Args:
    directory: a checkpoint written by ``save_records``.

  Returns:
    The records, archive 0 first.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: not a jaxreshard checkpoint, a missing archive, an archive of
      another version, a truncated, corrupted or inconsistent file.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(3.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=3))
    >>> [r.placements[0].rank for r in load_records(path)]
    [0, 1, 2]
  """
  ckpt = open_checkpoint(directory)
  for i in range(len(ckpt)):
    ckpt.check_archive(i)
  for i in range(len(ckpt)):  # every archive's metadata and file sizes before any allocation
    ckpt.check_files(i)
  return [ckpt.record(i) for i in range(len(ckpt))]

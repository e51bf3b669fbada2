"""What a checkpoint holds, as the facts ``jaxreshard inspect`` and ``verify`` report.

Everything here reads a checkpoint's index (or a digest): parameters with
their logical and stored bytes, the optimizer clock, whether the archives
agree on it, and the refusal of a partial checkpoint where a whole one is
needed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import values as _values
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.errors import ArchiveError, PlacementError, ReshardError

__all__ = [
  "clock_facts",
  "complete_records",
  "digest_counts",
  "disk_usage",
  "inspect_info",
  "refuse_problems",
]


def _param_entries(ckpt: _reader.Checkpoint) -> dict[str, dict]:
  """Each parameter's facts, its bytes logical and stored (with padding) over every group."""
  params: dict[str, dict] = {}
  for g in ckpt.groups:
    if not g.ranks:
      continue
    archive0 = g.ranks[0][0]
    ranks = np.array([r for _, r in g.ranks], np.int64)
    complete = len(ranks) == g.world_size
    for p in g.params:
      e = ckpt.params[p]
      dtypes = [h.dtype for h in ckpt.history(archive0, e.param) if isinstance(h, _reader.LeafInfo)]
      itemsize = sum(d.itemsize for d in dtypes)
      count = int(np.prod(e.shape, dtype=np.int64))
      slots = FlatShard(e.shape, 0, g.world_size).slots
      # The elements the group's ranks own: all of them, or (a checkpoint of some
      # target ranks only) each rank's ``min(slots, count - rank * slots)``.
      owned = count if complete else int(np.clip(count - ranks * slots, 0, slots).sum())
      entry = params.setdefault(
        e.param,
        dict(
          param=e.param,
          shape=list(e.shape),
          dtype=np.dtype(e.dtype).name,
          trainable=bool(e.trainable),
          world_sizes=[],
          ranks=[],
          buffers=[d.name for d in dtypes],
          bytes=0,
          stored_bytes=0,
        ),
      )
      if g.world_size not in entry["world_sizes"]:
        entry["world_sizes"].append(g.world_size)
      entry["ranks"].extend(ranks.tolist())
      entry["bytes"] += owned * itemsize
      entry["stored_bytes"] += slots * itemsize * len(ranks)
  for e in params.values():
    e["ranks"].sort()
  return params


def inspect_info(ckpt: _reader.Checkpoint) -> dict:
  """The machine-readable description ``inspect --json`` prints (index only)."""
  params = _param_entries(ckpt)
  disk_bytes, files = disk_usage(ckpt.directory)
  return dict(
    archives=len(ckpt),
    world_sizes=sorted({w for e in params.values() for w in e["world_sizes"]}),
    params=[params[k] for k in sorted(params)],
    bytes=sum(e["bytes"] for e in params.values()),
    stored_bytes=sum(e["stored_bytes"] for e in params.values()),
    disk_bytes=disk_bytes,
    files=files,
    clocks=clock_facts(ckpt.metadata_record(0)),
    clocks_agree=len({ckpt.clock_class(i) for i in range(len(ckpt))}) == 1,
    source=None if ckpt.source is None else ckpt.source.to_json(),
  )


def clock_facts(record: Any) -> list[dict]:
  """Each clock scalar of an archive; an array of many elements by its first ones."""
  out = []
  leaves = _digest.clock_leaves(record)
  names = _clock.clock_names(record.state, [path for path, _ in leaves])
  for (path, x), name in zip(leaves, names):
    a = _clock.plain(x)  # a typed PRNG key: its key data, under its own dtype (key<fry>)
    value, cut = _values.clock_value(a)
    shown = a.reshape(-1)[: _values.CLOCK_ELEMENTS_SHOWN] if cut else a
    out.append(
      dict(
        path=path,
        name=name,
        dtype=str(x.dtype) if _clock.is_key(x) else a.dtype.name,
        shape=list(a.shape),
        value=value,
        bits=_digest.raw_bits(shown).tobytes().hex(),
        truncated=cut,
        # How jax promotes it, which the digest and ``verify`` tell apart too.
        weak=_clock.is_weak(x),
      )
    )
  return out


def disk_usage(directory: Any) -> tuple[int, int]:
  """The bytes and number of the files under a checkpoint directory, as the file system sizes them.

  Every regular file counts at its ``st_size``: the index, each archive's
  metadata, its buffer files with their chunks' checksums and rounding. Links
  are not followed and count nothing.
  """
  total = files = 0
  for root, _, names in os.walk(directory):
    for name in names:
      st = os.lstat(os.path.join(root, name))
      if stat.S_ISREG(st.st_mode):
        total += st.st_size
        files += 1
  return total, files


def complete_records(path: Any, needs: str) -> Iterator[ShardRecord]:
  """The records of a whole checkpoint, read one archive at a time (one held at once).

  Args:
    path: the checkpoint directory.
    needs: what needs it whole, for the refusal (``verify``).

  Raises:
    PlacementError: a partial checkpoint (some ranks of a reshard), or archives
      that do not form complete groups.
  """
  ckpt = _reader.open_checkpoint(str(path))
  _merge.refuse_partial(path, ckpt)
  try:
    ckpt.complete_groups()
  except PlacementError as e:
    raise PlacementError(f"{path} is not a complete checkpoint, which {needs} needs: {e}") from None
  try:
    # Every refusal a restore of it makes (dtypes, clocks, histories): what no
    # restore returns is not a state to compare.
    _restore.validated_whole(ckpt)
  except ReshardError as e:
    raise type(e)(f"{path}: {e}") from None
  yield from _digest.checkpoint_records(ckpt)


def digest_counts(d: _digest.Digest) -> tuple[int, int]:
  """The number of history buffers of a digest's state, and of their elements."""
  buffers = sum(len(p.buffers) for p in d.params.values())
  elements = sum(x.count for p in d.params.values() for x in p.buffers)
  return buffers, elements


def refuse_problems(path: Any, d: _digest.Digest) -> None:
  """Refuses a checkpoint whose digest has problems: nonzero padding, archives that disagree.

  Such a checkpoint is not one state: an error, never an answer (even compared
  with itself).
  """
  if d.problems:
    more = len(d.problems) - 1
    raise ArchiveError(
      f"{path} is not a valid checkpoint: {d.problems[0]}"
      + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")
    )

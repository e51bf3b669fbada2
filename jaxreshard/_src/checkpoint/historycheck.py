"""What a save checks of an archive's history buffers before writing them: each is
``(slots,)`` of its rank's flat layout, of a stored dtype, and zero past what its
rank owns. A reader refuses anything else, so a save never writes it."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import MAX_COUNT, MAX_WORLD_SIZE, FlatShard
from jaxreshard._src.exec import host as _host_exec

__all__ = ["check_histories", "check_record_data"]


def check_histories(index: int, state_parts: Any, placements: dict) -> None:
  """Every history buffer of archive ``index`` is ``(slots,)`` of its rank's layout and
  zero past what its rank owns (``_validate.check_record``'s parts and placements).

  Archives hold thousands of params: the plain case is checked with a few
  operations per buffer and no object per param (``_plain_histories``); anything
  else, and every refusal, goes through the checks one by one, with their words.
  """
  padded = _plain_histories(state_parts, placements)
  if padded is None:
    _check_histories_one_by_one(index, state_parts, placements)
    return
  for p, m, h, owned in padded:
    if _host_exec.host_bits(h)[owned:].any():  # the refusal, with its geometry's words
      _check_padding(index, p.param, m, h, FlatShard(p.shape, p.rank, p.world_size))


def _plain_histories(state_parts: Any, placements: dict) -> list | None:
  """``(placement, mirror, buffer, elements owned)`` of every buffer with padding to
  check, when every placement and buffer passes the checks of
  ``_check_histories_one_by_one`` as plainly as most do (int rank and world size,
  a shape of ints, storage and buffer dtypes jaxreshard stores); None otherwise."""
  supported, padded = _validate.SUPPORTED_NP_DTYPES, []
  for p in placements.values():
    rank, world, shape = p.rank, p.world_size, p.shape
    if not (
      p.dtype in supported
      and type(rank) is int
      and type(world) is int
      and 0 <= rank < world <= MAX_WORLD_SIZE
      and type(shape) is tuple
      and all(type(d) is int and d >= 0 for d in shape)
    ):
      return None
    count = math.prod(shape)
    if count > MAX_COUNT:
      return None
    slots = -(-count // world)
    owned = min((rank + 1) * slots, count) - min(rank * slots, count)
    for m, h in enumerate(state_parts.history(p.param)):
      h_shape = getattr(h, "shape", None)
      if h_shape is None:
        continue
      if tuple(h_shape) != (slots,) or getattr(h, "dtype", None) not in supported:
        return None
      if owned < slots and not isinstance(h, jax.ShapeDtypeStruct):
        padded.append((p, m, h, owned))
  return padded


def _check_histories_one_by_one(index: int, state_parts: Any, placements: dict) -> None:
  for p in placements.values():
    _validate.check_storage_dtype(_dtype_or_none(p.dtype), f"param {p.param!r}: archive {index}")
    g = FlatShard(p.shape, p.rank, p.world_size)
    for m, h in enumerate(state_parts.history(p.param)):
      if hasattr(h, "shape"):
        _validate.check_flat_history(p, index, m, tuple(h.shape), g.slots)
        where = f"param {p.param!r}: archive {index}, history buffer {m}"
        _validate.check_buffer_dtype(getattr(h, "dtype", None), where)
        if g.owned < g.slots and not isinstance(h, jax.ShapeDtypeStruct):
          _check_padding(index, p.param, m, h, g)


def _dtype_or_none(x: Any) -> np.dtype | None:
  """``x`` as a numpy dtype; None for junk and for None itself (not numpy's float64)."""
  if x is None:
    return None
  try:
    return np.dtype(x)
  except TypeError:
    return None


def check_record_data(index: int, record: Any) -> None:
  """The refusals of a record's data that ``write_archive`` would make while writing it."""
  state_parts, placements = _validate.check_record(index, record)
  check_histories(index, state_parts, placements)


def _check_padding(index: int, pid: str, m: int, buffer: Any, g: FlatShard) -> None:
  """Refuses a history buffer with nonzero bits past what its rank owns: a reader
  refuses such a buffer, so a save that wrote it would not load."""
  nonzero = np.flatnonzero(_host_exec.host_bits(buffer)[g.owned :])
  if nonzero.size:
    raise _validate.nonzero_padding(pid, index, m, g.owned + int(nonzero[0]), g)

"""Placements of a global mesh state from a ``shapes`` mapping: each param's logical
shape, storage dtype and trainability, as the caller gives them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core.geometry import normalize_shape
from jaxreshard._src.core.placement import SUPPORTED_DTYPES, ParamPlacement
from jaxreshard._src.errors import DtypeError

__all__ = ["placements_for", "shape_of"]


def shape_of(value: Any, pid: str) -> tuple[int, ...]:
  return normalize_shape(getattr(value, "shape", value), what=f"param {pid!r}: shape")


def placements_for(
  shapes: Mapping[str, Any],
  roles: Sequence[str | None],
  leaves: Sequence[Any],
  world_size: int,
  *,
  recorded: bool = True,
) -> Callable[[int], tuple[ParamPlacement, ...]]:
  """A function of rank giving placements; dtype/trainable from ``shapes`` values.

  A ``shapes`` value is a shape, or anything with ``.shape`` (a
  ``ParamPlacement``, an array, a ``jax.ShapeDtypeStruct``); its ``.dtype``
  and ``.trainable`` are used when present. A bare shape says nothing of the
  param's dtype: it is taken from the param's history buffers when they all
  have one dtype, and refused when they have none or several (an optimizer
  that keeps a history in another dtype than the param's, as
  ``adam(mu_dtype=...)``, would otherwise record that one).

  ``recorded=False`` is for placements that never leave the call (a gather of
  the whole state): a bare shape then takes the first of its history buffers'
  dtypes that a placement may hold (float32 where none is: a float64 ``mu``
  alone, or no history), which nothing else sees.

  Raises:
    DtypeError: a bare shape for a param without history, or whose history
      buffers differ in dtype (when ``recorded``).
  """
  history_dtypes: dict[str, dict] = {}  # by param: its history dtypes, in leaf order
  for role, leaf in zip(roles, leaves):
    if role is not None:
      history_dtypes.setdefault(role, {})[np.dtype(leaf.dtype)] = None
  base = []
  for pid in sorted(shapes):
    v = shapes[pid]
    dtype = getattr(v, "dtype", None)
    if dtype is None:
      seen = history_dtypes.get(pid, {})
      if recorded:
        dtype = _dtype_of_histories(pid, v, set(seen))
      else:
        dtype = next((d for d in seen if d.name in SUPPORTED_DTYPES), np.dtype(np.float32))
    base.append((pid, shape_of(v, pid), np.dtype(dtype), bool(getattr(v, "trainable", True))))

  def of(rank: int) -> tuple[ParamPlacement, ...]:
    return tuple(ParamPlacement(pid, s, rank, world_size, d, t) for pid, s, d, t in base)

  return of


def _dtype_of_histories(pid: str, shape: Any, dtypes: set) -> np.dtype:
  """The one dtype of a param's history buffers, for a bare shape of it in ``shapes``."""
  if len(dtypes) == 1:
    return next(iter(dtypes))
  why = (
    "it has no history buffer to take it from"
    if not dtypes
    else f"its history buffers have several ({', '.join(sorted(d.name for d in dtypes))})"
  )
  raise DtypeError(
    f"param {pid!r}: shapes gives it only a shape ({shape!r}), not its storage dtype, and"
    f" {why}; give its dtype too: a jax.ShapeDtypeStruct, the param itself, or its placement"
    " (a MeshState's placements, or restore_sharded's)"
  )

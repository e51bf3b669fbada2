"""A checkpoint checked against the optimizer and params a flat restore will feed.

The flat layout ``restore_sharded`` returns is the state
``flat_sharded(optimizer, mesh, axis)`` keeps: the tree of
``optimizer.init(params)`` (``flat_sharded`` refuses an optimizer whose state
tree depends on the params' shapes), each history buffer its parameter's
buffer flattened and padded. So a checkpoint feeds that optimizer exactly when
its saved (logical) state is, leaf for leaf, ``jax.eval_shape(optimizer.init,
params)``: the same parameter ids with the same shapes, the same tree, each
history buffer of its parameter's shape and of the dtype the optimizer gives
it (or that its first update gives it: some retype a history), each clock
scalar of its own dtype. Those are the rules ``restore_sharded(target=...)``
applies to a target, without shardings.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint.reader import Checkpoint
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.distributed import target_restore as _target_restore
from jaxreshard._src.errors import DtypeError, PlacementError

__all__ = ["check_optimizer"]

# What the leaf checks call the state they compare with the checkpoint.
_WHOSE = "optimizer.init(params)"


def check_optimizer(ckpt: Checkpoint, optimizer: Any, params: Any) -> None:
  """Refuses a checkpoint whose state is not one ``optimizer`` builds for ``params``.

  Args:
    ckpt: the open checkpoint.
    optimizer: the optax transformation the restored state will feed, or its
      ``flat_sharded`` wrapper (which stands for the optimizer it wraps).
    params: the params pytree (arrays or ``jax.ShapeDtypeStruct``s).

  Raises:
    PlacementError: naming each param or state leaf (its key path) that
      differs: a param in the params but not in the checkpoint or the reverse,
      a param of another shape, a state of another tree (another optimizer),
      a leaf of another shape; a ``DtypeError`` (a ``PlacementError`` too)
      when every difference is a dtype.
  """
  _structure.require_optimizer(optimizer)
  params = _plain.plain(params)  # NNX State and Variables as the archives store them
  groups, expected = _target_restore.checkpoint_state(ckpt)
  _check_params(groups, params)
  if isinstance(optimizer, _structure.WrappedOptimizer):
    optimizer = optimizer.inner
  abstract = jax.eval_shape(optimizer.init, params)
  paths, leaves, _ = _target_restore.check_structure(expected, abstract, groups, f"{_WHOSE}'s")
  checked = [
    _target_restore.check_leaf(p, e, t, groups, _WHOSE)
    for p, e, t in zip(paths, leaves, jax.tree.leaves(abstract))
  ]
  if any(isinstance(c, DtypeError) for c in checked):
    # A state some optimizers' first update retypes (inject_hyperparams' float32
    # hyper-parameters make a bf16 param's moments float32, as optax itself does):
    # a leaf of the dtype that update gives it is one the optimizer builds.
    stepped = _stepped(optimizer, params, abstract)
    if stepped is not None:
      checked = [
        c
        if not isinstance(c, DtypeError)
        or _target_restore.check_leaf(p, e, t, groups, _WHOSE) is not None
        else None
        for c, p, e, t in zip(checked, paths, leaves, stepped)
      ]
  _target_restore.raise_collected(
    f"the checkpoint does not hold the state {_WHOSE} builds",
    checked,
    kinds=(DtypeError,),
    default=PlacementError,
  )
  _check_param_dtypes(groups, params)


def _stepped(optimizer: Any, params: Any, abstract: Any) -> list[Any] | None:
  """The leaves of the state after one update of ``abstract`` (the params standing
  in for grads of their shapes and dtypes), or None where that cannot be traced
  (an update that needs extra arguments) or has another tree."""
  try:
    state = jax.eval_shape(lambda p, s: optimizer.update(p, s, p)[1], params, abstract)
  except Exception:  # noqa: BLE001 -- any failure: only init's dtypes are known
    return None
  if jax.tree.structure(state) != jax.tree.structure(abstract):
    return None
  return jax.tree.leaves(state)


def _dtype(x: Any) -> np.dtype:
  """A param leaf's dtype: an array's or a ``ShapeDtypeStruct``'s, or the one jax gives a
  Python number."""
  d = getattr(x, "dtype", None)
  return np.dtype(d if d is not None else jax.numpy.result_type(x))


def _check_params(groups: list[Any], params: Any) -> None:
  """Every param of ``params`` is one of the checkpoint's, of the same shape, and the reverse."""
  ids, leaves, _ = _structure.param_ids(params)
  saved = {g.param: g for g in groups}
  given = dict(zip(ids, leaves))
  errors = [
    PlacementError(f"param {pid!r} is in the params but not in the checkpoint")
    for pid in ids
    if pid not in saved
  ]
  errors += [
    PlacementError(f"param {pid!r} is in the checkpoint but not in the params")
    for pid in sorted(saved)
    if pid not in given
  ]
  for pid in ids:
    if pid in saved and tuple(np.shape(given[pid])) != tuple(saved[pid].target.shape):
      errors.append(
        PlacementError(
          f"param {pid!r}: the params have shape {tuple(np.shape(given[pid]))} but the"
          f" checkpoint holds {tuple(saved[pid].target.shape)}"
        )
      )
  _target_restore.raise_collected(
    "the checkpoint does not hold these params", errors, kinds=(PlacementError,)
  )


def _check_param_dtypes(groups: list[Any], params: Any) -> None:
  """Every param of ``params`` has the storage dtype the checkpoint holds it in (their
  ids and shapes are checked): part of its placement, whether or not a history shows
  it (a frozen param has none; an update may retype one)."""
  ids, leaves, _ = _structure.param_ids(params)
  saved = {g.param: np.dtype(g.dtype) for g in groups}
  errors = [
    DtypeError(
      f"param {pid!r}: the params have dtype {_dtype(x).name} but the checkpoint holds"
      f" {saved[pid].name}"
    )
    for pid, x in zip(ids, leaves)
    if _dtype(x) != saved[pid]
  ]
  _target_restore.raise_collected(
    "the checkpoint does not hold these params", errors, kinds=(DtypeError,)
  )

"""What ``flat_sharded``'s ``update`` checks of its arguments before it runs: grads,
params and a state of the trees and shapes ``init`` built the state for, and the
refusals that name the param ids or state paths that differ."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import PlacementError, ShapeError

__all__ = [
  "MAX_LISTED",
  "check_built_for",
  "check_like",
  "check_update_args",
  "described",
  "state_difference",
]


# How many param ids or paths a refusal lists before it stops.
MAX_LISTED = 8


def described(tree: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
  """param id -> (shape, dtype) of a params-shaped tree."""
  ids, leaves, _ = _structure.param_ids(tree)
  return {pid: (tuple(np.shape(x)), getattr(x, "dtype", None)) for pid, x in zip(ids, leaves)}


def _extra_and_missing(got: list[str], want: list[str]) -> tuple[list[str], list[str]]:
  """The first names ``got`` has and ``want`` lacks, and those it lacks."""
  got_set, want_set = set(got), set(want)
  return (
    [p for p in got if p not in want_set][:MAX_LISTED],
    [p for p in want if p not in got_set][:MAX_LISTED],
  )


def _tree_difference(
  got: list[str], got_def: Any, want: list[str], want_def: Any, got_what: str, want_what: str
) -> str:
  """Which param ids one tree has and the other lacks, or how their containers differ."""
  extra, missing = _extra_and_missing(got, want)
  return _described_difference(
    f"{got_what} have params {extra} that {want_what} do not" if extra else "",
    f"{got_what} lack params {missing}" if missing else "",
    lambda: (
      f"the same param ids in other containers: {got_what} {str(got_def)[:200]}"
      f" vs {want_what} {str(want_def)[:200]}"
    ),
  )


def _described_difference(extra: str, missing: str, containers: Any) -> str:
  """What one tree has and the other lacks (``extra``, ``missing``: a phrase each, or
  empty); ``containers()`` when they hold the same names in other containers."""
  return "; ".join(p for p in (extra, missing) if p) or containers()


def check_like(tree: Any, what: str, grads: Any) -> None:
  """``tree`` (the params) has the grads' tree structure and shapes."""
  ids, leaves, treedef = _structure.param_ids(tree)
  g_ids, g_leaves, g_def = _structure.param_ids(grads)
  if treedef != g_def:
    raise PlacementError(
      "flat_sharded: the grads' tree is not the params': "
      + _tree_difference(g_ids, g_def, ids, treedef, "grads", what)
    )
  for pid, x, g in zip(ids, leaves, g_leaves):
    if tuple(np.shape(x)) != tuple(np.shape(g)):
      raise ShapeError(
        f"param {pid!r}: grads of shape {tuple(np.shape(g))} but {what} of"
        f" shape {tuple(np.shape(x))}"
      )


def state_difference(expected: Any, state: Any) -> str:
  """The first leaf paths by which ``state`` differs from the ``expected`` state."""

  def masked(x):
    return isinstance(x, optax.MaskedNode)

  want = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(expected, is_leaf=masked)[0]
  ]
  got = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=masked)[0]
  ]
  extra, missing = _extra_and_missing(got, want)
  return _described_difference(
    f"the state has leaves {extra} that a state for these grads does not" if extra else "",
    f"it lacks leaves {missing}" if missing else "",
    lambda: _containers_difference(
      jax.tree_util.tree_structure(state), jax.tree_util.tree_structure(expected)
    ),
  )


def _containers_difference(got: Any, want: Any) -> str:
  if _plain.same_tree(got, want):
    # Equal but for NamedTuple classes of the same names and fields, which print alike.
    return (
      "its NamedTuple nodes are other classes of the same names and fields (a checkpoint"
      " gives back a NamedTuple of your own as a plain namedtuple): restore it with"
      " like=opt.init(params) (restore_sharded, ReshardRestore) to get your classes back"
    )
  return (
    f"its leaves are in other containers: state {str(got)[:200]} vs a state for these"
    f" grads {str(want)[:200]}"
  )


def check_built_for(built_for: dict[Any, list[dict[str, tuple[int, ...]]]], grads: Any) -> None:
  """``grads`` has the tree and shapes of params ``init`` built a state for, when it built one.

  Raises:
    PlacementError: another tree, naming the param ids one has and the other lacks.
    ShapeError: another shape, naming the param and both shapes.
  """
  ids, leaves, treedef = _structure.param_ids(grads)
  shapes = {pid: tuple(np.shape(x)) for pid, x in zip(ids, leaves)}
  if not built_for:
    return  # a state this wrapper did not build: checked by its flat sizes
  if treedef not in built_for:
    want_def, records = list(built_for.items())[-1]
    raise PlacementError(
      "flat_sharded: the grads' tree is not the params tree the state was built for"
      " (at init): "
      + _tree_difference(ids, treedef, list(records[-1]), want_def, "grads", "those params")
    )
  records = built_for[treedef]
  if shapes not in records:
    want = records[-1]
    pid = next(p for p in ids if shapes[p] != want[p])
    raise ShapeError(
      f"param {pid!r}: grads of shape {shapes[pid]} but the state was built (at init) for"
      f" params of shape {want[pid]}; a state trains only the params it was built for"
    )


def check_update_args(
  built_for: dict, grads: Any, params: Any, refusal: Any, state: Any = ()
) -> None:
  """The optimizer's own ``refusal`` if any; a ``state`` (not None); grads (when
  given) like the params ``init`` built the state for, and like ``params`` if given."""
  if refusal is not None:
    raise refusal
  if state is None:
    raise PlacementError("flat_sharded: update needs the state that init returned, got None")
  if grads is None:
    return
  # Run op by op, a freed buffer crashes the process in jax rather than raising.
  for name, value in (("grads", grads), ("state", state), ("params", params)):
    _deleted.refuse_deleted(value, name)
  if params is not None:
    check_like(params, "params", grads)
  check_built_for(built_for, grads)

"""Roles of a hand-built record (``ShardRecord.roles`` None), inferred from its state.

Without the optimizer, the state's own structure says which subtrees mirror the
params. A 0-d leaf is a clock scalar; any other leaf is the history of the listed
param whose id its key path ends with. Where two listed ids end its path (a param
named after a node of the optimizer's state: ``{"x", "mu": {"x"}}`` under Adam,
whose ``[0].mu['x']`` may be param ``x`` of the mirror ``[0].mu`` or param ``mu/x``
of a mirror at ``[0]``), the mirror is a subtree each of whose leaves (histories,
clock scalars and ``optax.MaskedNode`` places alike) lies at a listed id below it (a
``MaskedNode`` may stand for a subtree of listed params, by ``masks``' rule):
Adam's ``[0]`` also holds ``count``, so only ``[0].mu`` is one. Where several such
subtrees hold the leaf, the outermost is the mirror when it holds every listed
param (a mirror holds the whole params tree, so a subtree inside it holds fewer);
otherwise the roles are ambiguous, and refused, naming each reading.

The hyper-parameters ``optax.inject_hyperparams`` keeps beside its inner state
(its ``hyperparams`` and ``hyperparams_states`` fields) are clock scalars whatever
their shape, as optax's own roles say: a vector learning rate whose key path ends
in a param's id, of that param's slots, is no history of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxreshard._src.core import masks as _masks
from jaxreshard._src.core.ids import path_id

__all__ = ["StatePartsError", "infer_roles"]

KeyPath = tuple[Any, ...]


class StatePartsError(Exception):
  """Internal: a state that cannot be taken apart; callers re-raise with context."""


def infer_roles(state: Any, listed: Sequence[str]) -> tuple[str | None, ...]:
  """Roles of a hand-built record: 0-d leaves are scalars, others histories (see the
  module doc).

  Raises:
    StatePartsError: a buffer no listed param explains, or one two listed params
      explain with nothing in the state to choose between them.
  """
  ids = set(listed)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  injected = _injected_fields(state, ())
  # Per leaf: the lengths of the prefixes below which its path is a listed id.
  found: list[list[int] | None] = []
  for path, leaf in leaves:
    if np.ndim(leaf) == 0 or (injected and any(path[: len(p)] == p for p in injected)):
      found.append(None)
      continue
    prefixes = [j for j in range(len(path)) if path_id(path[j:]) in ids]
    if not prefixes:
      raise StatePartsError(
        f"the buffer at {jax.tree_util.keystr(path)} is not the history of any listed parameter"
      )
    found.append(prefixes)
  held = _held_ids(state, ids) if any(p is not None and len(p) > 1 for p in found) else {}
  roles: list[str | None] = []
  for (path, _), prefixes in zip(leaves, found):
    if prefixes is None:
      roles.append(None)
      continue
    if len(prefixes) > 1:
      prefixes = _mirror_of(path, prefixes, held, ids)
    roles.append(path_id(path[prefixes[0] :]))
  return tuple(roles)


# optax's states of ``inject_hyperparams`` (the stateful one where optax has it),
# and the fields of theirs that hold hyper-parameters and their schedules' states.
_INJECTED = tuple(
  t
  for t in (
    getattr(optax, "InjectHyperparamsState", None),
    getattr(optax, "InjectStatefulHyperparamsState", None),
  )
  if isinstance(t, type)
)
_HYPER_FIELDS = ("hyperparams", "hyperparams_states")


def _injected_fields(tree: Any, prefix: KeyPath) -> list[KeyPath]:
  """The key paths of the hyper-parameter fields of every optax injected-hyperparams
  state in ``tree`` (below ``prefix``), nested ones included."""
  out: list[KeyPath] = []
  if not _INJECTED:
    return out
  is_injected = lambda x: isinstance(x, _INJECTED)  # noqa: E731
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_injected)[0]:
    if not is_injected(node):
      continue
    at = prefix + tuple(path)
    for name in node._fields:
      key = at + (jax.tree_util.GetAttrKey(name),)
      if name in _HYPER_FIELDS:
        out.append(key)
      else:
        out.extend(_injected_fields(getattr(node, name), key))
  return out


def _mirror_of(
  path: KeyPath, prefixes: list[int], held: dict[KeyPath, set[str] | None], ids: set[str]
) -> list[int]:
  """Of the prefixes of ``path`` below which it is a listed id, the one that is the
  mirror (alone in the list); raises ``StatePartsError`` when the state does not say."""
  mirrors = [j for j in prefixes if held.get(path[:j]) is not None]
  if len(mirrors) == 1 or (mirrors and held[path[: mirrors[0]]] == ids):
    return mirrors[:1]
  readings = " or ".join(
    f"param {path_id(path[j:])!r} of a mirror at {jax.tree_util.keystr(path[:j]) or 'the root'}"
    for j in prefixes
  )
  raise StatePartsError(
    f"the roles of this hand-built record (roles=None) are ambiguous: the buffer at"
    f" {jax.tree_util.keystr(path)} may be {readings}, and the state's structure does"
    " not say which; pass roles= to ShardRecord explicitly (for each leaf of"
    " jax.tree.leaves(state), its param id, or None for a clock scalar), or make the"
    " records with jr.shard_state, which takes them from the optimizer"
  )


def _held_ids(state: Any, ids: set[str]) -> dict[KeyPath, set[str] | None]:
  """For each node of ``state`` (by key path): the ids of the leaves below it
  (``optax.MaskedNode`` places included), or None when one of them is no listed id."""
  held: dict[KeyPath, set[str] | None] = {}
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  listed = sorted(ids)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_masked)[0]:
    for j in range(len(path)):
      below = held.setdefault(path[:j], set())
      if below is None:
        continue
      pid = path_id(path[j:])
      if pid in ids:
        below.add(pid)
      elif is_masked(leaf) and (under := _masks.under(listed, pid)):
        below.update(under)  # a MaskedNode standing for a subtree of listed params
      else:
        held[path[:j]] = None
  return held

"""A params-mirroring subtree rebuilt from the params it holds.

A target whose params are not exactly one template's (params of several groups
merged, or some of one group's) cannot take a template's tree whole: each mirror
is made as the union of the trees of the groups it takes params from
(``mirror_trees``), restricted to the params it holds (``merged_tree``). Every
node keeps its container: a list, a tuple, a NamedTuple of its class, a dict or
flax's ``FrozenDict`` at the groups' own keys, in jax's order; a node that holds
no param at all (``None``, ``{}``) stays where its parent does. Groups agree on
each node's kind (``archivecheck.check_one_tree`` refuses any two that do not),
so the union is one tree. A list, a tuple or a NamedTuple comes back whole or
not at all: a target holding some of its elements' params but not all is
refused, as no container of that kind holds them at their own indices.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from jaxreshard._src.core.ids import split_id
from jaxreshard._src.errors import PlacementError

__all__ = ["merged_tree", "mirror_trees", "nested"]

# One mirror's tree in a template: (its treedef, MaskedNode positions as leaves; the
# param id of each leaf, in flatten order), as ``structure.ParamsSubtree`` holds it.
MirrorTree = tuple[Any, tuple[str, ...]]


def nested(pids: Sequence[str], values: Mapping[str, Any]) -> Any:
  """Nested dicts holding ``values[pid]`` at the pieces of each id (strings); the id
  "" alone is a tree that is one leaf."""
  if list(pids) == [""]:
    return values[""]
  root: dict = {}
  for pid in pids:
    *parents, last = split_id(pid)
    node = root
    for key in parents:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):  # validation refuses such sets first
        raise PlacementError(f"param {pid!r} lies under another param, a leaf")
    if isinstance(node.get(last), dict):
      raise PlacementError(f"param {pid!r} is a leaf where other params lie under it")
    node[last] = values[pid]
  return root


def mirror_trees(templates: Iterable[Any]):
  """``trees(i)``: the distinct trees of mirror ``i`` among ``templates`` (the state
  parts of one archive of each group), for ``build_state``."""
  templates = list({id(t): t for t in templates}.values())

  def trees(i: int) -> tuple[MirrorTree, ...]:
    found = {
      (t.subtrees[i].treedef, t.subtrees[i].order): None for t in templates if i < len(t.subtrees)
    }
    return tuple(found)

  return trees


def merged_tree(
  trees: Sequence[MirrorTree], held: Iterable[str], where: tuple = ()
) -> tuple[Any, tuple[str, ...]]:
  """The tree of one mirror of a target holding the params ``held``: (its treedef,
  with a leaf at each param; the id at each leaf, in order). ``trees``: the mirror's
  tree in each group the params come from; ``where``: the mirror's state path.

  Made once per (trees, held) and kept: a warm call only looks it up.

  Raises:
    PlacementError: ``held`` holds some of a list's, a tuple's or a NamedTuple's
      params but not all, or a param no tree of ``trees`` holds.
  """
  return _merged(tuple(trees), frozenset(held), tuple(where))


@functools.lru_cache(maxsize=64)
def _merged(
  trees: tuple[MirrorTree, ...], held: frozenset, where: tuple
) -> tuple[Any, tuple[str, ...]]:
  roots = [jax.tree_util.tree_unflatten(treedef, list(order)) for treedef, order in trees]
  tree, state = _merge(roots, held, where) if roots else ({}, _DROPPED)
  if state is _DROPPED:  # the mirror holds none of its groups' params
    tree = {}
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if len(leaves) != len(held):
    lost = sorted(held - set(leaves))
    raise PlacementError(
      f"param {lost[0]!r} lies in no params tree of the groups this target's params come"
      f" from (state path {_path(where)})"
    )
  return treedef, tuple(leaves)


# What a merged subtree holds: params of the target, none of its params at all (an
# empty node: it stays where its parent does), or params the target does not hold.
_HELD, _EMPTY, _DROPPED = "held", "empty", "dropped"


def _kind(x: Any) -> str:
  t = type(x)
  if t is str:
    return "param"
  if isinstance(x, tuple) and hasattr(t, "_fields"):
    return f"NamedTuple {t.__module__}.{t.__qualname__}"
  if isinstance(x, Mapping):  # a dict, flax's FrozenDict, an OrderedDict: one kind
    return "mapping"
  return "None" if x is None else t.__qualname__


def _merge(nodes: list, held: frozenset, where: tuple) -> tuple[Any, str]:
  """The union of the groups' ``nodes`` at one key path, restricted to ``held``."""
  first, kind = nodes[0], _kind(nodes[0])
  other = next((k for k in map(_kind, nodes) if k != kind), kind)
  if other != kind:  # archivecheck refuses such groups first
    raise PlacementError(
      f"the groups hold a {kind} and a {other} at state path {_path(where)}:"
      " no one params tree holds the params of both"
    )
  t = type(first)
  if t is str:
    return first, _HELD if first in held else _DROPPED
  if first is None:
    return None, _EMPTY
  if isinstance(first, (list, tuple)):
    return _merge_sequence(nodes, held, where)
  children: dict = {}
  for node in nodes:  # a dict or flax's FrozenDict: the only other nodes a state holds
    for k in node:
      children.setdefault(k, []).append(node[k])
  merged = {k: _merge(c, held, where + (DictKey(k),)) for k, c in children.items()}
  state = _state(s for _, s in merged.values())
  kept = {k: v for k, (v, s) in merged.items() if s is not _DROPPED}
  # Mappings of one type keep it (an OrderedDict its keys' order, as jax does);
  # mappings of several types (a FrozenDict in one group, a dict in another) merge
  # into a dict.
  if any(type(n) is not t for n in nodes):
    t = dict
  if t is collections.OrderedDict:
    return t((k, kept[k]) for k in children if k in kept), state
  try:
    keys = sorted(kept)
  except TypeError:  # archivecheck refuses such groups first
    raise PlacementError(
      f"the dict at state path {_path(where)} holds keys in no order jax sorts"
    ) from None
  out = {k: kept[k] for k in keys}
  return (out if t is dict else t(out)), state


def _merge_sequence(nodes: list, held: frozenset, where: tuple) -> tuple[Any, str]:
  first = nodes[0]
  t = type(first)
  named = hasattr(t, "_fields")
  merged = []
  for i in range(max(len(n) for n in nodes)):
    key = GetAttrKey(t._fields[i]) if named else SequenceKey(i)
    merged.append(_merge([n[i] for n in nodes if len(n) > i], held, where + (key,)))
  state = _state(s for _, s in merged)
  if state is _HELD and any(s is _DROPPED for _, s in merged):
    raise _partial(nodes, merged, where)
  children = [v for v, _ in merged]
  return (t(*children) if named else t(children)), state


def _state(states: Iterable[str]) -> str:
  seen = set(states)
  return _HELD if _HELD in seen else _DROPPED if _DROPPED in seen else _EMPTY


def _partial(nodes: list, merged: list, where: tuple) -> PlacementError:
  """A target holding some of a sequence's params but not all."""
  first = nodes[0]
  name = f"NamedTuple {type(first).__name__}" if hasattr(type(first), "_fields") else "list"
  name = "tuple" if type(first) is tuple else name
  have = sorted(p for (v, s) in merged if s is _HELD for p in jax.tree_util.tree_leaves(v))
  lost = sorted(
    p
    for i, (_, s) in enumerate(merged)
    if s is _DROPPED
    for n in nodes
    if len(n) > i
    for p in jax.tree_util.tree_leaves(n[i])
  )
  more = f" (and {len(lost) - 3} more)" if len(lost) > 3 else ""
  return PlacementError(
    f"this target holds param {have[0]!r} but not {', '.join(map(repr, lost[:3]))}{more},"
    f" all in the {name} at state path {_path(where)}: a {name} comes back with all its"
    " elements or not at all, so no state holds exactly this target's params (migrate"
    f" every param of the {name} to the same target ranks)"
  )


def _path(where: tuple) -> str:
  return jax.tree_util.keystr(where) or "(the root)"

"""A params-mirroring subtree rebuilt from the params it holds.

A target whose params are not exactly one template's (params of several groups
merged, or some of one group's) cannot take a template's tree: each mirror is
made anew as nested dicts, at the params' own dict keys where every one lies
under dicts only (``mirror_keys`` says where, from each group's template), else
at the pieces of their ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from jaxreshard._src.core.ids import split_id
from jaxreshard._src.errors import PlacementError

__all__ = ["mirror_keys", "nested", "nested_by_keys"]


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


def mirror_keys(templates: Iterable[Any]) -> Callable[[int], dict[str, tuple]]:
  """``keys(i)``: each param's key path in mirror ``i`` of the template (of its
  group) that holds it, for ``build_state``; worked out when first asked for."""
  templates = list({id(t): t for t in templates}.values())
  made: dict[int, dict[str, tuple]] = {}

  def keys(i: int) -> dict[str, tuple]:
    if i not in made:
      out: dict[str, tuple] = {}
      for t in templates:
        if i < len(t.subtrees):
          sub = t.subtrees[i]
          tree = jax.tree_util.tree_unflatten(sub.treedef, list(sub.order))
          for path, pid in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out.setdefault(pid, tuple(path))
      made[i] = out
    return made[i]

  return keys


def nested_by_keys(pids: Sequence[str], values: Mapping[str, Any], keys: Mapping) -> Any:
  """Nested dicts holding each param at its own dict keys (integers and tuples kept),
  or None where a param's path passes anything but a dict (a list, a tuple, a
  NamedTuple) or one dict would hold keys of two kinds: then ``nested``."""
  root: dict = {}
  for pid in pids:
    path = keys.get(pid)
    if not path or not all(isinstance(k, jax.tree_util.DictKey) for k in path):
      return None
    node = root
    for k in path[:-1]:
      node = node.setdefault(k.key, {})
      if not isinstance(node, dict):
        return None
    node[path[-1].key] = values[pid]

  def one_kind(d: dict) -> bool:
    try:  # tuples of one kind may still not compare (0 against "shared" inside)
      sorted(d)
    except TypeError:
      return False
    return len({type(k) for k in d}) <= 1 and all(
      one_kind(v) for v in d.values() if isinstance(v, dict)
    )

  return root if one_kind(root) else None

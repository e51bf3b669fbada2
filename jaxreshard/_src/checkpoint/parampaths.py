"""Each param's typed key path in an archive's params trees: what a digest names it by."""

from __future__ import annotations

import jax

from jaxreshard._src.core import structure as _structure

__all__ = ["ParamPaths", "typed_path"]


class ParamPaths:
  """Each param's typed key path in an archive's params tree, made once per tree."""

  def __init__(self):
    self._known: dict[tuple, dict[str, str]] = {}

  def of(self, state_parts: _structure.StateParts) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in state_parts.subtrees:
      key = (m.treedef, m.order)
      found = self._known.get(key)
      if found is None:
        tree = jax.tree_util.tree_unflatten(m.treedef, list(m.order))
        with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
        found = self._known[key] = {pid: typed_path(path, tree) for path, pid in with_path}
      for pid, path in found.items():
        out.setdefault(pid, path)
    return out


def typed_path(path: tuple, tree: object = None) -> str:
  """A key path with each key's kind: ``[0]`` (a list's index), ``(0)`` (a tuple's),
  ``{0}`` (a dict's integer key), ``{'0'}`` (a dict's string key), ``.name`` (an
  attribute). ``tree`` is the tree the path walks, which tells a list from a tuple
  (without it, both read ``[0]``)."""
  parts = []
  node = tree
  for k in path:
    if isinstance(k, jax.tree_util.SequenceKey):
      parts.append(f"({k.idx})" if type(node) is tuple else f"[{k.idx}]")
      node = node[k.idx] if isinstance(node, (list, tuple)) else None
    elif isinstance(k, jax.tree_util.DictKey):
      parts.append(f"{{{k.key!r}}}")
      node = node.get(k.key) if hasattr(node, "get") else None
    else:
      parts.append(str(k))
      name = getattr(k, "name", None)
      node = getattr(node, name, None) if isinstance(name, str) else None
  return "".join(parts)

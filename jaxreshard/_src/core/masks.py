"""``optax.MaskedNode`` in a mirror of the params: one param's, or a whole subtree's.

A mask of ``optax.masked`` may be a prefix of the params tree, and so may the
labels of ``optax.multi_transform`` (``{"backbone": "frozen", "head": "train"}``):
then one ``MaskedNode`` stands in a mirror where a whole subtree of params would,
and its place has the id of that subtree (``backbone``), not of a param.

The rule: a ``MaskedNode`` at id ``p`` of a mirror masks, in that mirror, the
param ``p`` when it is listed, else every listed param under ``p`` (an id
``p/...``), of which there must be at least one. A state keeps the place as
optax made it, one ``MaskedNode``; the history of each param it stands for
holds MASKED for that mirror; and a state built from histories puts one
``MaskedNode`` back at a place of its template (or of its groups' templates)
under which every param it holds is masked, so that it has optax's own tree.
A mirror that holds ``MaskedNode`` places alone is found by its places' ids
(``masked_mirrors``).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import optax

from jaxreshard._src.core.ids import path_id
from jaxreshard._src.core.mirrortree import nested
from jaxreshard._src.errors import PlacementError

__all__ = [
  "MASKED",
  "check_places",
  "collapse",
  "fill",
  "ids_tree",
  "masked_mirrors",
  "masked_places",
  "node_at",
  "under",
  "unmasked_tree",
]


class _Masked:
  """A parameter masked out of one mirror (``optax.MaskedNode`` in the state)."""

  def __repr__(self):
    return "MASKED"


MASKED = _Masked()


def _ancestors(pid: str) -> Iterator[str]:
  """The ids of the subtrees above ``pid``, innermost first (``a/b/c``: ``a/b``, ``a``).
  A ``/`` inside a key is escaped, so each cut is at a key."""
  cut = pid.rfind("/")
  while cut >= 0:
    pid = pid[:cut]
    yield pid
    cut = pid.rfind("/")


def fill(history: Sequence[Any], subtrees: Sequence[Any], pid: str) -> tuple[Any, ...]:
  """``history`` (per mirror: entry or None) with MASKED in each mirror that lacks
  ``pid`` but holds a ``MaskedNode`` at a subtree above it."""
  out = list(history)
  for m, h in enumerate(history):
    if h is None:
      entries = subtrees[m].entries
      if any(entries.get(a) is MASKED for a in _ancestors(pid)):
        out[m] = MASKED
  return tuple(out)


def under(sorted_ids: Sequence[str], place: str) -> list[str]:
  """The ids of ``sorted_ids`` below ``place`` (``place/...``)."""
  head = place + "/"
  i = bisect.bisect_left(sorted_ids, head)
  out = []
  while i < len(sorted_ids) and sorted_ids[i].startswith(head):
    out.append(sorted_ids[i])
    i += 1
  return out


def check_places(archive: int, state_parts: Any, listed: Collection[str]) -> None:
  """Every param an archive holds a history for is one it lists, and every
  ``MaskedNode`` standing for a subtree stands for at least one listed param.

  Raises:
    PlacementError: naming the param, or the masked subtree and its mirror.
  """
  extra = state_parts.param_set() - set(listed)
  if not extra:
    return
  ids = sorted(listed)
  for pid in sorted(extra):
    places = [m for m in state_parts.subtrees if pid in m.entries]
    if any(m.entries[pid] is not MASKED for m in places):
      raise PlacementError(
        f"param {pid!r}: archive {archive} holds a history for it but does not list it"
        " in its placements"
      )
    if not under(ids, pid):
      where = ", ".join(jax.tree_util.keystr(m.prefix) or "the root" for m in places)
      raise PlacementError(
        f"param {pid!r}: archive {archive} holds an optax.MaskedNode for it (in the"
        f" mirror of the params at {where}), which stands for that param or for every"
        " param under it, but lists neither it nor any param under it in its placements"
      )


def collapse(values: dict[str, Any], places: Iterable[str]) -> dict[str, Any]:
  """``values`` (param id -> mirror entry) with one ``MaskedNode`` at each of
  ``places`` (ids of masked places of the templates) under which it holds params,
  all masked; ``values`` itself when no place is one."""
  ids = None
  out = values
  for place in places:
    if place in out:
      continue
    if ids is None:
      ids = sorted(out)
    below = under(ids, place)
    if below and all(isinstance(out[p], optax.MaskedNode) for p in below):
      if out is values:
        out = dict(values)
      for p in below:
        del out[p]
      out[place] = optax.MaskedNode()
      ids = None
  return out


def masked_places(entries: Mapping[str, Any], order: Sequence[str]) -> list[str]:
  """The ids of a mirror's ``MaskedNode`` places, in its flatten order."""
  return [p for p in order if entries.get(p) is MASKED]


def ids_tree(with_path: Sequence[tuple[Any, Any]], treedef: Any, want: Sequence[str]) -> Any:
  """The params tree (leaves: their ids) a mirror holds, when its places (flattened
  with ``MaskedNode`` as a leaf: ``with_path``, ``treedef``) are exactly the sorted
  ids ``want``, each ``MaskedNode`` standing for the ids under it (nested dicts of
  their keys, as strings, below it); else None."""
  leaves, covered = [], 0
  for path, leaf in with_path:
    pid = path_id(path)
    below = under(want, pid) if isinstance(leaf, optax.MaskedNode) else []
    if below:
      rest = [p[len(pid) + 1 :] for p in below]
      leaves.append(nested(rest, dict(zip(rest, below))))
      covered += len(below)
    else:
      leaves.append(pid)
      covered += 1
  if covered != len(want) or not set(want).issuperset(p for p in leaves if isinstance(p, str)):
    return None
  return jax.tree_util.tree_unflatten(treedef, leaves)


def node_at(tree: Any, path: Sequence[Any]) -> Any:
  """The node of ``tree`` at the key path ``path``; None where it has none."""
  node = tree
  for key in path:
    try:
      if isinstance(key, jax.tree_util.DictKey):
        node = node[key.key]
      elif isinstance(key, jax.tree_util.SequenceKey):
        node = node[key.idx]
      elif isinstance(key, jax.tree_util.GetAttrKey):
        node = getattr(node, key.name)
      else:
        return None
    except (KeyError, IndexError, TypeError, AttributeError):
      return None
  return node


def unmasked_tree(mirrors: Sequence[Any], want: Sequence[str]) -> Any:
  """The params' tree (leaves: their ids) that ``mirrors`` hold together: the first
  mirror's, each ``MaskedNode`` place in it replaced by that place's subtree in a
  mirror where it is not masked (its containers and keys as that mirror holds
  them); a place masked in every mirror, as ``ids_tree`` makes it (nested dicts of
  the ids under it). ``mirrors``: trees of ids with ``MaskedNode`` places. None
  when the ids are not ``want``."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  ids = sorted(want)

  def resolve(tree: Any, prefix: tuple) -> Any:
    def place(path: tuple, leaf: Any) -> Any:
      if not is_masked(leaf):
        return leaf
      for other in mirrors:
        sub = node_at(other, prefix + path)
        if sub is not None and not is_masked(sub):
          return resolve(sub, prefix + path)
      pid = path_id(prefix + path)  # masked in every mirror
      below = under(ids, pid)
      rest = [p[len(pid) + 1 :] for p in below]
      return nested(rest, dict(zip(rest, below))) if below else pid

    return jax.tree_util.tree_map_with_path(place, tree, is_leaf=is_masked)

  out = resolve(mirrors[0], ())
  return out if sorted(jax.tree_util.tree_leaves(out)) == ids else None


def masked_mirrors(
  state: Any, prefixes: Mapping[tuple, int], listed: Collection[str]
) -> dict[tuple, int]:
  """``prefixes`` (the key paths of the mirrors the roles find, each with its index)
  with the mirrors of ``state`` that hold ``MaskedNode`` places and no buffer, all
  numbered in the state's flatten order.

  A rank holding only params that a mirror masks (a frozen group placed apart) has
  that mirror as optax builds it for them: ``MaskedNode`` places, no leaf, so no
  role says where it is. The rule: a subtree outside every mirror the roles find,
  holding no leaf, each of whose ``MaskedNode`` places lies at the id of a
  ``listed`` param below it or of a subtree of listed params, is a mirror. Where
  several nested subtrees are such for one place, the outermost that holds every
  listed param is (a mirror holds the whole params tree); where none of them
  does, the place stays in the skeleton, as one that is no mirror does.
  """
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  items = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_masked)[0]
  depths = sorted({len(p) for p in prefixes})

  def claimed(path: tuple) -> bool:
    return any(path[:k] in prefixes for k in depths if k <= len(path))

  places = [path for path, x in items if is_masked(x) and not claimed(path)]
  if not places:
    return dict(prefixes)
  ids = sorted(listed)
  idset = set(ids)
  nodes = {path[:j] for path in places for j in range(len(path) + 1)}
  # Per node above a place: the listed ids its places stand for; None when it
  # holds a leaf or a place that stands for no listed id.
  held: dict[tuple, set[str] | None] = {}
  for path, x in items:
    for j in range(len(path) + 1):
      node = path[:j]
      if node not in nodes or (node in held and held[node] is None):
        continue
      pid = path_id(path[j:]) if is_masked(x) else None
      below = [] if pid is None else [pid] if pid in idset else under(ids, pid)
      if below:
        held.setdefault(node, set()).update(below)
      else:
        held[node] = None
  chosen = set()
  for path in places:
    found = [path[:j] for j in range(len(path) + 1) if held.get(path[:j]) is not None]
    if len(found) > 1:
      found = [node for node in found if held[node] == idset][:1]
    chosen.update(found)
  chosen = {c for c in chosen if not any(c[:k] in chosen for k in range(len(c)))}
  if not chosen:
    return dict(prefixes)
  first: dict[tuple, int] = {}
  every = set(prefixes) | chosen
  for i, (path, _) in enumerate(items):
    for k in range(len(path) + 1):
      if path[:k] in every:
        first.setdefault(path[:k], i)
  order = sorted(every, key=lambda p: (first[p], prefixes.get(p, -1)))
  return {p: i for i, p in enumerate(order)}

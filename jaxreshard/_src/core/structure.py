"""An optax state taken apart: params subtrees, non-param scalars (the clock), ids.

An optax state is a pytree in which some subtrees have the params' structure
(Adam's ``mu`` and ``nu``, a momentum ``trace``, ``MultiSteps``' ``acc_grads``)
and every other leaf is a non-param scalar (step counts, injected
hyper-parameters): together these are the optimizer's *clock*, which every
rank holds whole and which must agree between archives of one step. Optax
itself says which leaf is which (:func:`optax.tree_map_params`); this module
records that once, as per-leaf *roles*, and from then on takes a state apart
(:class:`StateParts`) and puts it back together with no optimizer object:

* the *skeleton*: the state with every params subtree replaced by a marker
  leaf; its tree structure and scalar leaves are the clock;
* the *params subtrees* (:class:`ParamsSubtree`): for each, its own tree
  structure and, per param id, its buffer or ``optax.MaskedNode`` (no history
  there). One ``MaskedNode`` may stand for a whole subtree of params (a prefix
  mask): its entry has that subtree's id, and ``StateParts.history`` of each
  param under it says MASKED (``masks``' rule). A mirror of ``MaskedNode`` places
  alone has no leaf to carry a role: the ids of the params its archive lists find
  it (``masks.masked_mirrors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxreshard._src.core import logical_masks as _logical_masks
from jaxreshard._src.core import masks as _masks
from jaxreshard._src.core import outlines as _outlines
from jaxreshard._src.core.ids import key_name, path_id
from jaxreshard._src.core.masks import MASKED
from jaxreshard._src.core.mirrortree import merged_tree, mirror_trees, nested
from jaxreshard._src.core.roleinference import StatePartsError, infer_roles
from jaxreshard._src.errors import PlacementError

__all__ = [
  "StateParts",
  "MASKED",
  "state_parts",
  "build_state",
  "history_roles",
  "merged_tree",
  "mirror_trees",
  "nested",
  "param_ids",
  "params_in",
  "path_id",
  "require_optimizer",
]

KeyPath = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ParamsSubtreeSlot:
  """Leaf standing in for mirror ``index`` inside a skeleton."""

  index: int


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def param_ids(params: Any) -> tuple[list[str], list[Any], Any]:
  """Returns (ids, leaves, treedef) of a params pytree, in flatten order."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  return [path_id(p) for p, _ in with_path], [x for _, x in with_path], treedef


def params_in(state: Any, ids: Sequence[str]) -> Any:
  """The params' tree as ``state``'s first subtree with exactly these ids holds it.

  Its leaves are the ids; dicts, lists, tuples and integer keys are kept as the
  state holds them, so a state of list-structured params mirrors it. None when
  no subtree of ``state`` (a ``MaskedNode`` counting as a leaf) has exactly
  the ids ``ids`` (a ``MaskedNode`` at a subtree of them standing for them).
  """
  want = sorted(ids)

  # A MaskedNode may stand for a subtree of them (``masks``' rule): a subtree holding them
  # all is looked for first; else the mirrors with such places (``masked``), merged.
  masked: list = []

  def find(node):
    with_path, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_masked_node)
    pids = [path_id(p) for p, _ in with_path]
    if sorted(pids) == want:
      return jax.tree_util.tree_unflatten(treedef, pids)
    some_masked = any(_is_masked_node(x) for _, x in with_path)  # as many leaves or fewer
    if len(pids) <= len(want) and some_masked:
      if _masks.ids_tree(with_path, treedef, want) is not None:
        leaves = [x if _is_masked_node(x) else pid for (_, x), pid in zip(with_path, pids)]
        masked.append((jax.tree_util.tree_unflatten(treedef, leaves), with_path, treedef))
        return None
    if (len(pids) < len(want) and not some_masked) or _is_leaf_node(node) or _is_masked_node(node):
      return None
    for _, child in _children(node)[0]:
      found = find(child)
      if found is not None:
        return found
    return None

  found = find(state) if want else None
  if found is not None or not masked:
    return found
  merged = _masks.unmasked_tree([m for m, _, _ in masked], want)
  return merged if merged is not None else _masks.ids_tree(*masked[0][1:], want)


def require_optimizer(optimizer: Any, hint: str = "") -> None:
  """Refuses by name what is not an optax transformation (an object with callable
  ``init`` and ``update``): ``optax.adam`` itself, not called, or an argument passed
  in another's place. ``hint`` ends the message (the call's argument order)."""
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise PlacementError(
      "optimizer must be an optax GradientTransformation (with init and update), got"
      f" {type(optimizer).__name__}{hint}"
    )


class WrappedOptimizer(optax.GradientTransformationExtraArgs):
  """An optax transformation whose state is the state of the optimizer it wraps, ``inner``.

  Functions that ask an optimizer which state leaves are histories (saving,
  ``shard_state``) ask ``inner`` in its place.
  """

  def __new__(cls, init: Any, update: Any, inner: Any = None):
    self = super().__new__(cls, init, update)
    self._inner = inner
    return self

  @property
  def inner(self) -> Any:
    """The optimizer this one wraps."""
    return self._inner


@dataclasses.dataclass(frozen=True)
class _Hist:
  pid: str


_SCALAR_ROLE = object()


def history_roles(optimizer: Any, params: Any, state: Any) -> tuple[str | None, ...]:
  """Per leaf of ``state``: the param id of a history buffer, or None for a scalar.

  Uses :func:`optax.tree_map_params`, which re-runs ``optimizer.init`` on a
  placeholder to find every subtree that mirrors the params.
  """
  # A wrapper (flat_sharded's) describes its state through the optimizer it wraps.
  if isinstance(optimizer, WrappedOptimizer):
    optimizer = optimizer.inner
  # Its label functions answer optax's placeholder without being called on it.
  optimizer = _logical_masks.with_logical_callables(optimizer)
  ids, _, treedef = param_ids(params)
  id_tree = jax.tree_util.tree_unflatten(treedef, ids)

  def tag(value, pid):
    return value if _is_masked_node(value) else _Hist(pid)

  # tree_map_params re-runs optax's own init, whose math (schedules in
  # inject_hyperparams) is not clean under strict dtype promotion; only the
  # state's structure is used here, so the caller's setting must not matter.
  try:
    with jax.numpy_dtype_promotion("standard"):
      tagged = optax.tree_map_params(
        optimizer,
        tag,
        state,
        id_tree,
        transform_non_params=lambda v: jax.tree.map(lambda _: _SCALAR_ROLE, v),
        is_leaf=_is_masked_node,
      )
  except Exception as e:
    refusal = _logical_masks.placeholder_refusal(ids, e)
    if refusal is None:
      raise
    raise refusal from e
  leaves = jax.tree.leaves(tagged, is_leaf=lambda x: isinstance(x, _Hist) or x is _SCALAR_ROLE)
  return tuple(x.pid if isinstance(x, _Hist) else None for x in leaves)


@dataclasses.dataclass(frozen=True)
class ParamsSubtree:
  """One param-mirroring subtree, taken apart."""

  prefix: KeyPath
  treedef: Any  # tree structure with MaskedNode positions as leaves
  order: tuple[str, ...]  # id of each position (a param's, or a masked subtree's)
  entries: Mapping[str, Any]  # id of a position -> buffer or MASKED


@dataclasses.dataclass(frozen=True)
class StateParts:
  """A state taken apart into skeleton, scalars and mirrors."""

  skeleton: Any  # treedef; leaves are scalars and ParamsSubtreeSlot markers
  skeleton_leaves: tuple[Any, ...]
  subtrees: tuple[ParamsSubtree, ...]

  @property
  def scalars(self) -> list[tuple[int, Any]]:
    return [
      (i, x) for i, x in enumerate(self.skeleton_leaves) if not isinstance(x, ParamsSubtreeSlot)
    ]

  def history(self, pid: str) -> tuple[Any, ...]:
    """Per mirror: the buffer, MASKED (a ``MaskedNode`` at ``pid`` or at a subtree
    above it), or None when the mirror lacks ``pid``."""
    out = tuple(m.entries.get(pid) for m in self.subtrees)
    for h in out:
      if h is None:
        return _masks.fill(out, self.subtrees, pid)
    return out

  def param_set(self) -> set[str]:
    out = set()
    for m in self.subtrees:
      out.update(m.entries)
    return out


def clock_paths(skeleton: Any, is_scalar: Sequence[bool]) -> list[str]:
  """The key path of each clock scalar of a skeleton, in skeleton-leaf order.

  ``skeleton`` is an ``StateParts.skeleton``; ``is_scalar`` says, per skeleton
  leaf, whether it is a clock scalar (or a mirror's marker). This is the one
  name of a clock scalar: ``inspect`` shows it, ``verify`` compares by it, and
  refusals of archives whose clocks differ name it (``[0].count``).
  """
  tree = jax.tree_util.tree_unflatten(skeleton, list(range(len(is_scalar))))
  return [
    jax.tree_util.keystr(path)
    for path, i in jax.tree_util.tree_flatten_with_path(tree)[0]
    if is_scalar[i]
  ]


def _subtree_prefix(path: KeyPath, pid: str, names: Sequence[str]) -> KeyPath:
  # An id of n segments is the last n keys of the path (``names`` are their
  # names); the id "" is also the empty path of a params tree that is a single leaf.
  k = pid.count("/") + 1
  if k <= len(path) and "/".join(names[len(path) - k :]) == pid:
    return path[: len(path) - k]
  if pid == "":
    return path
  raise StatePartsError(f"the leaf at {jax.tree_util.keystr(path)} is not under a key path {pid!r}")


def _children(node: Any):
  """One level of a pytree node: [(key, child)], treedef to rebuild it."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  return [(p[0], c) for p, c in with_path], treedef


def _is_leaf_node(node: Any) -> bool:
  # Its children stand as leaves: one level is looked at, not the whole subtree.
  outline = jax.tree_util.tree_structure(node, is_leaf=lambda x: x is not node)
  return jax.tree_util.treedef_is_leaf(outline) and not (node is None or _is_masked_node(node))


def _replace_subtrees(tree: Any, replacements: Mapping[KeyPath, Any]) -> tuple[Any, dict]:
  """Replaces the subtrees at ``replacements``' paths; returns (tree, removed)."""
  removed = {}

  def rec(node, path):
    if path in replacements:
      removed[path] = node
      return replacements[path]
    if not any(p[: len(path)] == path for p in replacements) or _is_leaf_node(node):
      return node
    children, treedef = _children(node)
    return jax.tree_util.tree_unflatten(treedef, [rec(c, path + (k,)) for k, c in children])

  return rec(tree, ()), removed


def roles_of(record: Any) -> tuple[str | None, ...]:
  """A record's roles: as recorded, or inferred for a hand-built record.

  Raises:
    StatePartsError: a hand-built record with a buffer no listed param explains,
      or one whose state does not say which of two listed params it is.
  """
  if record.roles is not None:
    return record.roles
  return infer_roles(record.state, sorted(p.param for p in record.placements))


OUTLINES = _outlines.OutlineCache(
  lambda tree, roles, listed: _state_parts_of_paths(tree, roles, listed)
)


def state_parts(
  state: Any, roles: Sequence[str | None], listed: Collection[str] | None = None
) -> StateParts:
  """Takes ``state`` apart using per-leaf ``roles`` (see ``history_roles``) and the
  ids of the params its archive lists (``listed``), which find the mirrors that
  hold ``MaskedNode`` places alone (``masks.masked_mirrors``; None: not looked for).

  Raises:
    StatePartsError: when roles do not describe the state, or a mirror is ragged.
    UnstorableTree: a tree no checkpoint can hold (``storable``'s rule).
  """
  leaves, treedef = jax.tree_util.tree_flatten(state)
  if len(leaves) != len(roles):
    raise StatePartsError(f"the state has {len(leaves)} leaves but its roles describe {len(roles)}")
  outline = OUTLINES.get(treedef, tuple(roles), len(leaves), listed, state)
  subtrees = tuple(
    ParamsSubtree(
      m.prefix,
      m.treedef,
      m.order,
      {pid: e if e is MASKED else leaves[e] for pid, e in m.entries.items()},
    )
    for m in outline.subtrees
  )
  return StateParts(
    outline.skeleton,
    tuple(
      x if isinstance(x, ParamsSubtreeSlot) else own_scalar(leaves[x])
      for x in outline.skeleton_leaves
    ),
    subtrees,
  )


def own_scalar(x: Any) -> Any:
  """A clock scalar that no other state shares: a numpy array (mutable in place)
  or a jax array (deleted when a step donates it) copied, anything else (numpy
  scalars, Python numbers) as it is.

  States taken apart keep their clock as it was when first looked at, and every
  state built gets scalars of its own: a write into one target's ``count``, or a
  jitted step donating one target's state, never reaches its sources or another
  target. A jax array is copied by ``device_put`` (a buffer copy on its own
  devices, with its sharding): no program is compiled for it.
  """
  if isinstance(x, np.ndarray):
    return x.copy()
  if isinstance(x, jax.Array):
    return jax.device_put(x, may_alias=False)
  return x


def _state_parts_of_paths(
  state: Any, roles: Sequence[str | None], listed: Collection[str] | None = None
) -> StateParts:
  """``state_parts`` by walking key paths (the state's leaves are their own indices)."""
  with_path = jax.tree_util.tree_flatten_with_path(state)[0]
  if len(with_path) != len(roles):
    raise StatePartsError(
      f"the state has {len(with_path)} leaves but its roles describe {len(roles)}"
    )
  paths = [p for p, _ in with_path]
  # Each key of a history buffer's path named once; an id is a join of a suffix.
  names = {i: tuple(map(key_name, paths[i])) for i, pid in enumerate(roles) if pid is not None}
  prefixes: dict[KeyPath, int] = {}
  for i, names_i in names.items():
    prefixes.setdefault(_subtree_prefix(paths[i], roles[i], names_i), len(prefixes))
  if listed is not None:
    prefixes = _masks.masked_mirrors(state, prefixes, listed)
  # Every buffer below a mirror's prefix must carry the role its position says.
  depths = sorted({len(p) for p in prefixes})
  for i, names_i in names.items():
    path = paths[i]
    for k in depths:
      if k <= len(path) and path[:k] in prefixes and "/".join(names_i[k:]) != roles[i]:
        raise StatePartsError(f"roles and state disagree at {jax.tree_util.keystr(path)}")
  # A leaf the roles call a clock scalar cannot sit in a mirror of the params, which
  # is taken whole as histories: that would make it one, unchecked as a clock.
  for i, path in enumerate(paths):
    if roles[i] is None and any(k <= len(path) and path[:k] in prefixes for k in depths):
      raise StatePartsError(
        f"roles and state disagree at {jax.tree_util.keystr(path)}: the roles call it a"
        " clock scalar, but it lies in a subtree that mirrors the params"
      )
  skeleton_tree, removed = _replace_subtrees(
    state, {p: ParamsSubtreeSlot(i) for p, i in prefixes.items()}
  )
  members = _leaves_under(paths, prefixes, depths)
  subtrees = []
  for prefix in prefixes:
    sub = removed[prefix]
    sub_leaves, sub_def = jax.tree_util.tree_flatten(sub, is_leaf=_is_masked_node)
    if members is not None and sub_leaves == members[prefix]:
      # No MaskedNode: the mirror's leaves are the state's leaves below its prefix.
      k = len(prefix)
      items = [(roles[i] if roles[i] is not None else path_id(paths[i][k:]), i) for i in sub_leaves]
    else:
      items = [
        (path_id(path), MASKED if _is_masked_node(leaf) else leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(sub, is_leaf=_is_masked_node)[0]
      ]
    order, entries = [], {}
    for pid, leaf in items:
      if pid in entries:
        raise StatePartsError(f"parameter {pid!r} appears twice in one optimizer subtree")
      order.append(pid)
      entries[pid] = leaf
    subtrees.append(ParamsSubtree(prefix, sub_def, tuple(order), entries))
  skel_leaves, skel_def = jax.tree_util.tree_flatten(skeleton_tree)
  return StateParts(
    skel_def,
    tuple(x if isinstance(x, ParamsSubtreeSlot) else own_scalar(x) for x in skel_leaves),
    tuple(subtrees),
  )


def _leaves_under(
  paths: Sequence[KeyPath], prefixes: Mapping[KeyPath, int], depths: Sequence[int]
) -> dict[KeyPath, list[int]] | None:
  """The indices of the leaves below each prefix; None when prefixes nest."""
  out: dict[KeyPath, list[int]] = {p: [] for p in prefixes}
  for i, path in enumerate(paths):
    hits = [path[:k] for k in depths if k <= len(path) and path[:k] in prefixes]
    if len(hits) > 1:
      return None
    if hits:
      out[hits[0]].append(i)
  return out


def build_state(
  template: StateParts,
  histories: Mapping[str, Sequence[Any]],
  scalars: Sequence[Any] | None = None,
  keys: Callable[[int], Sequence[Any]] | None = None,
) -> Any:
  """Reassembles a state with ``template``'s clock and the given histories.

  Args:
    template: the state parts whose skeleton (structure and scalars) the new state
      takes.
    histories: param id -> per mirror of the template: a buffer, MASKED, or
      None (the parameter is absent from that mirror).
    scalars: replacement skeleton scalars, in order (defaults to the template's).
    keys: ``mirror_trees`` of the templates of every group the params come from
      (the template's own trees when None).

  A mirror whose param set equals the template's keeps its exact tree
  structure; a mirror of a different set (merged or restricted groups) is the
  union of its groups' trees restricted to its params (``merged_tree``): every
  container as the groups hold it, a list, a tuple or a NamedTuple whole.

  Raises:
    PlacementError: a mirror holding some of a list's, a tuple's or a
      NamedTuple's params but not all.
  """
  subtrees = []
  for i, subtree in enumerate(template.subtrees):
    values = {}
    for pid, per_subtree in histories.items():
      v = per_subtree[i]
      if v is not None:
        values[pid] = optax.MaskedNode() if v is MASKED else v
    if set(values) != set(subtree.order):
      # One MaskedNode back where the template's stood for a whole subtree.
      places = _masks.masked_places(subtree.entries, subtree.order)
      values = _masks.collapse(values, places)
      if keys is not None and set(values) != set(subtree.order):
        # Those of every group's tree: an id of none of this target's params.
        others = [p for _, order in keys(i) for p in order if p not in values]
        values = _masks.collapse(values, others)
    if set(values) == set(subtree.order):
      treedef, order = subtree.treedef, subtree.order
    else:
      trees = keys(i) if keys is not None else ()
      trees = trees or ((subtree.treedef, subtree.order),)
      treedef, order = merged_tree(trees, values, subtree.prefix)
    subtrees.append(jax.tree_util.tree_unflatten(treedef, [values[p] for p in order]))
  scalar_iter = iter(scalars) if scalars is not None else None
  leaves = []
  for leaf in template.skeleton_leaves:
    if isinstance(leaf, ParamsSubtreeSlot):
      leaves.append(subtrees[leaf.index])
    else:
      leaves.append(own_scalar(next(scalar_iter) if scalar_iter is not None else leaf))
  # Unflattening places each mirror subtree whole where its marker stood.
  return jax.tree_util.tree_unflatten(template.skeleton, leaves)

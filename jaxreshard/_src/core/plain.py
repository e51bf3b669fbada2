"""Flax NNX containers as the plain pytrees an archive stores, and back.

An ``nnx.Optimizer`` holds its optax state with ``nnx.State`` nodes (dicts
keyed by attribute name, or by integer for an ``nnx.List``) and ``nnx.Variable``
leaves (``OptVariable``, ``OptArray``); ``nnx.state(model, nnx.Param)`` is the
same kind of tree. The on-disk format stores dicts, lists, tuples,
NamedTuples and None, so such a tree is saved in its *plain* form: every
``nnx.State`` a dict with the same keys (integer keys stay integers), every
``nnx.Variable`` its value. A key path then loses only the Variables'
``.value`` step: ``mu['layers'][10]['kernel'].value`` is the param id
``layers/10/kernel``, the id of the same leaf in ``State.to_pure_dict()``.

Nothing here imports flax: a tree can hold NNX nodes only when flax is loaded.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxreshard._src.errors import PlacementError

__all__ = ["check_like", "like", "plain", "same_tree", "unwrapped"]


def _nnx() -> Any:
  return sys.modules.get("flax.nnx")


def plain(tree: Any) -> Any:
  """``tree`` with every ``nnx.State`` a dict and every ``nnx.Variable`` its value.

  Leaves are the same objects (nothing is copied); a tree without NNX nodes is
  returned as it is.
  """
  nnx = _nnx()
  if nnx is None:
    return tree
  kinds = (nnx.Variable, nnx.State)
  nodes = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
  if not any(isinstance(x, kinds) for x in nodes):
    return tree  # the same containers: a caller's change to one is the tree's

  def convert(node):
    if isinstance(node, nnx.Variable):
      return plain(node.get_value())
    if isinstance(node, nnx.State):
      return {k: plain(v) for k, v in node.items()}
    return node

  return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, kinds))


def unwrapped(tree: Any) -> Any:
  """``tree`` with every ``nnx.Variable`` its value; ``nnx.State`` nodes are kept.

  The form in which ``nnx.Optimizer`` passes params and grads to its
  transformation's ``update`` (``nnx.as_pure``), while ``init`` receives the
  Variables themselves.
  """
  nnx = _nnx()
  if nnx is None:
    return tree
  return jax.tree.map(
    lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
    tree,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


def like(template: Any, state: Any) -> Any:
  """``state``'s leaves in ``template``'s tree (NNX nodes and all).

  ``state`` must have exactly the structure of ``plain(template)`` (the same
  node types and keys, integer keys as integers); each leaf goes to the
  template leaf at the same key path, so no order of ids can mix them up.

  Raises:
    PlacementError: ``state`` is not ``template``'s plain structure.
  """
  leaves, treedef = jax.tree_util.tree_flatten(template)
  positions = _positions(leaves, treedef)
  _same(jax.tree_util.tree_structure(positions), jax.tree_util.tree_structure(state))
  placed: list[Any] = [None] * len(leaves)
  for i, leaf in zip(jax.tree.leaves(positions), jax.tree.leaves(state)):
    placed[i] = leaf
  return jax.tree_util.tree_unflatten(treedef, placed)


def _positions(leaves: list[Any], treedef: Any) -> Any:
  """The plain form of a template whose leaves are their positions."""
  return plain(jax.tree_util.tree_unflatten(treedef, list(range(len(leaves)))))


def check_like(template: Any, structure: Any) -> None:
  """Refuses a template whose plain form does not have the tree ``structure`` (a
  treedef): :func:`like` would refuse to put a state of that tree in it. Made
  before a restore reads anything, it spares a read whose result would be refused.

  Raises:
    PlacementError: ``plain(template)``'s tree is not ``structure``.
  """
  _same(jax.tree_util.tree_structure(_positions(*jax.tree_util.tree_flatten(template))), structure)


def _is_namedtuple_class(t: Any) -> bool:
  return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def same_tree(a: Any, b: Any) -> bool:
  """Whether treedefs ``a`` and ``b`` are equal, NamedTuple nodes compared by name
  and fields (all an archive records of them) rather than by class: a checkpoint
  gives back a user's NamedTuple as a plain namedtuple of the same name and fields,
  which the user's own tree then stands for."""
  if a == b:
    return True
  if a.num_leaves != b.num_leaves or a.num_nodes != b.num_nodes:
    return False
  da, db = a.node_data(), b.node_data()
  if da is None or db is None:
    return False  # a leaf against a node (two leaves are equal)
  (ta, aux_a), (tb, aux_b) = da, db
  if ta is not tb:
    if not (
      _is_namedtuple_class(ta)
      and _is_namedtuple_class(tb)
      and ta.__name__ == tb.__name__
      and tuple(ta._fields) == tuple(tb._fields)
    ):
      return False
  elif aux_a != aux_b:
    return False
  return all(same_tree(x, y) for x, y in zip(a.children(), b.children(), strict=True))


def _same(want: Any, got: Any) -> None:
  if not same_tree(want, got):
    raise PlacementError(
      f"the restored state's tree {got} is not the plain form of the template's {want}"
    )

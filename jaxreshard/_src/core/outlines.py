"""State parts of tree *structures* (leaf indices as leaves), cached.

Every rank of a layout has the same structure, so taking W archives apart walks
their key paths once; each archive then only places its leaves. A structure
whose skeleton keeps ``optax.MaskedNode`` places outside every mirror the roles
find is taken apart again with the archive's listed params, which say which of
those places are mirrors that hold no buffer (``masks.masked_mirrors``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

import jax
import optax

from jaxreshard._src.core import storable as _storable

__all__ = ["OutlineCache"]


def _keeps_masked_places(skeleton: Any) -> bool:
  """Whether a skeleton's tree structure holds an ``optax.MaskedNode``."""
  tree = jax.tree_util.tree_unflatten(skeleton, [0] * skeleton.num_leaves)
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  return any(map(is_masked, jax.tree_util.tree_leaves(tree, is_leaf=is_masked)))


class OutlineCache:
  """Outlines by (treedef, roles), and by the listed params too where they matter.

  ``make(tree, roles, listed)`` takes apart a tree whose leaves are their own
  indices (``listed`` None: by the roles alone).
  """

  def __init__(self, make: Callable[[Any, tuple, Any], Any], maxsize: int = 64):
    self.make, self.maxsize = make, maxsize
    self.lock = threading.Lock()
    self.outlines: dict[Any, Any] = {}  # leaves: indices into the flat state

  def _get(self, key: tuple, treedef: Any, roles: tuple, n: int, listed: Any, state: Any) -> Any:
    with self.lock:
      hit = self.outlines.get(key)
    # An outline vouches only for a tree of exact keys (jax takes a key True for 1):
    # any other is checked, and refused, as a structure no checkpoint holds is,
    # once per structure.
    if hit is None or (state is not None and not _storable.exact_keys(state)):
      _storable.check_structure(treedef, state)
    if hit is None:
      outline = self.make(jax.tree_util.tree_unflatten(treedef, list(range(n))), roles, listed)
      hit = (outline, listed is None and _keeps_masked_places(outline.skeleton))
      with self.lock:
        if len(self.outlines) >= self.maxsize:
          self.outlines.pop(next(iter(self.outlines)))
        self.outlines[key] = hit
    return hit

  def get(
    self,
    treedef: Any,
    roles: tuple,
    n: int,
    listed: Collection[str] | None = None,
    state: Any = None,
  ) -> Any:
    """The outline of ``treedef``; ``state``, when given, a tree of it whose keys
    are looked at (:func:`storable.exact_keys`)."""
    outline, masked = self._get((treedef, roles), treedef, roles, n, None, state)
    if masked and listed is not None:
      listed = frozenset(listed)
      outline = self._get((treedef, roles, listed), treedef, roles, n, listed, None)[0]
    return outline

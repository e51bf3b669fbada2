"""Refusals of archives as wholes: a record of the one record version there is, and
archives of one state whose params trees are trees of one state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.errors import PlacementError

__all__ = ["check_is_record", "check_one_tree", "check_records_iterable", "check_version"]


def _params_of(record: ShardRecord, limit: int = 3) -> str:
  """``params 'a', 'b', ... (N in all)``: names a whole archive's parameters briefly."""
  ids = [getattr(p, "param", p) for p in record.placements]
  if not ids:
    return "no params listed"
  shown = ", ".join(repr(i) for i in ids[:limit])
  more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
  return f"param {shown}" if len(ids) == 1 else f"params {shown}{more}"


def check_is_record(record: Any, where: str) -> None:
  if not isinstance(record, ShardRecord):
    raise PlacementError(f"{where}: expected a ShardRecord, got {type(record).__name__}")


def check_records_iterable(records: Any, what: str) -> None:
  """Refuses by name what is not an iterable of records (one record, a number, a str)."""
  if isinstance(records, (str, bytes, ShardRecord)) or not isinstance(records, Iterable):
    raise PlacementError(
      f"{what}: records must be an iterable of ShardRecords (a list: one per rank),"
      f" got {type(records).__name__}"
    )


def check_version(index: int, record: Any) -> None:
  """A ``ShardRecord`` of the one record version there is."""
  check_is_record(record, f"archive {index}")
  # The int 1 itself: True and 1.0 equal it but are not a record version.
  if type(record.version) is not int or record.version != RECORD_VERSION:
    raise PlacementError(
      f"{_params_of(record)}: archive {index} has record version {record.version!r},"
      f" which is not supported (only version {RECORD_VERSION} exists)"
    )


def check_one_tree(
  layouts: Iterable[tuple[int, _structure.StateParts]], seen: dict | None = None
) -> None:
  """Archives that hold the same params in each param-mirroring subtree hold them in
  the same tree: a list and a tuple, or a tree with and one without an empty node
  (``None``, ``{}``), are two states, whichever of them a target would take its tree
  from. ``layouts``: one (archive, state parts) per distinct layout; ``seen``: what
  earlier calls were given, for a caller that meets layouts one at a time.

  Archives of different param sets (groups) make one params tree too: a param
  of one is never a leaf where another's params lie under it (``experts`` and
  ``experts/w``), which no target could hold.

  Raises:
    PlacementError: naming two such archives and the subtree where they differ,
      or the leaf and the param under it.
  """
  seen = {} if seen is None else seen
  param_sets = seen.setdefault(_PARAM_SETS, [])  # (archive, ids) per distinct param set
  for archive, parts in layouts:
    key = tuple(frozenset(m.order) for m in parts.subtrees)
    ids = frozenset().union(*key)
    if all(ids != other for _, other in param_sets):
      for other_archive, other in param_sets:
        _check_no_nesting(other_archive, other, archive, ids)
      param_sets.append((archive, ids))
    trees = tuple(m.treedef for m in parts.subtrees)
    first = seen.setdefault(key, (archive, trees))
    if first[1] != trees:
      at = next(i for i, (a, b) in enumerate(zip(first[1], trees)) if a != b)
      where = parts.subtrees[at].prefix
      raise PlacementError(
        f"archives {first[0]} and {archive} hold the same params in other trees at state"
        f" path {_path(where)} ({str(first[1][at])[:150]} vs {str(trees[at])[:150]}):"
        " they are not archives of one state"
      )


# The key under which ``check_one_tree``'s ``seen`` keeps the param sets met.
_PARAM_SETS = "param sets"


def _check_no_nesting(a: int, ids_a: frozenset, b: int, ids_b: frozenset) -> None:
  """No id of one set is a key path above an id of the other (ids join keys with
  ``/``; a ``/`` inside a key is escaped, so every ``/`` ends an ancestor)."""
  for (x, xs), (y, ys) in (((a, ids_a), (b, ids_b)), ((b, ids_b), (a, ids_a))):
    for pid in ys:
      for i, c in enumerate(pid):
        if c == "/" and pid[:i] in xs:
          raise PlacementError(
            f"param {pid[:i]!r} is a leaf of archive {x}'s params tree, where archive {y}"
            f" holds param {pid!r} under it: they are not archives of one state"
          )


def _path(prefix: tuple) -> str:
  return jax.tree_util.keystr(prefix) or "(the root)"

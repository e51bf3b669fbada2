"""Writing the index of large layouts (format version 4, ``tableindex``): a layout
taken apart for the table, its digest, and an index value split into JSON and table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint.tableindex import layout_digest
from jaxreshard._src.checkpoint.tablelayout import canonical_text
from jaxreshard._src.core import structure as _structure

__all__ = ["encode", "factor", "factored_digest"]


def factor(state_parts: _structure.StateParts) -> tuple[dict, list[dict], list[dict]]:
  """A layout as a table holds it, from the state parts of a record of it.

  Returns the layout's JSON entry (its ``mirrors`` numbering its own structures
  from 0), its structures (``{"ids", "tree"}``: the tree None for nested dicts
  of the ids) and its mirrors' leaves (``{"dtypes", "slots"}``).
  """
  skeleton = jax.tree_util.tree_unflatten(
    state_parts.skeleton, list(range(len(state_parts.skeleton_leaves)))
  )
  tree, numbered = fmt.encode_tree(skeleton)
  assert numbered == list(range(len(state_parts.skeleton_leaves)))
  slots, n_scalars = [], 0
  for x in state_parts.skeleton_leaves:
    if isinstance(x, _structure.ParamsSubtreeSlot):
      slots.append({"m": x.index})
    else:
      slots.append({"s": n_scalars})
      n_scalars += 1
  structures: list[dict] = []
  known: dict[tuple, int] = {}
  refs, leaves = [], []
  for sub in state_parts.subtrees:
    order = list(sub.order)
    nested = _structure.nested(order, dict(zip(order, range(len(order))))) if order else {}
    flat, treedef = jax.tree_util.tree_flatten(nested)
    if flat == list(range(len(order))) and treedef == sub.treedef:
      st = None
    else:
      st = fmt.encode_tree(jax.tree_util.tree_unflatten(sub.treedef, list(range(len(order)))))[0]
    key = (tuple(order), json.dumps(st, separators=(",", ":")))
    if key not in known:
      known[key] = len(structures)
      structures.append({"ids": order, "tree": st})
    refs.append(known[key])
    infos = [sub.entries[p] for p in order]
    leaves.append(
      {
        "dtypes": [None if x is _structure.MASKED else np.dtype(x.dtype).name for x in infos],
        "slots": [0 if x is _structure.MASKED else int(np.size(x)) for x in infos],
      }
    )
  return {"skeleton": tree, "slots": slots, "mirrors": refs}, structures, leaves


def factored_digest(entry: dict, structures: Sequence[dict], leaves: Sequence[dict]) -> str:
  """``describes``' layout digest of a layout ``factor`` made (its structures its own)."""
  return layout_digest(
    canonical_text(
      entry,
      [(structures[s]["ids"], _tree_text(structures[s]["tree"]) or None) for s in entry["mirrors"]],
      [(m["dtypes"], m["slots"]) for m in leaves],
    )
  )


def _tree_text(tree: Any) -> str:
  return "" if tree is None else json.dumps(tree, separators=(",", ":"))


def encode(value: dict) -> tuple[dict, bytes]:
  """The JSON (unsigned) and the table of an index value with ``"structures"`` and
  ``"leaves"`` (``IndexBuilder.index()`` of large layouts)."""
  params, groups, archives = value["params"], value["groups"], value["archives"]
  structures, leaves = value["structures"], value["leaves"]
  pids = sorted({e[0] for e in params}.union(*(s["ids"] for s in structures)))
  name_of = {p: i for i, p in enumerate(pids)}
  dnames = sorted(
    {e[2] for e in params} | {d for m in leaves for d in m["dtypes"] if d is not None}
  )
  code = {d: i for i, d in enumerate(dnames)}
  raw = [p.encode("utf-8", "surrogatepass") for p in pids]  # lone surrogates too
  numbers = []
  for name, _, _ in archives:
    n = int(name[len("archive_") :])
    if name != f"archive_{n:05d}":
      raise ValueError(f"archive name {name!r} is not archive_ and its number")
    numbers.append(n)
  trees = [_tree_text(s["tree"]).encode("ascii") for s in structures]
  arrays = {
    "name_bytes": np.frombuffer(b"".join(raw), np.uint8),
    "name_ends": np.cumsum([len(r) for r in raw], dtype=np.int64),
    "param_name": [name_of[e[0]] for e in params],
    "param_dims_end": np.cumsum([len(e[1]) for e in params], dtype=np.int64),
    "param_dims": np.asarray([d for e in params for d in e[1]], np.int64),
    "param_dtype": [code[e[2]] for e in params],
    "param_trainable": [int(e[3]) for e in params],
    "group_world": [g["world_size"] for g in groups],
    "group_params_end": np.cumsum([len(g["params"]) for g in groups], dtype=np.int64),
    "group_params": np.asarray([p for g in groups for p in g["params"]], np.int64),
    "group_ranks_end": np.cumsum([len(g["ranks"]) for g in groups], dtype=np.int64),
    "group_archive": np.asarray([a for g in groups for a, _ in g["ranks"]], np.int64),
    "group_rank": np.asarray([r for g in groups for _, r in g["ranks"]], np.int64),
    "archive_number": numbers,
    "archive_layout": [x[1] for x in archives],
    "archive_clock": [x[2] for x in archives],
    "structure_ids_end": np.cumsum([len(s["ids"]) for s in structures], dtype=np.int64),
    "structure_ids": np.asarray([name_of[p] for s in structures for p in s["ids"]], np.int64),
    "structure_tree_end": np.cumsum([len(t) for t in trees], dtype=np.int64),
    "structure_tree": np.frombuffer(b"".join(trees), np.uint8),
    "mirror_leaves_end": np.cumsum([len(m["slots"]) for m in leaves], dtype=np.int64),
    "leaf_dtype": np.asarray(
      [-1 if d is None else code[d] for m in leaves for d in m["dtypes"]], np.int64
    ),
    "leaf_slots": np.asarray([s for m in leaves for s in m["slots"]], np.int64),
  }
  data, entry = _table.encode({k: np.asarray(v).reshape(-1) for k, v in arrays.items()})
  keys = ("format", "format_version", "checkpoint", "record_version", "layouts", "clocks", "source")
  return {**{k: value[k] for k in keys}, "dtypes": dnames, "table": entry}, data

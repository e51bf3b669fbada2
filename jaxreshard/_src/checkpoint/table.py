"""The index's binary table: the large, regular parts of a checkpoint's index as arrays.

An index whose layouts are large (format version 4, see ``reader``) keeps its
parameters, groups, archives and the optimizer subtrees of its layouts in
``jaxreshard.table`` beside ``jaxreshard.json``: named arrays of fixed dtypes
laid out back to back (each at a multiple of 8 bytes), read with one
``np.frombuffer`` per array. The signed index names the file, its size, its
sha256 and where each array lies (``"table": {"file", "bytes", "sha256",
"arrays": {name: [offset, count]}}``), so the index's own checksum covers the
table: a table changed, truncated, swapped for another checkpoint's or missing
is refused before any of its values is used.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.errors import ArchiveError

__all__ = ["SCHEMA", "TABLE_FILE", "encode", "read"]

TABLE_FILE = "jaxreshard.table"
# A table is a few tens of bytes per parameter, rank and history buffer: this
# bound is far above any real model's and refuses a table bomb before it is read.
MAX_TABLE_BYTES = 1 << 30
_ALIGN = 8
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")

# Every array a table holds, with its dtype (little-endian). ``*_end`` arrays are
# the cumulative ends of the variable-length rows of the array they index.
SCHEMA: dict[str, np.dtype] = {
  name: np.dtype(code)
  for name, code in (
    # Param ids, distinct and sorted: UTF-8 bytes back to back, and each one's end.
    ("name_bytes", "u1"),
    ("name_ends", "<i8"),
    # Param entries: id (index into the names), shape, dtype (into "dtypes"), trainable.
    ("param_name", "<i8"),
    ("param_dims_end", "<i8"),
    ("param_dims", "<i8"),
    ("param_dtype", "<i8"),
    ("param_trainable", "u1"),
    # Groups: world size, params (entries) and the (archive, rank) pairs.
    ("group_world", "<i8"),
    ("group_params_end", "<i8"),
    ("group_params", "<i8"),
    ("group_ranks_end", "<i8"),
    ("group_archive", "<i8"),
    ("group_rank", "<i8"),
    # Archives: the number in its name (archive_00012), its layout and its clock.
    ("archive_number", "<i8"),
    ("archive_layout", "<i8"),
    ("archive_clock", "<i8"),
    # The params trees of the layouts' optimizer subtrees: the id at each position
    # (flatten order), and the tree (encoded JSON; empty for nested dicts of the ids).
    ("structure_ids_end", "<i8"),
    ("structure_ids", "<i8"),
    ("structure_tree_end", "<i8"),
    ("structure_tree", "u1"),
    # Each optimizer subtree of each layout: per position its buffer's dtype (into
    # "dtypes"; -1 where the param is masked) and slots.
    ("mirror_leaves_end", "<i8"),
    ("leaf_dtype", "<i8"),
    ("leaf_slots", "<i8"),
  )
}


def encode(arrays: Mapping[str, Any]) -> tuple[bytes, dict]:
  """The table's bytes and the index's ``"table"`` entry describing them."""
  if set(arrays) != set(SCHEMA):
    raise ValueError(f"a table holds exactly {sorted(SCHEMA)}, got {sorted(arrays)}")
  parts, where, pos = [], {}, 0
  for name, dtype in SCHEMA.items():
    a = np.ascontiguousarray(np.asarray(arrays[name]).astype(dtype))
    pad = -pos % _ALIGN
    parts.append(b"\0" * pad)
    pos += pad
    where[name] = [pos, int(a.size)]
    parts.append(a.tobytes())
    pos += a.nbytes
  data = b"".join(parts)
  return data, {
    "file": TABLE_FILE,
    "bytes": len(data),
    "sha256": hashlib.sha256(data).hexdigest(),
    "arrays": where,
  }


def read(root: Any, entry: Any, where: str) -> dict[str, np.ndarray]:
  """The arrays of the table the index's ``entry`` describes, its checksum checked first.

  ``root`` is the checkpoint's root (``shardread.Dir``); ``where`` names the index.

  Raises:
    ArchiveError: the entry is malformed, the file is missing, not a regular file,
      of another size, fails the sha256 the index records (changed, damaged or
      another checkpoint's table), or an array lies outside it.
  """
  fmt.expect(entry, dict, f"{where}, table")
  if set(entry) != {"file", "bytes", "sha256", "arrays"}:
    raise ArchiveError(f"{where}: its table entry needs file, bytes, sha256 and arrays")
  if entry["file"] != TABLE_FILE:
    raise ArchiveError(f"{where}: its table is {fmt.short(entry['file'])}, not {TABLE_FILE}")
  size = fmt.expect(entry["bytes"], int, f"{where}, table")
  digest = entry["sha256"]
  if not (0 <= size <= MAX_TABLE_BYTES and isinstance(digest, str) and _SHA256.match(digest)):
    raise ArchiveError(f"{where}: its table entry has an invalid size or sha256")
  path = f"{root.path}/{TABLE_FILE}"
  if not root.exists(TABLE_FILE):
    raise ArchiveError(
      f"{path} is missing, but the index {where} keeps its layout in it; the checkpoint is"
      " incomplete"
    )
  data = root.read_bytes(TABLE_FILE, size)
  if len(data) != size:
    raise ArchiveError(
      f"{path} has {len(data)} bytes but the index records {size}; the table is truncated or"
      " not this checkpoint's"
    )
  return arrays_of(data, entry, where, path)


def arrays_of(data: bytes, entry: Any, where: str, path: str) -> dict[str, np.ndarray]:
  """The arrays of the table bytes ``data``, as ``read`` checks them once read: the
  sha256 and the arrays' places that the index's ``entry`` records (its file name
  and size checked by the caller); ``path`` names the table in refusals."""
  digest = entry["sha256"]
  size = len(data)
  actual = hashlib.sha256(data).hexdigest()
  if actual != digest:
    raise ArchiveError(
      f"{path} fails its checksum (sha256 {actual[:16]}... of its bytes, but the index records"
      f" {digest[:16]}...): the table was changed or damaged, or it is another checkpoint's"
    )
  arrays = fmt.expect(entry["arrays"], dict, f"{where}, table")
  if set(arrays) != set(SCHEMA):
    raise ArchiveError(f"{where}: its table holds arrays {fmt.short(sorted(arrays))}")
  out = {}
  for name, dtype in SCHEMA.items():
    at = arrays[name]
    if not (
      isinstance(at, list)
      and len(at) == 2
      and all(type(x) is int for x in at)
      and at[0] >= 0
      and at[0] % _ALIGN == 0
      and 0 <= at[1] <= (size - at[0]) // dtype.itemsize
    ):
      raise ArchiveError(f"{path}: array {name} {fmt.short(at)} does not lie inside the table")
    out[name] = np.frombuffer(data, dtype, at[1], at[0])
  return out

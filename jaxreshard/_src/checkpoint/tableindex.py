"""The index of large layouts (format version 4): signed JSON and a binary table beside it.

An index whose layouts hold many history buffers keeps its large, regular
parts in ``jaxreshard.table`` (``table``): params, groups, archives and, per
layout, its optimizer subtrees (*mirrors*) taken apart as
``_structure.StateParts`` takes a state apart. Its JSON keeps the rest::

  {"checksum": ..., "format", "format_version": 4, "checkpoint", "record_version",
   "dtypes": ["float32", ...],          # what the table's dtype codes name
   "layouts": [{"skeleton": tree,       # the state, each mirror a leaf (its slot)
                "slots": [{"s": 0}, {"m": 0}, {"m": 1}],  # scalar or mirror, in order
                "mirrors": [0, 0]}],     # each mirror's params tree (a structure)
   "clocks", "source",
   "table": {"file": "jaxreshard.table", "bytes", "sha256", "arrays"}}

The index's checksum covers the table through the size and sha256 it records,
so the table is read (one ``np.frombuffer`` per array) and checked before any
value in it is used; every value is then checked as the JSON index's are, with
array operations. A writer holds the same index as one JSON-like value
(``IndexBuilder.index()``: params, groups and archives as lists, and
``"structures"`` and ``"leaves"`` of the mirrors), which ``tablewrite.encode``
splits into the two files.

Each ``archive.json`` records digests of what the index says of its archive
(``describes``): of its layout (the canonical JSON of the layout's entry,
its mirrors' params trees and leaves: ``layout.canonical_text``), of its clock,
and of its placements: per (world size, rank) it holds, the sha256 of the
compact JSON list of its param entries (``[id, shape, dtype, trainable]``)
sorted by their JSON text; the sorted ``[world_size, rank, sha256]`` triples
are hashed once more. The table lists param entries in that order, so a
group's entries are hashed as they lie, once per group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import archivejson as _archivejson
from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import indexjson as _indexjson
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint.tablelayout import Structure, TableLayout
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE
from jaxreshard._src.errors import ArchiveError

__all__ = ["content_digest", "describes", "layout_digest", "parse", "placements_digest"]

# Archive names of a table: ``archive_`` and the number, at least 5 digits, at most 9.
MAX_ARCHIVE_NUMBER = 10**9 - 1


# --- reading --------------------------------------------------------------------


def _refuse(where: str, what: str) -> ArchiveError:
  return ArchiveError(f"{where}: {what}")


def _starts(ends: np.ndarray, rows: int, total: int, where: str, what: str) -> np.ndarray:
  """The row starts (and a last end) of variable-length rows whose cumulative ``ends``
  must be ``rows`` non-decreasing offsets ending at ``total``."""
  if len(ends) != rows or (
    rows and (int(ends[0]) < 0 or bool((np.diff(ends) < 0).any()) or int(ends[-1]) != total)
  ):
    raise _refuse(where, f"the rows of {what} do not tile its {total} values")
  if not rows and total:
    raise _refuse(where, f"{what} holds {total} values in no row")
  return np.concatenate([[0], ends]).astype(np.int64)


def _first(mask: np.ndarray) -> int:
  return int(np.flatnonzero(mask)[0])


def _pids(arrays: Mapping[str, np.ndarray], where: str) -> list[str]:
  """The distinct param ids: UTF-8, at most ``MAX_ID_CHARS`` each, strictly increasing."""
  raw = arrays["name_bytes"].tobytes()
  at = _starts(arrays["name_ends"], len(arrays["name_ends"]), len(raw), where, "param ids")
  bounds = list(zip(at[:-1].tolist(), at[1:].tolist()))
  if raw.isascii():
    text = raw.decode("ascii")
    pids = [text[a:b] for a, b in bounds]
  else:
    try:
      # As the JSON index holds any str (lone surrogates escaped), so does the table.
      pids = [raw[a:b].decode("utf-8", "surrogatepass") for a, b in bounds]
    except UnicodeDecodeError:
      raise _refuse(where, "a param id is not UTF-8") from None
  if pids and max(map(len, pids)) > _index.MAX_ID_CHARS:
    i = next(i for i, p in enumerate(pids) if len(p) > _index.MAX_ID_CHARS)
    raise _refuse(
      where, f"param id {i} has {len(pids[i])} characters (at most {_index.MAX_ID_CHARS})"
    )
  if not all(map(str.__lt__, pids, pids[1:])):
    raise _refuse(where, "the param ids are not distinct and sorted")
  return pids


def _counts(dims: np.ndarray, at: np.ndarray, where: str) -> np.ndarray:
  """Each shape's element count; a shape ``fmt.valid_shape`` refuses is refused."""
  n = len(at) - 1
  ndim = np.diff(at)
  bad = []
  if len(dims) and int(dims.min()) < 0:
    bad.append(int(np.searchsorted(at, _first(dims < 0), side="right")) - 1)
  if n and int(ndim.max()) > fmt.MAX_NDIM:
    bad.append(_first(ndim > fmt.MAX_NDIM))
  if bad:
    p = min(bad)
    raise _refuse(
      f"{where}, param {p}",
      f"shape {fmt.short(tuple(dims[at[p] : at[p + 1]].tolist()))} is not a valid array shape",
    )
  count = np.ones(n, np.int64)
  some = np.flatnonzero(ndim > 0)
  if len(some):
    # The extent (zeros counted as ones) bounds the count; a float product bounds the
    # exact one, and only shapes near the limit are multiplied exactly.
    approx = np.multiply.reduceat(np.maximum(dims, 1).astype(np.float64), at[some])
    for p in some[approx > fmt.MAX_EXTENT / 2].tolist():
      shape = tuple(dims[at[p] : at[p + 1]].tolist())
      if not fmt.valid_shape(shape):
        raise _refuse(f"{where}, param {p}", f"shape {shape} is not a valid array shape")
    count[some] = np.multiply.reduceat(dims, at[some])
  return count


def _codes(codes: np.ndarray, n: int, low: int, where: str, what: str) -> None:
  if len(codes) and (int(codes.min()) < low or int(codes.max()) >= n):
    raise _refuse(where, f"{what} {int(codes[(codes < low) | (codes >= n)][0])} does not exist")


def parse(
  index: dict,
  read_table: Callable[[Any], dict],
  where: str,
  checkpoint_id: str,
  record_version: int,
) -> _index.Index:
  """An index whose JSON names a table (its header already checked): every value checked."""
  dtypes = [
    fmt.np_dtype(d, f"{where}, dtype {i}")
    for i, d in enumerate(fmt.expect(index["dtypes"], list, where))
  ]
  if len(set(dtypes)) != len(dtypes):
    raise _refuse(where, "its dtypes repeat")
  a = read_table(index["table"])
  tw = f"{where.rsplit('/', 1)[0]}/{_table.TABLE_FILE}"
  pids = _pids(a, tw)
  n_p = len(a["param_name"])
  for name in ("param_dtype", "param_trainable"):
    if len(a[name]) != n_p:
      raise _refuse(tw, f"{name} has {len(a[name])} rows for {n_p} params")
  dims_at = _starts(a["param_dims_end"], n_p, len(a["param_dims"]), tw, "param shapes")
  _codes(a["param_name"], len(pids), 0, tw, "param id")
  _codes(a["param_dtype"], len(dtypes), 0, tw, "dtype")
  if n_p and int(a["param_trainable"].max()) > 1:
    raise _refuse(tw, "a param's trainable flag is not 0 or 1")
  count = _counts(a["param_dims"], dims_at, f"{tw}")
  clocks = _indexjson._raw_clocks(index, where, n_p)  # pylint: disable=protected-access
  layouts = _layouts(index, a, pids, dtypes, where, tw)
  # Archives: numbered in increasing order, each with a layout and a clock of as many scalars.
  number, layout, clock = a["archive_number"], a["archive_layout"], a["archive_clock"]
  n_a = len(number)
  if not n_a:
    raise _refuse(where, "the archive list is empty")
  if len(layout) != n_a or len(clock) != n_a:
    raise _refuse(tw, "every archive needs a number, a layout and a clock")
  if int(number.min()) < 0 or int(number.max()) > MAX_ARCHIVE_NUMBER:
    raise _refuse(tw, "an archive's number is not one of an archive's name")
  if bool((np.diff(number) <= 0).any()):
    i = _first(np.diff(number) <= 0) + 1
    raise _refuse(
      f"{tw}, archive {i}",
      f"archive_{int(number[i]):05d} is listed after archive_{int(number[i - 1]):05d}; archives"
      " are listed in the order of their names",
    )
  bad = (layout < 0) | (layout >= len(layouts)) | (clock < 0) | (clock >= len(clocks))
  if bad.any():
    i = _first(bad)
    raise _refuse(
      f"{tw}, archive {i}", f"layout {int(layout[i])} or clock {int(clock[i])} does not exist"
    )
  scalars = np.asarray([L.n_scalars for L in layouts], np.int64)[layout]
  ticks = np.asarray([len(c) for c in clocks], np.int64)[clock]
  if (scalars != ticks).any():
    i = _first(scalars != ticks)
    raise _refuse(
      f"{tw}, archive {i}",
      f"its clock has {int(ticks[i])} scalars but its layout {int(scalars[i])}",
    )
  clocks = _indexjson.decode_clocks(clocks, clock, where)
  tables = _groups(a, pids, dtypes, count, dims_at, n_a, tw)
  source = _indexjson._parse_source(  # pylint: disable=protected-access
    index["source"], f"{where}, source", tables.g_world.tolist()
  )
  out = _index.Index(
    id=checkpoint_id,
    version=4,
    table=True,
    record_version=record_version,
    tables=tables,
    layouts=layouts,
    clocks=clocks,
    source=source,
    raw={"clocks": index["clocks"]},
    describe=describes,
    content=lambda: content_digest(index, a, record_version),
  )
  out.archive_numbers = number
  return out


def _groups(
  a: Mapping[str, np.ndarray],
  pids: Sequence[str],
  dtypes: Sequence[np.dtype],
  count: np.ndarray,
  dims_at: np.ndarray,
  n_archives: int,
  where: str,
) -> _index.Tables:
  world = a["group_world"]
  n_g = len(world)
  params_at = _starts(a["group_params_end"], n_g, len(a["group_params"]), where, "group params")
  ranks_at = _starts(a["group_ranks_end"], n_g, len(a["group_archive"]), where, "group ranks")
  if len(a["group_rank"]) != len(a["group_archive"]):
    raise _refuse(where, "every [archive, rank] pair of a group needs both")
  if n_g and (int(world.min()) < 1 or int(world.max()) > MAX_WORLD_SIZE):
    g = _first((world < 1) | (world > MAX_WORLD_SIZE))
    raise _refuse(
      f"{where}, group {g}", f"world_size {int(world[g])} must be between 1 and {MAX_WORLD_SIZE}"
    )
  params = a["group_params"]
  of_param = np.repeat(np.arange(n_g), np.diff(params_at))
  if len(params) and (int(params.min()) < 0 or int(params.max()) >= len(a["param_name"])):
    g = int(of_param[_first((params < 0) | (params >= len(a["param_name"])))])
    raise _refuse(f"{where}, group {g}", "a param index is out of range")
  # A param id at most once per group.
  key = np.lexsort((a["param_name"][params], of_param))
  names = a["param_name"][params][key]
  twice = (names[1:] == names[:-1]) & (of_param[key][1:] == of_param[key][:-1])
  if twice.any():
    raise _refuse(where, f"group {int(of_param[key][1:][twice][0])} lists a param twice")
  archive, rank = a["group_archive"], a["group_rank"]
  of_pair = np.repeat(np.arange(n_g), np.diff(ranks_at))
  if len(archive) and (int(archive.min()) < 0 or int(archive.max()) >= n_archives):
    i = _first((archive < 0) | (archive >= n_archives))
    raise _refuse(f"{where}, group {int(of_pair[i])}", f"archive {int(archive[i])} does not exist")
  outside = (rank < 0) | (rank >= world[of_pair])
  if outside.any():
    i = _first(outside)
    g = int(of_pair[i])
    first = [pids[n] for n in a["param_name"][params[params_at[g] : params_at[g + 1]]][:4]]
    raise _refuse(
      f"{where}, group {g}",
      f"archive {int(archive[i])} (archive_{int(a['archive_number'][archive[i]]):05d}) has rank"
      f" {int(rank[i])}, outside world_size {int(world[g])} of params {first[:3]}"
      f"{'...' if len(first) > 3 else ''}",
    )
  back = (np.diff(archive) <= 0) & (of_pair[1:] == of_pair[:-1])
  if back.any():
    i = _first(back) + 1
    raise _refuse(
      f"{where}, group {int(of_pair[i])}",
      f"archive {int(archive[i])} is listed twice"
      if archive[i] == archive[i - 1]
      else "[archive, rank] pairs must list archives in increasing order; archive"
      f" {int(archive[i])} follows archive {int(archive[i - 1])}",
    )
  return _index.Tables(
    pids=pids,
    dtypes=dtypes,
    p_name=a["param_name"],
    p_count=count,
    p_dtype=a["param_dtype"],
    p_trainable=a["param_trainable"].astype(bool),
    p_dims_at=dims_at,
    p_dims=a["param_dims"],
    g_world=world,
    g_params_at=params_at,
    g_params=params,
    g_ranks_at=ranks_at,
    g_archive=archive,
    g_rank=rank,
    a_layout=a["archive_layout"],
    a_clock=a["archive_clock"],
  )


def _layouts(
  index: dict,
  a: Mapping[str, np.ndarray],
  pids: Sequence[str],
  dtypes: Sequence[np.dtype],
  where: str,
  tw: str,
) -> tuple[TableLayout, ...]:
  """Every layout: its skeleton from the JSON, its mirrors' trees and leaves from the table."""
  entries = fmt.expect(index["layouts"], list, where)
  n_s = len(a["structure_ids_end"])
  ids_at = _starts(a["structure_ids_end"], n_s, len(a["structure_ids"]), tw, "structure ids")
  tree_at = _starts(a["structure_tree_end"], n_s, len(a["structure_tree"]), tw, "structure trees")
  ids = a["structure_ids"]
  _codes(ids, len(pids), 0, tw, "param id")
  # A param at most once per params tree.
  of_id = np.repeat(np.arange(n_s), np.diff(ids_at))
  key = np.lexsort((ids, of_id))
  twice = (ids[key][1:] == ids[key][:-1]) & (of_id[key][1:] == of_id[key][:-1])
  if twice.any():
    s = int(of_id[key][1:][twice][0])
    raise _refuse(
      f"{tw}, structure {s}",
      f"parameter {pids[int(ids[key][1:][twice][0])]!r} appears twice in one optimizer subtree",
    )
  trees = a["structure_tree"].tobytes()
  if not trees.isascii():
    raise _refuse(tw, "a structure's tree is not ASCII JSON")
  structures = [
    Structure(ids[ids_at[s] : ids_at[s + 1]], trees[tree_at[s] : tree_at[s + 1]])
    for s in range(n_s)
  ]
  n_m = len(a["mirror_leaves_end"])
  leaves_at = _starts(a["mirror_leaves_end"], n_m, len(a["leaf_dtype"]), tw, "mirror leaves")
  code, slots = a["leaf_dtype"], a["leaf_slots"]
  if len(slots) != len(code):
    raise _refuse(tw, "every leaf needs a dtype and slots")
  _codes(code, len(dtypes), -1, tw, "dtype")
  for c in _copyplan.unique_ints(code[code >= 0]).tolist():
    fmt.buffer_dtype(dtypes[c], f"{tw}, leaves")
  bad = (slots < 0) | (slots > fmt.MAX_EXTENT) | ((code < 0) & (slots != 0))
  if bad.any():
    raise _refuse(tw, f"{int(slots[_first(bad)])} slots is not a buffer size")
  mirrors = [
    (code[leaves_at[m] : leaves_at[m + 1]], slots[leaves_at[m] : leaves_at[m + 1]])
    for m in range(n_m)
  ]
  out, m0 = [], 0
  for i, e in enumerate(entries):
    k = (
      len(e.get("mirrors", ())) if isinstance(e, dict) and isinstance(e.get("mirrors"), list) else 0
    )
    out.append(
      TableLayout(e, structures, mirrors[m0 : m0 + k], pids, dtypes, f"{where}, layout {i}")
    )
    m0 += k
  if m0 != n_m:
    raise _refuse(where, f"its layouts have {m0} mirrors but its table {n_m}")
  return tuple(out)


# --- digests: what each archive.json records of its index --------------------------


# The table arrays that name an archive or say which rank it holds: left out of
# ``content_digest``, so that the parts of one reshard (one rank each) share one.
_IDENTITY_ARRAYS = frozenset({"archive_number", "group_rank"})


def content_digest(
  index: Mapping[str, Any], arrays: Mapping[str, np.ndarray], record_version: int
) -> str:
  """The sha256 of everything a table index says but its identity, its source, its
  archives' names and the ranks they hold: its record version, dtypes, layouts'
  and clocks' JSON, and every other table array (name, dtype, shape and bytes)."""
  h = hashlib.sha256()
  head = [
    index["format_version"],
    record_version,
    index["dtypes"],
    index["layouts"],
    index["clocks"],
  ]
  h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
  for name in sorted(arrays):
    if name in _IDENTITY_ARRAYS:
      continue
    v = np.ascontiguousarray(arrays[name])
    h.update(json.dumps([name, v.dtype.str, list(v.shape)]).encode())
    h.update(v.tobytes())
  return h.hexdigest()


def layout_digest(text: str) -> str:
  """The sha256 (hex) of ASCII ``text``: a layout's canonical text, or param entries' JSON."""
  return hashlib.sha256(text.encode("ascii")).hexdigest()


def placements_digest(buckets: Mapping[tuple[int, int], str]) -> str:
  """The digest of an archive's placements: ``(world_size, rank) -> sha256`` of the
  JSON list of its param entries there, sorted by their JSON text."""
  return _index._json_digest(sorted([w, r, h] for (w, r), h in buckets.items()))  # pylint: disable=protected-access


def describes(index: _index.Index, archive: int) -> dict[str, str]:
  """``Index.describes`` of an index read from a table."""
  t = index.tables
  cache = index.digests
  at = np.flatnonzero(t.g_archive == archive)
  group = np.searchsorted(t.g_ranks_at, at, side="right") - 1
  buckets: dict[tuple[int, int], list[int]] = {}
  for g, r in zip(group.tolist(), t.g_rank[at].tolist()):
    buckets.setdefault((int(t.g_world[g]), r), []).append(g)
  hashes = {}
  for key, gs in buckets.items():
    h = cache.get(("groups", tuple(gs)))
    if h is None:
      ps = np.sort(np.concatenate([t.group_params(g) for g in gs]))
      h = cache[("groups", tuple(gs))] = layout_digest(_entries_json(index, ps))
    hashes[key] = h
  layout = int(t.a_layout[archive])
  ld = cache.get(("layout", layout))
  if ld is None:
    ld = cache[("layout", layout)] = layout_digest(index.layouts[layout].digest_text)
  return {
    "layout": ld,
    "clock": index.clock_digests[int(t.a_clock[archive])],
    "placements": placements_digest(hashes),
  }


def _plain(text: str) -> bool:
  """Whether JSON writes ``text`` in a string as it is (printable ASCII, no quote or
  backslash: ``json.dumps`` escapes nothing of it)."""
  return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _entries_json(index: _index.Index, ps: np.ndarray) -> str:
  """``json.dumps(_entries(index, ps), separators=(",", ":"))``, the same text; where every
  id is written as it is, joined from each entry's parts without making the lists."""
  t = index.tables
  pids = [t.pids[n] for n in t.p_name[ps].tolist()]
  if not _plain("".join(pids)):
    return json.dumps(_entries(index, ps), separators=(",", ":"))
  names = [json.dumps(d.name) for d in t.dtypes]
  dtype = [names[d] for d in t.p_dtype[ps].tolist()]
  flag = ["true" if tr else "false" for tr in t.p_trainable[ps].tolist()]
  at, dims = t.p_dims_at, t.p_dims
  ndim = at[ps + 1] - at[ps]
  if (ndim == 1).all():  # vectors: one dim each
    shapes = list(map(str, dims[at[ps]].tolist()))
  else:
    flat = dims.tolist()
    shapes = [",".join(map(str, flat[s : s + k])) for s, k in zip(at[ps].tolist(), ndim.tolist())]
  return (
    "["
    + ",".join(
      f'["{pid}",[{shape}],{d},{tr}]' for pid, shape, d, tr in zip(pids, shapes, dtype, flag)
    )
    + "]"
  )


def _entries(index: _index.Index, ps: np.ndarray) -> list[list]:
  """``[id, shape, dtype, trainable]`` of param entries ``ps``, as the JSON index has them."""
  t = index.tables
  pids, names = t.pids, [d.name for d in t.dtypes]
  dims, at = t.p_dims, t.p_dims_at
  ndim = (at[ps + 1] - at[ps]).tolist()
  start = at[ps].tolist()
  flat = dims.tolist() if len(ps) * 4 > len(dims) else None
  out = []
  for n, k, s, d, tr in zip(
    t.p_name[ps].tolist(), ndim, start, t.p_dtype[ps].tolist(), t.p_trainable[ps].tolist()
  ):
    shape = flat[s : s + k] if flat is not None else dims[s : s + k].tolist()
    out.append([pids[n], shape, names[d], bool(tr)])
  return out


def parse_signed(raw: bytes, where: str, table: Callable[[Any], Any]) -> _index.Index:
  """A signed index file's bytes, checksum verified and every field checked, read as a
  load reads it (``table(entry)`` gives the arrays of the binary table it may name);
  a save parses what it is about to write the same way."""
  return _indexjson.parse_index(
    _archivejson.signed_value(raw, where, _index.FORMAT), where, table, parse
  )

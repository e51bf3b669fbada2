"""The index's JSON encoding parsed into an ``Index``, every field checked.

A table index (format version 4 of a large layout) hands its arrays to
``parse_table``; the header, the clocks and the source entry are checked here
for both encodings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import clockjson as _clockjson
from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint.index import (
  _ID,
  _INDEX_KEYS,
  _SHA256,
  _SOURCE_KEYS,
  FORMAT,
  MAX_CLOCK_SCALARS_BASE,
  MAX_CLOCK_SCALARS_PER_PARAM,
  MAX_ID_CHARS,
  READ_VERSIONS,
  READ_WORDS,
  TABLE_INDEX_KEYS,
  Group,
  Index,
  ParamEntry,
  Source,
  Tables,
)
from jaxreshard._src.checkpoint.layout import ArchiveLayout, JsonLayout, LeafInfo, _ScalarSlot
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE
from jaxreshard._src.core.record import RECORD_VERSION
from jaxreshard._src.errors import ArchiveError, PlacementError


def parse_index(index: Any, where: str, table: Any = None, parse_table: Any = None) -> Index:
  """The index's JSON value, every field checked; ``where`` names the file in refusals.

  ``table(entry)`` reads the binary table an index of large layouts names, and
  ``parse_table(index, table, where, checkpoint_id, record_version)`` parses such
  an index from it (``tableindex.parse``).
  """
  checkpoint_id, record_version = _parse_header(index, where)
  if "table" in index:
    if parse_table is None:
      raise ArchiveError(
        f"{where}: the index names a binary table, which this reader does not read"
      )
    return parse_table(index, table, where, checkpoint_id, record_version)
  params = _parse_params(fmt.expect(index["params"], list, where), where)
  archives = fmt.expect(index["archives"], list, where)
  if not archives:
    raise ArchiveError(f"{where}: the archive list is empty")
  layouts = tuple(
    _parse_layout(e, f"{where}, layout {i}")
    for i, e in enumerate(fmt.expect(index["layouts"], list, where))
  )
  raw_clocks = _raw_clocks(index, where, len(params))
  names, archive_layout, archive_clock = _parse_archives(archives, layouts, raw_clocks, where)
  clocks = decode_clocks(raw_clocks, archive_clock, where)
  groups = tuple(
    _parse_group(e, f"{where}, group {i}", params, names)
    for i, e in enumerate(fmt.expect(index["groups"], list, where))
  )
  member: list[list[tuple[int, int]]] = [[] for _ in names]
  for gi, g in enumerate(groups):
    for a, r in g.ranks:
      member[a].append((gi, r))
  # Each layout is taken apart with the params its archives list, as each archive's
  # own listing takes its state apart in memory.
  of_layout: list[set[int]] = [set() for _ in layouts]
  for a, m in enumerate(member):
    of_layout[archive_layout[a]].update(gi for gi, _ in m)
  for layout, gis in zip(layouts, of_layout):
    layout.take_apart({params[p].param for gi in gis for p in groups[gi].params})
  param_index = tuple({params[p].param: p for p in g.params} for g in groups)
  for gi, pindex in enumerate(param_index):
    if len(pindex) != len(groups[gi].params):
      raise ArchiveError(f"{where}: group {gi} lists a param twice")
  source = _parse_source(index["source"], f"{where}, source", [g.world_size for g in groups])
  out = Index(
    id=checkpoint_id,
    version=index["format_version"],
    table=False,
    record_version=record_version,
    tables=_tables_of(params, groups, archive_layout, archive_clock, layouts),
    layouts=layouts,
    clocks=clocks,
    source=source,
    raw={k: index[k] for k in ("params", "layouts", "clocks")},
  )
  # What the JSON parse made already stands for what ``Index`` would make of the arrays.
  out.__dict__.update(
    params=params,
    groups=groups,
    names=names,
    archive_layout=archive_layout,
    archive_clock=archive_clock,
    member=tuple(tuple(m) for m in member),
    param_index=param_index,
  )
  return out


def _raw_clocks(index: dict, where: str, n_params: int) -> list[list]:
  """Every clock's scalars as JSON, not yet decoded; ``n_params`` bounds how many
  scalars one may have."""
  return [
    _clock_scalars(e, f"{where}, clock {i}", n_params)
    for i, e in enumerate(fmt.expect(index["clocks"], list, where))
  ]


def decode_clocks(raw: list[list], used: Any, where: str) -> tuple[list, ...]:
  """The clocks, decoded, once every one is known to be some archive's (``used``: the
  clock of each archive): a clock no archive has is refused before any scalar of
  the index is decoded (each costs a device array)."""
  unused = sorted(set(range(len(raw))).difference(np.asarray(used, np.int64).tolist()))
  if unused:
    raise ArchiveError(f"{where}, clock {unused[0]}: no archive has it")
  return tuple(
    [_clockjson.decode_scalar(x, f"{where}, clock {i}, scalar {k}") for k, x in enumerate(c)]
    for i, c in enumerate(raw)
  )


def _tables_of(
  params: Sequence[ParamEntry],
  groups: Sequence[Group],
  archive_layout: Sequence[int],
  archive_clock: Sequence[int],
  layouts: Sequence[JsonLayout],
) -> Tables:
  """The arrays of an index parsed from JSON; its layouts get their columns."""
  pids = sorted({e.param for e in params}.union(*(L.state_parts.param_set() for L in layouts)))
  name_of = {p: i for i, p in enumerate(pids)}
  dtypes: dict[np.dtype, int] = {}
  for d in [e.dtype for e in params] + [
    x.dtype for L in layouts for x in L.leaves if isinstance(x, LeafInfo)
  ]:
    dtypes.setdefault(d, len(dtypes))
  dtype_list = list(dtypes)
  for L in layouts:
    L.attach(pids, name_of, dtype_list)
  i64 = np.int64
  n = len(params)
  return Tables(
    pids=pids,
    dtypes=dtype_list,
    p_name=np.fromiter((name_of[e.param] for e in params), i64, n),
    p_count=np.fromiter((math.prod(e.shape) for e in params), i64, n),
    p_dtype=np.fromiter((dtypes[e.dtype] for e in params), i64, n),
    p_trainable=np.fromiter((e.trainable for e in params), bool, n),
    p_dims_at=np.concatenate([[0], np.cumsum([len(e.shape) for e in params], dtype=i64)]).astype(
      i64
    ),
    p_dims=np.asarray([d for e in params for d in e.shape], i64),
    g_world=np.asarray([g.world_size for g in groups], i64),
    g_params_at=np.concatenate([[0], np.cumsum([len(g.params) for g in groups], dtype=i64)]).astype(
      i64
    ),
    g_params=np.asarray([p for g in groups for p in g.params], i64),
    g_ranks_at=np.concatenate([[0], np.cumsum([len(g.ranks) for g in groups], dtype=i64)]).astype(
      i64
    ),
    g_archive=np.asarray([a for g in groups for a, _ in g.ranks], i64),
    g_rank=np.asarray([r for g in groups for _, r in g.ranks], i64),
    a_layout=np.asarray(archive_layout, i64),
    a_clock=np.asarray(archive_clock, i64),
  )


def _parse_header(index: Any, where: str) -> tuple[str, int]:
  """The format, its version, the keys, the checkpoint identity and the record version."""
  if not isinstance(index, dict) or index.get("format") != FORMAT:
    raise ArchiveError(f"{where} does not describe a {FORMAT}")
  version = index.get("format_version")
  if type(version) is not int or version not in READ_VERSIONS:
    raise ArchiveError(
      f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
      f" reads {READ_WORDS} (a version-1 checkpoint needs the jaxreshard that"
      " wrote it: load it there and save it again)"
      if version == 1
      else f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
      f" reads {READ_WORDS}"
    )
  keys = TABLE_INDEX_KEYS if "table" in index and version == 4 else _INDEX_KEYS
  if set(index) != keys:
    raise ArchiveError(f"{where}: unexpected index keys {sorted(index)}")
  checkpoint_id = index["checkpoint"]
  if not isinstance(checkpoint_id, str) or not _ID.match(checkpoint_id):
    raise ArchiveError(f"{where}: invalid checkpoint identity {str(checkpoint_id)[:80]!r}")
  record_version = fmt.expect(index["record_version"], int, where)
  if record_version != RECORD_VERSION:
    raise PlacementError(
      f"{where}: record version {record_version!r} is not supported"
      f" (only version {RECORD_VERSION} exists)"
    )
  return checkpoint_id, record_version


def _parse_archives(
  archives: list, layouts: Sequence[ArchiveLayout], clocks: Sequence[list], where: str
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
  # ``clocks``: each clock's scalars (their number is checked here, not their values).
  """Each archive's ``[name, layout, clock]``, listed in the order of their names."""
  names, archive_layout, archive_clock = [], [], []
  for i, e in enumerate(archives):
    aw = f"{where}, archive {i}"
    if not (isinstance(e, list) and len(e) == 3):
      raise ArchiveError(f"{aw}: expected [name, layout, clock]")
    name = fmt.check_name(e[0], fmt.ARCHIVE_NAME, aw)
    layout, clock = fmt.expect(e[1], int, aw), fmt.expect(e[2], int, aw)
    if not (0 <= layout < len(layouts) and 0 <= clock < len(clocks)):
      raise ArchiveError(f"{aw}: layout {layout} or clock {clock} does not exist")
    if layouts[layout].n_scalars != len(clocks[clock]):
      raise ArchiveError(
        f"{aw}: its clock has {len(clocks[clock])} scalars but its"
        f" layout {layouts[layout].n_scalars}"
      )
    names.append(name)
    archive_layout.append(layout)
    archive_clock.append(clock)
  if len(set(names)) != len(names):
    raise ArchiveError(f"{where}: the archive list has repeats")
  # Archives are listed in the order of their names (the i-th record is written
  # as archive_i), so reordering the list cannot relabel whose data is whose.
  numbers = [int(n[len("archive_") :]) for n in names]
  for i in range(1, len(numbers)):
    if numbers[i] <= numbers[i - 1]:
      raise ArchiveError(
        f"{where}, archive {i}: {names[i]} is listed after"
        f" {names[i - 1]}; archives are listed in the order of their names"
      )
  return tuple(names), tuple(archive_layout), tuple(archive_clock)


def _parse_source(e: Any, where: str, worlds: Sequence[int]) -> Source | None:
  """The checkpoint a reshard read (None for a save of its own); its world size is
  every group's."""
  if e is None:
    return None
  fmt.expect(e, dict, where)
  if set(e) != _SOURCE_KEYS:
    raise ArchiveError(
      f"{where}: expected checkpoint, world_size and layout, got keys {fmt.short(sorted(e))}"
    )
  if not (isinstance(e["checkpoint"], str) and _ID.match(e["checkpoint"])):
    raise ArchiveError(f"{where}: invalid checkpoint identity {fmt.short(e['checkpoint'])}")
  world = fmt.expect(e["world_size"], int, where)
  if not 1 <= world <= MAX_WORLD_SIZE:
    raise ArchiveError(f"{where}: world_size {world} must be between 1 and {MAX_WORLD_SIZE}")
  if not (isinstance(e["layout"], str) and _SHA256.match(e["layout"])):
    raise ArchiveError(f"{where}: invalid layout {fmt.short(e['layout'])} (a sha256 in hex)")
  for gi, w in enumerate(worlds):
    if w != world:
      raise ArchiveError(f"{where}: world_size {world}, but group {gi} has world_size {w}")
  return Source(e["checkpoint"], world, e["layout"])


def _param_names(params: Sequence[ParamEntry], group_params: Sequence[int]) -> str:
  names = [params[p].param for p in group_params[:3]]
  return f"{names}{'...' if len(group_params) > 3 else ''}"


def _parse_params(entries: list, where: str) -> tuple[ParamEntry, ...]:
  """Every ``[id, shape, dtype, trainable]`` entry. The common entry (a short id, a
  shape of non-negative ints, a dtype name seen before, a bool) takes the short
  way; anything else is checked field by field, with its message."""
  out = []
  dtypes: dict[str, np.dtype] = {}
  for i, e in enumerate(entries):
    if type(e) is list and len(e) == 4 and type(e[0]) is str and type(e[3]) is bool:
      d = dtypes.get(e[2]) if type(e[2]) is str else None
      dims = e[1]
      if (
        d is not None
        and len(e[0]) <= MAX_ID_CHARS
        and type(dims) is list
        and all(type(x) is int for x in dims)
      ):
        shape = tuple(dims)
        if fmt.valid_shape(shape):
          out.append(ParamEntry(e[0], shape, d, e[3]))
          continue
    p = _parse_param(e, f"{where}, param {i}")
    dtypes[e[2]] = p.dtype
    out.append(p)
  return tuple(out)


def _parse_param(e: Any, where: str) -> ParamEntry:
  if not (isinstance(e, list) and len(e) == 4):
    raise ArchiveError(f"{where}: expected [id, shape, dtype, trainable]")
  if isinstance(e[0], str) and len(e[0]) > MAX_ID_CHARS:
    raise ArchiveError(f"{where}: a param id of {len(e[0])} characters (at most {MAX_ID_CHARS})")
  return ParamEntry(
    fmt.expect(e[0], str, where),
    fmt.shape_of(e[1], where),
    fmt.np_dtype(e[2], where),
    fmt.expect(e[3], bool, where),
  )


def _parse_layout(e: Any, where: str) -> JsonLayout:
  fmt.expect(e, dict, where)
  if set(e) != {"tree", "leaves"}:
    raise ArchiveError(f"{where}: expected tree and leaves")
  leaves, n_scalars = [], 0
  dtypes: dict[str, np.dtype] = {}
  for i, x in enumerate(fmt.expect(e["leaves"], list, where)):
    # The common leaf, a well-formed history buffer, takes the short way; anything
    # else is checked field by field below, with its message.
    if type(x) is list and len(x) == 3 and type(x[0]) is str and type(x[2]) is int:
      d = dtypes.get(x[1]) if type(x[1]) is str else None
      if d is not None and 0 <= x[2] <= fmt.MAX_EXTENT:
        leaves.append(LeafInfo(x[0], (x[2],), d))
        continue
    lw = f"{where}, leaf {i}"
    if isinstance(x, dict) and set(x) == {"s"}:
      if x["s"] != n_scalars:
        raise ArchiveError(f"{lw}: clock scalars must be numbered in order")
      leaves.append(_ScalarSlot(n_scalars))
      n_scalars += 1
    elif isinstance(x, list) and len(x) == 3:
      slots = fmt.expect(x[2], int, lw)
      if not 0 <= slots <= fmt.MAX_EXTENT:
        raise ArchiveError(f"{lw}: {slots} slots is not a buffer size")
      d = fmt.buffer_dtype(fmt.np_dtype(x[1], lw), lw)
      dtypes[x[1]] = d
      leaves.append(LeafInfo(fmt.expect(x[0], str, lw), (slots,), d))
    else:
      raise ArchiveError(f"{lw}: invalid leaf {str(x)[:80]!r}")
  return JsonLayout(e["tree"], leaves, where)


def _clock_scalars(e: Any, where: str, n_params: int) -> list[Any]:
  scalars = fmt.expect(e, list, where)
  limit = MAX_CLOCK_SCALARS_BASE + MAX_CLOCK_SCALARS_PER_PARAM * n_params
  if len(scalars) > limit:
    raise ArchiveError(
      f"{where}: {len(scalars)} optimizer scalars for {n_params}"
      f" params, more than an optimizer has (at most {limit})"
    )
  return scalars


def _parse_group(e: Any, where: str, params: Sequence[ParamEntry], names: Sequence[str]) -> Group:
  fmt.expect(e, dict, where)
  if set(e) != {"world_size", "params", "ranks"}:
    raise ArchiveError(f"{where}: expected world_size, params and ranks")
  world = fmt.expect(e["world_size"], int, where)
  if not 1 <= world <= MAX_WORLD_SIZE:
    raise ArchiveError(f"{where}: world_size {world} must be between 1 and {MAX_WORLD_SIZE}")
  group_params = tuple(fmt.expect(p, int, where) for p in fmt.expect(e["params"], list, where))
  if any(not 0 <= p < len(params) for p in group_params):
    raise ArchiveError(f"{where}: a param index is out of range")
  ranks = []
  for pair in fmt.expect(e["ranks"], list, where):
    if not (isinstance(pair, list) and len(pair) == 2):
      raise ArchiveError(f"{where}: expected [archive, rank] pairs")
    a, r = fmt.expect(pair[0], int, where), fmt.expect(pair[1], int, where)
    if not 0 <= a < len(names):
      raise ArchiveError(f"{where}: archive {a} does not exist")
    if not 0 <= r < world:
      raise ArchiveError(
        f"{where}: archive {a} ({names[a]}) has rank {r}, outside"
        f" world_size {world} of params {_param_names(params, group_params)}"
      )
    if ranks and a == ranks[-1][0]:
      # One archive holds one rank's placements: listed at two ranks, every param
      # would be planned twice (work as ranks x params) before being refused.
      raise ArchiveError(f"{where}: archive {a} ({names[a]}) is listed twice")
    if ranks and a < ranks[-1][0]:
      raise ArchiveError(
        f"{where}: [archive, rank] pairs must list archives in increasing"
        f" order; archive {a} follows archive {ranks[-1][0]}"
      )
    ranks.append((a, r))
  return Group(world, group_params, tuple(ranks))

"""The checkpoint index's format: constants, the entries it parses into, digests.

Both encodings of the index (format version 3 and 4's JSON; version 4's JSON
and binary table for large layouts, ``tableindex``) parse into one ``Index``:
its arrays (``Index.tables``), its layouts, and, made when first asked, the
per-entry objects (``ParamEntry``, ``Group``, each archive's groups) that the
per-archive paths read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint.layout import ArchiveLayout, JsonLayout, LeafInfo, _ScalarSlot  # noqa: F401  (re-exported)
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.errors import ArchiveError, PlacementError, ReshardError

FORMAT = "jaxreshard-checkpoint"
# The version of the on-disk checkpoint layout (index, archives, buffer files); the
# records inside carry their own ``RECORD_VERSION``.
FORMAT_VERSION = 4
# The versions this jaxreshard reads: 3 (the index is JSON alone) and 4 (JSON alone,
# or JSON and a binary table beside it for large layouts; ``tableindex``).
READ_VERSIONS = (3, 4)
INDEX_FILE = "jaxreshard.json"
ARCHIVE_FILE = "archive.json"
# Restores read whole chunks: smaller chunks round partial reads less, at 4
# bytes of checksum (and two iovecs) each. At 16 KiB a target rank at 8 -> 6
# reads 1.12x the bytes it copies (256 KiB: 1.47x), for about the same CPU time.
DEFAULT_CHUNK_BYTES = 16 << 10
# The largest chunk a save writes: one read call reads a whole chunk, and Linux returns
# at most 0x7ffff000 bytes per call, so a larger chunk could never be read back.
MAX_CHUNK_BYTES = 1 << 30


def check_chunk_bytes(value: Any) -> None:
  """``chunk_bytes`` of a save: a positive integer of at most ``MAX_CHUNK_BYTES``."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ReshardError(f"chunk_bytes {value!r} must be a positive integer")
  if value > MAX_CHUNK_BYTES:
    raise ReshardError(
      f"chunk_bytes {value} is over {MAX_CHUNK_BYTES} (1 GiB): a chunk is read back in"
      " one read call, which the operating system caps below 2 GiB"
    )


# Metadata grows with parameters and ranks; these bounds are far above any
# real model's (a 10,000-parameter Adam state over 4,096 ranks has a ~3 MB
# index) and refuse a metadata bomb before it is parsed.
MAX_INDEX_BYTES = 64 << 20
MAX_ARCHIVE_BYTES = 64 << 20
# Optimizer scalars (counters, hyper-parameters) come a few per transformation,
# at most a few per parameter (a count per masked or labelled subtree): more
# than this is not an optimizer's state, and would only cost time to print.
MAX_CLOCK_SCALARS_BASE = 1024
MAX_CLOCK_SCALARS_PER_PARAM = 8
# Param ids are key paths; no model's run to this length.
MAX_ID_CHARS = 4096
# Reads of chunk spans go through a reused scratch buffer of this size.
STAGING_BYTES = 8 << 20

_INDEX_KEYS = {
  "format",
  "format_version",
  "checkpoint",
  "record_version",
  "params",
  "groups",
  "layouts",
  "clocks",
  "archives",
  "source",
}
# An index of large layouts keeps its params, groups, archives and the mirrors of
# its layouts in its binary table (``tableindex``); its JSON names the dtypes those
# arrays refer to, and each layout's skeleton.
TABLE_INDEX_KEYS = (_INDEX_KEYS - {"params", "groups", "archives"}) | {"dtypes", "table"}
_SOURCE_KEYS = {"checkpoint", "world_size", "layout"}
_ID = re.compile(r"[0-9a-f]{32}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_TERM_MOD = 1 << 128


def _json_digest(obj: Any) -> str:
  """The sha256 (hex) of ``obj``'s canonical JSON (compact, keys sorted, ASCII)."""
  return hashlib.sha256(
    json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("ascii")
  ).hexdigest()


def _param_term(entry: Any) -> int:
  """A param entry's (``[id, shape, dtype, trainable]``) term in a placement digest."""
  raw = json.dumps(entry, separators=(",", ":")).encode("ascii")
  return int.from_bytes(hashlib.sha256(raw).digest()[:16], "little")


def _placements_digest(buckets: dict[tuple[int, int], int]) -> str:
  """What an archive holds, as ``(world_size, rank) -> sum of its param terms``.

  A sum per (world_size, rank) does not depend on how params are split into
  groups, so the writer (param by param) and the reader (group by group) make
  the same digest, and the reader's cost is one term per group, not per param.
  """
  return _json_digest(sorted([w, r, f"{t % _TERM_MOD:032x}"] for (w, r), t in buckets.items()))


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a resharded checkpoint came from (the index's ``source``).

  Attributes:
    checkpoint: the identity of the checkpoint it was resharded from.
    world_size: the target world size.
    layout: ``target_layout`` of its archives (None until the first archive
      of a save is seen; every archive must then have it).
  """

  checkpoint: str
  world_size: int
  layout: str | None = None

  def to_json(self) -> dict:
    return {"checkpoint": self.checkpoint, "world_size": self.world_size, "layout": self.layout}


class SourcedRecords:
  """Records to save, with the ``Source`` the saved index names (``write_checkpoint``)."""

  def __init__(self, records: Iterable[ShardRecord], source: Source):
    self.records = records
    self.source = source

  def __iter__(self):
    return iter(self.records)


# An archive's entry for a parameter that two of its groups list.
_TWICE = object()


@dataclasses.dataclass(frozen=True)
class Group:
  """Parameters split the same way over the same archives."""

  world_size: int
  params: tuple[int, ...]  # indices into Checkpoint.params
  ranks: tuple[tuple[int, int], ...]  # (archive, rank) pairs


@dataclasses.dataclass(frozen=True)
class ParamEntry:
  param: str
  shape: tuple[int, ...]
  dtype: np.dtype
  trainable: bool


@dataclasses.dataclass(frozen=True)
class Tables:
  """The index as arrays (int64 but ``trainable``), checked when parsed.

  Attributes:
    pids: the distinct param ids of params and layouts, sorted; dtypes: the
      distinct dtypes of params and buffers (``p_name``, ``p_dtype`` and the
      layouts' columns index into these).
    p_name, p_count, p_dtype, p_trainable: per param entry; its shape is
      ``p_dims[p_dims_at[i]:p_dims_at[i + 1]]``.
    g_world: per group; its params (entries) are ``g_params[g_params_at[g]:
      g_params_at[g + 1]]``, its (archive, rank) pairs ``g_archive``/``g_rank``
      from ``g_ranks_at[g]`` to ``g_ranks_at[g + 1]``.
    a_layout, a_clock: per archive.
  """

  pids: Sequence[str]
  dtypes: Sequence[np.dtype]
  p_name: np.ndarray
  p_count: np.ndarray
  p_dtype: np.ndarray
  p_trainable: np.ndarray
  p_dims_at: np.ndarray
  p_dims: np.ndarray
  g_world: np.ndarray
  g_params_at: np.ndarray
  g_params: np.ndarray
  g_ranks_at: np.ndarray
  g_archive: np.ndarray
  g_rank: np.ndarray
  a_layout: np.ndarray
  a_clock: np.ndarray

  def group_params(self, g: int) -> np.ndarray:
    return self.g_params[self.g_params_at[g] : self.g_params_at[g + 1]]

  def group_ranks(self, g: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = self.g_ranks_at[g], self.g_ranks_at[g + 1]
    return self.g_archive[a:b], self.g_rank[a:b]


class Index:
  """A checkpoint's index, parsed and checked once (``parse_index``, ``tableindex``).

  Attributes:
    id: the checkpoint's identity, shared by every archive of one save.
    version: its format version; table: whether a binary table holds its layout.
    record_version: the version of the records the archives hold.
    tables: the index as arrays (``Tables``).
    layouts: the distinct state layouts.
    clocks: the distinct optimizer clocks (decoded scalars).
    source: the checkpoint a reshard read, or None.
    raw: the index's JSON entries its digests are made of.

  Made when first asked: ``params`` (the distinct ``ParamEntry``s), ``groups``
  (``Group``s), ``names`` (each archive's), ``archive_layout``,
  ``archive_clock``, ``member`` (per archive, its ``(group, rank)`` pairs) and
  ``param_index`` (per group, ``param id -> param entry``).
  """

  archive_numbers: np.ndarray  # per archive, the number of its name (a table index)

  def __init__(
    self, *, id, version, table, record_version, tables, layouts, clocks, source, raw, describe=None
  ):
    """``describe(index, archive)``: ``describes`` of an index whose layouts are in a
    binary table (the JSON encoding's own when None)."""
    self.id, self.version, self.table, self.record_version = id, version, table, record_version
    self._describe = describe
    self.tables, self.layouts, self.clocks, self.source, self.raw = (
      tables,
      layouts,
      clocks,
      source,
      raw,
    )

  @functools.cached_property
  def params(self) -> tuple[ParamEntry, ...]:
    t = self.tables
    pids, dtypes, dims, at = t.pids, t.dtypes, t.p_dims.tolist(), t.p_dims_at.tolist()
    return tuple(
      ParamEntry(pids[n], tuple(dims[at[i] : at[i + 1]]), dtypes[d], bool(tr))
      for i, (n, d, tr) in enumerate(
        zip(t.p_name.tolist(), t.p_dtype.tolist(), t.p_trainable.tolist())
      )
    )

  @functools.cached_property
  def groups(self) -> tuple[Group, ...]:
    t = self.tables
    out = []
    for g, w in enumerate(t.g_world.tolist()):
      archive, rank = t.group_ranks(g)
      out.append(
        Group(w, tuple(t.group_params(g).tolist()), tuple(zip(archive.tolist(), rank.tolist())))
      )
    return tuple(out)

  @functools.cached_property
  def names(self) -> tuple[str, ...]:
    """Each archive's name (a table records its number: ``archive_00012``)."""
    return tuple(f"archive_{n:05d}" for n in self.archive_numbers.tolist())

  @functools.cached_property
  def name_of(self) -> dict[str, int]:
    """``param id -> its index`` into ``tables.pids``."""
    return {p: i for i, p in enumerate(self.tables.pids)}

  @functools.cached_property
  def archive_layout(self) -> tuple[int, ...]:
    return tuple(self.tables.a_layout.tolist())

  @functools.cached_property
  def archive_clock(self) -> tuple[int, ...]:
    return tuple(self.tables.a_clock.tolist())

  @functools.cached_property
  def member(self) -> tuple[tuple[tuple[int, int], ...], ...]:
    t = self.tables
    member: list[list[tuple[int, int]]] = [[] for _ in range(len(t.a_layout))]
    group = np.repeat(np.arange(len(t.g_world)), np.diff(t.g_ranks_at))
    for gi, a, r in zip(group.tolist(), t.g_archive.tolist(), t.g_rank.tolist()):
      member[a].append((gi, r))
    return tuple(tuple(m) for m in member)

  @functools.cached_property
  def param_index(self) -> tuple[dict, ...]:
    t, pids = self.tables, self.tables.pids
    return tuple(
      {pids[n]: p for p, n in zip(ps.tolist(), t.p_name[ps].tolist())}
      for ps in (t.group_params(g) for g in range(len(t.g_world)))
    )

  # The digests ``describes`` compares with an archive's ``archive.json`` are made the
  # first time an archive is read, not when the index is opened: planning reads none.
  @functools.cached_property
  def group_terms(self) -> tuple[int, ...]:
    """Per group, the sum of its params' placement-digest terms."""
    terms = [_param_term(e) for e in self.raw["params"]]
    return tuple(sum(terms[p] for p in g.params) % _TERM_MOD for g in self.groups)

  @functools.cached_property
  def layout_digests(self) -> tuple[str, ...]:
    return tuple(_json_digest(e) for e in self.raw["layouts"])

  @functools.cached_property
  def clock_digests(self) -> tuple[str, ...]:
    return tuple(_json_digest(e) for e in self.raw["clocks"])

  def describes(self, archive: int) -> dict[str, str]:
    """Digests of what the index says of ``archive``: its layout, its clock and its
    params' ``(id, shape, dtype, trainable)`` at each (world size, rank)."""
    if self._describe is not None:
      return self._describe(self, archive)
    buckets: dict[tuple[int, int], int] = {}
    for gi, r in self.member[archive]:
      key = (self.groups[gi].world_size, r)
      buckets[key] = buckets.get(key, 0) + self.group_terms[gi]
    return {
      "layout": self.layout_digests[self.archive_layout[archive]],
      "clock": self.clock_digests[self.archive_clock[archive]],
      "placements": _placements_digest(buckets),
    }


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
  clocks = _parse_clocks(index, where, len(params))
  names, archive_layout, archive_clock = _parse_archives(archives, layouts, clocks, where)
  groups = tuple(
    _parse_group(e, f"{where}, group {i}", params, names)
    for i, e in enumerate(fmt.expect(index["groups"], list, where))
  )
  member: list[list[tuple[int, int]]] = [[] for _ in names]
  for gi, g in enumerate(groups):
    for a, r in g.ranks:
      member[a].append((gi, r))
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


def _parse_clocks(index: dict, where: str, n_params: int) -> tuple[list, ...]:
  """Every clock; ``n_params`` bounds how many scalars one may have."""
  return tuple(
    _parse_clock(e, f"{where}, clock {i}", n_params)
    for i, e in enumerate(fmt.expect(index["clocks"], list, where))
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


READ_WORDS = "versions 3 and 4"


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
        and all(type(x) is int and x >= 0 for x in dims)
      ):
        shape = tuple(dims)
        if math.prod(shape) <= 2**62:
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
      if d is not None and 0 <= x[2] <= 2**62:
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
      if not 0 <= slots <= 2**62:
        raise ArchiveError(f"{lw}: {slots} slots is not a buffer size")
      d = fmt.np_dtype(x[1], lw)
      dtypes[x[1]] = d
      leaves.append(LeafInfo(fmt.expect(x[0], str, lw), (slots,), d))
    else:
      raise ArchiveError(f"{lw}: invalid leaf {str(x)[:80]!r}")
  return JsonLayout(e["tree"], leaves, where)


def _parse_clock(e: Any, where: str, n_params: int) -> list[Any]:
  scalars = fmt.expect(e, list, where)
  limit = MAX_CLOCK_SCALARS_BASE + MAX_CLOCK_SCALARS_PER_PARAM * n_params
  if len(scalars) > limit:
    raise ArchiveError(
      f"{where}: {len(scalars)} optimizer scalars for {n_params}"
      f" params, more than an optimizer has (at most {limit})"
    )
  return [fmt.decode_scalar(x, f"{where}, scalar {k}") for k, x in enumerate(scalars)]


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
    if ranks and a < ranks[-1][0]:
      raise ArchiveError(
        f"{where}: [archive, rank] pairs must list archives in increasing"
        f" order; archive {a} follows archive {ranks[-1][0]}"
      )
    ranks.append((a, r))
  return Group(world, group_params, tuple(ranks))

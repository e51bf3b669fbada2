"""The checkpoint index's format: constants, the entries it parses into, digests."""

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
from jaxreshard._src.checkpoint.layout import ArchiveLayout, LeafInfo, _ScalarSlot  # noqa: F401  (re-exported)
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.errors import ArchiveError, PlacementError, ReshardError

FORMAT = "jaxreshard-checkpoint"
# The version of the on-disk checkpoint layout (index, archives, buffer files); the
# records inside carry their own ``RECORD_VERSION``.
FORMAT_VERSION = 3
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
class Index:
  """A checkpoint's index, parsed and checked once (``parse_index``).

  Attributes:
    id: the checkpoint's identity, shared by every archive of one save.
    record_version: the version of the records the archives hold.
    params: the distinct param entries.
    layouts: the distinct state layouts.
    clocks: the distinct optimizer clocks (decoded scalars).
    names, archive_layout, archive_clock: each archive's name, layout and clock.
    groups: params split the same way over the same archives.
    member: per archive, its ``(group, rank)`` pairs.
    param_index: per group, ``param id -> param entry``.
    group_terms: per group, the sum of its params' placement-digest terms (made when first asked).
    layout_digests, clock_digests: the digest of each layout and clock entry (likewise).
    raw: the index's params, layouts and clocks as read, for those digests.
    source: the checkpoint a reshard read, or None.
  """

  id: str
  record_version: int
  params: tuple[ParamEntry, ...]
  layouts: tuple[ArchiveLayout, ...]
  clocks: tuple[list, ...]
  names: tuple[str, ...]
  archive_layout: tuple[int, ...]
  archive_clock: tuple[int, ...]
  groups: tuple[Group, ...]
  member: tuple[tuple[tuple[int, int], ...], ...]
  param_index: tuple[dict, ...]
  source: Source | None
  raw: dict = dataclasses.field(repr=False, compare=False)  # params, layouts, clocks as read

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
    buckets: dict[tuple[int, int], int] = {}
    for gi, r in self.member[archive]:
      key = (self.groups[gi].world_size, r)
      buckets[key] = buckets.get(key, 0) + self.group_terms[gi]
    return {
      "layout": self.layout_digests[self.archive_layout[archive]],
      "clock": self.clock_digests[self.archive_clock[archive]],
      "placements": _placements_digest(buckets),
    }


def parse_index(index: Any, where: str) -> Index:
  """The index's JSON value, every field checked; ``where`` names the file in refusals."""
  checkpoint_id, record_version = _parse_header(index, where)
  params = _parse_params(fmt.expect(index["params"], list, where), where)
  archives = fmt.expect(index["archives"], list, where)
  if not archives:
    raise ArchiveError(f"{where}: the archive list is empty")
  layouts = tuple(
    _parse_layout(e, f"{where}, layout {i}")
    for i, e in enumerate(fmt.expect(index["layouts"], list, where))
  )
  clocks = tuple(
    _parse_clock(e, f"{where}, clock {i}", len(params))
    for i, e in enumerate(fmt.expect(index["clocks"], list, where))
  )
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
  source = _parse_source(index["source"], f"{where}, source", groups)
  return Index(
    checkpoint_id,
    record_version,
    params,
    layouts,
    clocks,
    names,
    archive_layout,
    archive_clock,
    groups,
    tuple(tuple(m) for m in member),
    param_index,
    source,
    {k: index[k] for k in ("params", "layouts", "clocks")},
  )


def _parse_header(index: Any, where: str) -> tuple[str, int]:
  """The format, its version, the keys, the checkpoint identity and the record version."""
  if not isinstance(index, dict) or index.get("format") != FORMAT:
    raise ArchiveError(f"{where} does not describe a {FORMAT}")
  version = index.get("format_version")
  if version != FORMAT_VERSION:
    raise ArchiveError(
      f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
      f" reads version {FORMAT_VERSION} (a version-1 checkpoint needs the jaxreshard that"
      " wrote it: load it there and save it again)"
      if version == 1
      else f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
      f" reads version {FORMAT_VERSION}"
    )
  if set(index) != _INDEX_KEYS:
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


def _parse_source(e: Any, where: str, groups: Sequence[Group]) -> Source | None:
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
  for gi, g in enumerate(groups):
    if g.world_size != world:
      raise ArchiveError(
        f"{where}: world_size {world}, but group {gi} has world_size {g.world_size}"
      )
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


def _parse_layout(e: Any, where: str) -> ArchiveLayout:
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
  return ArchiveLayout(e["tree"], leaves, where)


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

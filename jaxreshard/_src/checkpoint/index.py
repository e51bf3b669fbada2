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
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint.layout import ArchiveLayout, JsonLayout, LeafInfo, _ScalarSlot  # noqa: F401  (re-exported)
from jaxreshard._src.core.ids import MAX_ID_CHARS  # noqa: F401  (re-exported)
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.errors import ReshardError

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
  """A checkpoint's index, parsed and checked once (``indexjson.parse_index``, ``tableindex``).

  Attributes:
    id: the checkpoint's identity, shared by every archive of one save.
    version: its format version; table: whether a binary table holds its layout.
    record_version: the version of the records the archives hold.
    tables: the index as arrays (``Tables``).
    layouts: the distinct state layouts.
    clocks: the distinct optimizer clocks (decoded scalars).
    source: the checkpoint a reshard read, or None.
    raw: the index's JSON entries its digests are made of.
    digests: the digests a table index's ``describes`` made, kept for the index's life.
    content: a table index's ``content_digest``: the sha256 of everything it says but
      its identity, its source, its archives' names and the ranks they hold; None for
      a JSON index. Two indexes with one content list the same params, groups (world
      sizes, params, archives), layouts and clocks, archive for archive, so whatever
      is made of those alone (never of a rank) is the same for both.

  Made when first asked: ``params`` (the distinct ``ParamEntry``s), ``groups``
  (``Group``s), ``names`` (each archive's), ``archive_layout``,
  ``archive_clock``, ``member`` (per archive, its ``(group, rank)`` pairs) and
  ``param_index`` (per group, ``param id -> param entry``).
  """

  archive_numbers: np.ndarray  # per archive, the number of its name (a table index)

  def __init__(
    self,
    *,
    id,
    version,
    table,
    record_version,
    tables,
    layouts,
    clocks,
    source,
    raw,
    describe=None,
    content=None,
  ):
    """``describe(index, archive)``: ``describes`` of an index whose layouts are in a
    binary table (the JSON encoding's own when None). ``content()``: its content
    digest, made when first asked (None: it has none)."""
    self._content = content
    self.id, self.version, self.table, self.record_version = id, version, table, record_version
    self._describe = describe
    # The digests ``describe`` makes, by what each digests: made of this index alone,
    # they live as long as it does.
    self.digests: dict[tuple, str] = {}
    self.tables, self.layouts, self.clocks, self.source, self.raw = (
      tables,
      layouts,
      clocks,
      source,
      raw,
    )

  @functools.cached_property
  def content(self) -> str | None:
    return None if self._content is None else self._content()

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
  def ungrouped(self) -> tuple[int, ...]:
    """The archives no group lists (those that list no param), in order."""
    listed = np.zeros(len(self.tables.a_layout), bool)
    listed[self.tables.g_archive] = True
    return tuple(np.flatnonzero(~listed).tolist())

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


READ_WORDS = "versions 3 and 4"

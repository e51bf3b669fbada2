"""The checkpoint index's format: constants, the entries it parses into, digests."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import ArchiveError, ReshardError
from jaxreshard._src.core.record import ShardRecord

FORMAT = "jaxreshard-checkpoint"
# The version of the on-disk checkpoint layout (index, archives, buffer files); the
# records inside carry their own ``RECORD_VERSION``.
FORMAT_VERSION = 3
INDEX_FILE = "jaxreshard.json"
ARCHIVE_FILE = "archive.json"
# Restores read whole chunks: smaller chunks round partial reads less, at 4
# bytes of checksum each.
DEFAULT_CHUNK_BYTES = 256 << 10
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

_INDEX_KEYS = {"format", "format_version", "checkpoint", "record_version", "params", "groups",
               "layouts", "clocks", "archives", "source"}
_SOURCE_KEYS = {"checkpoint", "world_size", "layout"}
_ID = re.compile(r"[0-9a-f]{32}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_TERM_MOD = 1 << 128


def _json_digest(obj: Any) -> str:
  """The sha256 (hex) of ``obj``'s canonical JSON (compact, keys sorted, ASCII)."""
  return hashlib.sha256(json.dumps(obj, separators=(",", ":"), sort_keys=True)
                        .encode("ascii")).hexdigest()


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
  layout: Optional[str] = None

  def to_json(self) -> dict:
    return {"checkpoint": self.checkpoint, "world_size": self.world_size, "layout": self.layout}


class SourcedRecords:
  """Records to save, with the ``Source`` the saved index names (``write_checkpoint``)."""

  def __init__(self, records: Iterable[ShardRecord], source: Source):
    self.records = records
    self.source = source

  def __iter__(self):
    return iter(self.records)


@dataclasses.dataclass
class ReadStats:
  """What ``Checkpoint.read_runs`` read from buffer files: a counter the caller owns.

  Attributes:
    reads: read calls (one per span of consecutive chunks).
    chunks: chunks read, each with its crc32c.
    bytes: bytes read from the shard files (chunk data and checksums).
  """

  reads: int = 0
  chunks: int = 0
  bytes: int = 0


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """A history buffer of a layout: shape ``(slots,)`` and dtype, no data."""

  param: str
  shape: tuple[int]
  dtype: np.dtype

  @property
  def size(self) -> int:
    return self.shape[0]


@dataclasses.dataclass(frozen=True)
class _ScalarSlot:
  index: int


class Layout:
  """One state layout of the index: tree, roles, history buffers, packing offsets."""

  def __init__(self, tree: Any, leaves: list[Any], where: str):
    self.tree = tree
    self.where = where
    self.leaves = leaves  # LeafInfo or _ScalarSlot, in tree-leaf order
    self.roles = tuple(x.param if isinstance(x, LeafInfo) else None for x in leaves)
    self.n_scalars = sum(isinstance(x, _ScalarSlot) for x in leaves)
    placeholder = fmt.decode_tree(tree, leaves, where)
    try:
      self.anatomy = _structure.anatomy(placeholder, self.roles)
    except _structure.StatePartsError as e:
      raise ArchiveError(f"{where}: {e}") from None
    self.offsets: dict[tuple[str, int], tuple[np.dtype, int, int]] = {}
    self.sizes: dict[np.dtype, int] = {}
    for pid, m, info in _copyplan.packing_order(
        {p: self.anatomy.history(p) for p in self.anatomy.param_set()}):
      start = self.sizes.get(info.dtype, 0)
      self.offsets[(pid, m)] = (info.dtype, start, info.size)
      self.sizes[info.dtype] = start + info.size
    self._templates: dict[int, _structure.StateParts] = {}
    # (param, mirror) of each history leaf, by the leaf's identity.
    self._keys = {id(info): (pid, mi) for mi, mirror in enumerate(self.anatomy.mirrors)
                  for pid, info in mirror.entries.items() if isinstance(info, LeafInfo)}

  def state(self, scalars: Sequence[Any], buffers: dict[tuple[str, int], Any]) -> Any:
    """The archive's state: clock scalars and history buffers put in the tree."""
    leaves = [scalars[x.index] if isinstance(x, _ScalarSlot) else buffers[self._keys[id(x)]]
              for x in self.leaves]
    return fmt.decode_tree(self.tree, leaves, self.where)

  def infos(self) -> dict[tuple[str, int], LeafInfo]:
    """Every history buffer of the layout, by (param, mirror)."""
    return {key: info for info in self.leaves if isinstance(info, LeafInfo)
            for key in (self._keys[id(info)],)}

  def template(self, clock_id: int, scalars: Sequence[Any]) -> _structure.StateParts:
    """The anatomy of an archive with this layout and clock (for building targets)."""
    t = self._templates.get(clock_id)
    if t is None:
      leaves = [scalars[x.index] if isinstance(x, _ScalarSlot) else x for x in self.leaves]
      t = self._templates[clock_id] = _structure.anatomy(
          fmt.decode_tree(self.tree, leaves, self.where), self.roles)
    return t


# An archive's entry for a parameter that two of its groups list.
_TWICE = object()


@dataclasses.dataclass(frozen=True)
class _Pads:
  """The history buffers in one archive's packed buffer of one dtype, and their padding.

  Buffer ``k`` lies at ``[starts[k], stops[k])`` of the packed buffer; its
  elements from ``owned[k]`` on are padding (past what the rank's flat shard
  owns), which must hold zero bits. ``trailing[k]`` are the archives of the
  all-padding ranks after this one when this rank holds its param's last element.
  """

  starts: np.ndarray
  owned: np.ndarray
  stops: np.ndarray
  keys: list  # (param, mirror) of each buffer
  shards: list  # each buffer's FlatShard, or None where the index gives it none
  trailing: list
  index: dict  # (param, mirror) -> k


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


def _signed(raw: bytes, where: str, what: str) -> dict:
  """A signed JSON file's value (a dict), its checksum checked before anything is parsed.

  A file without a checksum is refused; it is parsed only to say why (another
  kind of file, or a format version that had no checksum), never to be used.
  """
  if fmt.is_signed(raw):
    return fmt.verified_json(raw, where)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    raise ArchiveError(f"{where} is not UTF-8 JSON") from None
  value = fmt.loads(text, where)
  if not isinstance(value, dict) or value.get("format") != FORMAT:
    raise ArchiveError(f"{where} does not describe a {what}")
  version = value.get("format_version")
  if version == 1:
    raise ArchiveError(
        f"{where}: checkpoint format version 1 is not supported; this jaxreshard reads version"
        f" {FORMAT_VERSION} (a version-1 checkpoint needs the jaxreshard that wrote it: load it"
        " there and save it again)")
  if version == 2:
    raise ArchiveError(
        f"{where}: checkpoint format version 2 is not supported; this jaxreshard reads version"
        f" {FORMAT_VERSION}: version 2 has no checksum over its index and archive metadata, so"
        " an edited or damaged value could not be told apart (load it with the jaxreshard that"
        " wrote it and save it again)")
  return fmt.verified_json(raw, where)  # refuses it: no checksum

def allocate(n: int, dtype: np.dtype, what: str, *, zeros: bool = True) -> np.ndarray:
  """A fresh ``(n,)`` buffer for a read; more than the process can get is a ReshardError."""
  dtype = np.dtype(dtype)
  try:
    return np.zeros(n, dtype) if zeros else np.empty(n, dtype)
  except MemoryError:
    raise ReshardError(
        f"{what}: a buffer of {n} {dtype.name} elements ({n * dtype.itemsize} bytes) needs more"
        " memory than this process can get") from None


def path_arg(directory: Any, what: str = "directory") -> str:
  """``directory`` as an absolute path; anything that is not a path is refused by name."""
  if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
    raise ReshardError(f"{what} must be a path (str or os.PathLike), got"
                       f" {type(directory).__name__}")
  path = os.fspath(directory)
  if not isinstance(path, str) or not path or "\0" in path:
    raise ReshardError(f"{what} {path!r} is not a usable path")
  return os.path.abspath(path)

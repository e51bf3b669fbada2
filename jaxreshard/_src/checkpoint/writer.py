"""Writing checkpoints: archives, their buffers and the index (see ``reader``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint import clockjson as _clockjson
from jaxreshard._src.checkpoint import deferredindex as _deferredindex
from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint import entries as _entries
from jaxreshard._src.checkpoint import plainindex as _plainindex
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.checkpoint import table as _table
from jaxreshard._src.checkpoint import tableindex as _tableindex
from jaxreshard._src.checkpoint import tablewrite as _tablewrite
from jaxreshard._src.checkpoint.historycheck import check_histories
from jaxreshard._src.checkpoint.index import (
  ARCHIVE_FILE,
  DEFAULT_CHUNK_BYTES,
  FORMAT,
  FORMAT_VERSION,
  INDEX_FILE,
  MAX_INDEX_BYTES,
  Source,
  SourcedRecords,
  _json_digest,
)
from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.gcpause import no_gc
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.errors import ArchiveError, PlacementError, ReshardError, ShapeError


def target_layout(placements: Iterable[ParamPlacement], state_parts: _structure.StateParts) -> str:
  """The layout an archive shares with every rank of its target: a sha256 in hex.

  It covers the world size and every param's id, logical shape, storage
  dtype, trainability and history (per optimizer subtree: a buffer's dtype,
  masked or absent), never the rank, the slots or the clock.
  """
  entries = []
  name = _dtype_name
  for p in sorted(placements, key=lambda p: p.param):
    hist = [
      None if h is None else "masked" if h is _structure.MASKED else name(h.dtype)
      for h in state_parts.history(p.param)
    ]
    entries.append(
      [p.param, list(p.shape), name(p.dtype), bool(p.trainable), int(p.world_size), hist]
    )
  return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
  """numpy's name of a dtype (a dtype or a scalar type); made once per dtype, as numpy
  makes it anew on each ask."""
  return np.dtype(dtype).name


def clock_scalars(index: int, leaves: Sequence[Any], roles: Sequence[Any]) -> list[dict]:
  """Archive ``index``'s clock as the index records it: each scalar leaf (role None) of
  its flattened state encoded, in order."""
  return [
    _clockjson.encode_scalar(leaf, f"archive {index}, leaf {i}")
    for i, (leaf, role) in enumerate(zip(leaves, roles))
    if role is None
  ]


# --- writing ------------------------------------------------------------------


def _packed(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
  """The concatenation of flat ``parts``; without a copy when they tile one buffer.

  Empty parts hold no bytes and take no place in the tiling (numpy gives an
  empty view an address of its own choosing).
  """
  full = [p for p in parts if p.size]
  if not full:
    return np.zeros(0, dtype)
  base = full[0].base
  if (
    isinstance(base, np.ndarray)
    and base.ndim == 1
    and base.dtype == dtype
    and base.flags.c_contiguous
    and all(p.base is base and p.flags.c_contiguous for p in full)
  ):
    start = full[0].__array_interface__["data"][0] - base.__array_interface__["data"][0]
    ptr = full[0].__array_interface__["data"][0]
    for p in full:
      if p.__array_interface__["data"][0] != ptr:
        break
      ptr += p.nbytes
    else:
      i0 = start // dtype.itemsize
      return base[i0 : i0 + sum(p.size for p in full)]
  return np.concatenate(full)


# A save whose first archive holds at least this many history buffers writes its
# index with a binary table (``tableindex``): planning a target rank then reads
# arrays, not a JSON node per buffer. Smaller indexes stay JSON alone.
TABLE_MIN_BUFFERS = 256


class IndexBuilder:
  """Collects each archive's entry of the index as records are written.

  ``table``: whether the index keeps its layouts in a binary table; None decides it
  from the first archive (``TABLE_MIN_BUFFERS``), before it is written: every
  ``archive.json`` records digests in the encoding chosen, so it never changes.
  """

  def __init__(
    self,
    checkpoint_id: str | None = None,
    source: Source | None = None,
    *,
    table: bool | None = None,
  ):
    self.id = checkpoint_id or uuid.uuid4().hex
    self.source = source
    self.table = table
    self.structures: list[dict] = []  # a table's params trees of the mirrors
    self.leaves: list[dict] = []  # a table's leaves of each mirror
    self.entries: _entries.ParamEntries | None = None  # made once ``table`` is decided
    self._sizes: list[dict[str, int]] = []  # per layout: dtype name -> elements
    self._layouts: dict[str, int] = {}
    self._trees: dict = {}  # ``archivecheck.check_one_tree``'s, over the layouts so far
    self._layout_of_signature: dict[tuple, int] = {}
    self._clocks: dict[str, int] = {}
    self.layouts, self.clocks = [], []  # the index's lists of dicts and of lists
    self.archives: list[list | None] = []
    self._layout_digests: list[str] = []
    self.describes: dict[int, dict[str, str]] = {}  # archive -> what archive.json records
    self._deferred = _deferredindex.DeferredLayouts()
    self._plain = _plainindex.PlainLayouts()

  def add(self, index: int, record: Any, *, pack: bool = True) -> dict[np.dtype, np.ndarray]:
    """Registers archive ``index``; returns its packed buffers (per dtype).

    With ``pack=False`` the record's buffers may be shapes alone
    (``jax.ShapeDtypeStruct``): only the index entry is made. A deferred or
    plain record of a layout registered before is taken from that one
    (``deferredindex``, ``plainindex``): the same entry and bytes.
    """
    buffers = self._deferred.add(self, index, record, pack)
    if buffers is None and pack:
      buffers = self._plain.add(self, index, record, _packed)
    if buffers is None:
      buffers = self._add_record(index, record, pack)
      self._deferred.learn(self, index, record, buffers, pack)
      self._plain.learn(self, index, record, pack)
    return buffers

  def add_ranks(self, ranks: Sequence[int], record_of: Callable[[int], Any]) -> None:
    """Registers archive ``r`` as ``record_of(r)`` for each ``r`` of ``ranks``: ranks of one
    world size whose records differ only in their placements' rank
    (``deferredindex.add_ranks``)."""
    _deferredindex.add_ranks(self, ranks, record_of)

  def _add_record(self, index: int, record: Any, pack: bool) -> dict[np.dtype, np.ndarray]:
    """``add``, leaf by leaf: every check the index makes of a record."""
    state_parts, placements = _validate.check_record(index, record)
    if self.table is None:
      n = sum(len(m.entries) for m in state_parts.subtrees)
      self.table = n >= TABLE_MIN_BUFFERS
    if self.entries is None:
      self.entries = _entries.ParamEntries(self.table)
    if self.source is not None:
      self._check_source(index, placements, state_parts)
    check_histories(index, state_parts, placements)  # what a reader refuses is never written
    roles = _structure.roles_of(record)
    leaves, treedef = jax.tree_util.tree_flatten(record.state)
    # Ranks of one layout share its structure: encode it once.
    signature = (
      treedef,
      roles,
      tuple(
        (getattr(x, "shape", None), getattr(x, "dtype", None))
        for x, r in zip(leaves, roles)
        if r is not None
      ),
    )
    layout = self._layout_of_signature.get(signature)
    if layout is None:
      layout = self._layout(index, record, roles, state_parts)
      self._layout_of_signature[signature] = layout
    clock, clock_digest = self.register_clock(index, leaves, roles)
    while len(self.archives) <= index:
      self.archives.append(None)
    self.archives[index] = [f"archive_{index:05d}", layout, clock]
    placements_digest = self.entries.add(index, placements.values())
    self.describes[index] = {
      "layout": self._layout_digests[layout],
      "clock": clock_digest,
      "placements": placements_digest,
    }
    if not pack:
      return {}
    parts: dict[np.dtype, list[np.ndarray]] = {}
    for _pid, _m, buf in _copyplan.packing_order(
      {pid: state_parts.history(pid) for pid in state_parts.param_set()}
    ):
      parts.setdefault(np.dtype(buf.dtype), []).append(np.asarray(buf).reshape(-1))
    return {d: _packed(p, d) for d, p in parts.items()}

  def register_clock(self, index: int, leaves: Sequence[Any], roles: Sequence[Any]) -> tuple:
    """Archive ``index``'s clock: its number, and the digest ``archive.json`` records."""
    scalars = clock_scalars(index, leaves, roles)
    key = json.dumps(scalars, separators=(",", ":"), sort_keys=True)
    clock = self._clocks.setdefault(key, len(self._clocks))
    if clock == len(self.clocks):
      self.clocks.append(scalars)
    return clock, hashlib.sha256(key.encode("ascii")).hexdigest()

  def _check_source(
    self, index: int, placements: dict[str, ParamPlacement], state_parts: _structure.StateParts
  ) -> None:
    """Every archive of a reshard's output has its target's world size and layout."""
    src = self.source
    for p in placements.values():
      if p.world_size != src.world_size:
        raise PlacementError(
          f"param {p.param!r}: archive {index} has world_size"
          f" {p.world_size}, not {src.world_size} of its target"
        )
    layout = target_layout(placements.values(), state_parts)
    if src.layout is None:
      self.source = dataclasses.replace(src, layout=layout)
    elif layout != src.layout:
      raise PlacementError(
        f"archive {index} has another layout (params, shapes, dtypes or history buffers)"
        f" than {'archive 0' if index else 'its target'}; the ranks of one target share one"
      )

  def _layout(
    self, index: int, record: Any, roles: Sequence[Any], state_parts: _structure.StateParts
  ) -> int:
    """The layout entry of a record's state structure (added when new)."""
    tree, leaves = fmt.encode_tree(record.state)
    entries, n_scalars = [], 0
    for leaf, role in zip(leaves, roles):
      if role is None:
        entries.append({"s": n_scalars})
        n_scalars += 1
        continue
      where = f"param {role!r}: archive {index}"
      if np.ndim(leaf) != 1:
        raise ShapeError(f"{where}: history buffer of shape {np.shape(leaf)} is not flat")
      dtype = fmt.np_dtype(np.dtype(leaf.dtype).name, where)
      entries.append([role, dtype.name, int(np.size(leaf))])
    key = json.dumps([tree, entries], separators=(",", ":"))
    layout = self._layouts.setdefault(key, len(self._layouts))
    if layout == len(self.layouts):
      _archivecheck.check_one_tree([(index, state_parts)], self._trees)
      sizes: dict[str, int] = {}
      for x in entries:
        if isinstance(x, list):
          sizes[x[1]] = sizes.get(x[1], 0) + x[2]
      self._sizes.append(sizes)
      if not self.table:
        self.layouts.append({"tree": tree, "leaves": entries})
        self._layout_digests.append(_json_digest(self.layouts[-1]))
        return layout
      entry, structures, leaves = _tablewrite.factor(state_parts)
      entry["mirrors"] = [len(self.structures) + s for s in entry["mirrors"]]
      self.structures.extend(structures)
      self.leaves.extend(leaves)
      self.layouts.append(entry)
      self._layout_digests.append(_tablewrite.factored_digest(entry, self.structures, leaves))
    return layout

  def layout_sizes(self, layout: int) -> dict[str, int]:
    """Elements of each dtype's packed buffer of archives of ``layout`` (by dtype name)."""
    return self._sizes[layout]

  def groups(self) -> list[dict]:
    """Param entries split the same way, merged into one group."""
    return [] if self.entries is None else self.entries.groups()

  def index(self) -> dict:
    """The index's value (``write_index`` writes it). With a table, its param entries
    are listed sorted by their JSON text, and it holds the mirrors' ``structures`` and
    ``leaves`` (``tableindex``)."""
    if not self.archives or any(a is None for a in self.archives):
      raise PlacementError("no archives supplied")
    params, groups = self.entries.listed()
    value = {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "checkpoint": self.id,
      "record_version": RECORD_VERSION,
      "params": params,
      "groups": groups,
      "layouts": self.layouts,
    }
    if self.table:
      value.update(structures=self.structures, leaves=self.leaves)
    value.update(
      clocks=self.clocks,
      archives=self.archives,
      source=None if self.source is None else self.source.to_json(),
    )
    return value


def write_archive(
  directory: _shardfile.OutDir | str,
  index: int,
  record: Any,
  builder: IndexBuilder,
  chunk_bytes: int,
  *,
  durable: bool = True,
) -> int:
  """Writes one archive directory and registers it with ``builder``.

  ``directory`` is a held :class:`_shardfile.OutDir` (whose own entries the
  caller fsyncs once it is complete) or a path (held, and fsync'ed, for this
  call, unless ``durable`` is False). Every file of the archive, and its
  directories, are fsync'ed when the directory is durable.

  Returns the bytes of its history buffers (the data, not the checksums).
  """
  if not isinstance(directory, _shardfile.OutDir):
    with _shardfile.OutDir.open(os.fspath(directory), durable) as held:
      nbytes = _write_archive_into(held, index, record, builder, chunk_bytes)
      held.sync()
      held.drain()
      return nbytes
  return _write_archive_into(directory, index, record, builder, chunk_bytes)


def _write_archive_into(
  directory: _shardfile.OutDir, index: int, record: Any, builder: IndexBuilder, chunk_bytes: int
) -> int:
  buffers = builder.add(index, record)
  with directory.mkdir(f"archive_{index:05d}") as adir:
    meta_buffers = {}
    for dtype, data in sorted(buffers.items(), key=lambda kv: kv[0].name):
      if not data.size:
        continue
      chunk = _shardfile.chunk_elements(data.size, dtype.itemsize, chunk_bytes)
      crcs = _shardfile.write_array(adir, dtype.name, data, chunk)
      meta_buffers[dtype.name] = {"elements": int(data.size), "chunk": chunk, "crc32c": crcs}
    adir.write_bytes(
      ARCHIVE_FILE,
      fmt.signed_json(
        {
          "format": FORMAT,
          "format_version": FORMAT_VERSION,
          "checkpoint": builder.id,
          "archive": f"archive_{index:05d}",
          "describes": builder.describes[index],
          "buffers": meta_buffers,
        }
      ),
    )
    adir.sync()
  return sum(int(data.nbytes) for data in buffers.values())


def write_index(directory: _shardfile.OutDir, value: dict, where: str | None = None) -> None:
  """Writes an index value (``IndexBuilder.index()``) into ``directory``: signed JSON,
  and for large layouts its binary table first, fsync'ed with the directory before
  the index that names it is written. ``where``: the checkpoint's path in a refusal
  (default: the directory's own, which a save's temporary directory means nothing as)."""
  raw, table = readable_index(value, directory.path if where is None else where)
  if table is not None:
    directory.write_bytes(_table.TABLE_FILE, table)
    directory.sync()
    directory.drain()
  directory.write_bytes(INDEX_FILE, raw)


def readable_index(value: dict, directory: str) -> tuple[bytes, bytes | None]:
  """An index value's signed JSON and binary table (None for a small layout), checked
  by the reader's own rules (``check_readable``)."""
  table = None
  if "structures" in value:
    body, table = _tablewrite.encode(value)
  else:
    body = value
  raw = fmt.signed_json(body)
  check_readable(raw, table, directory)
  return raw, table


def check_readable(raw: bytes, table: bytes | None, directory: str) -> None:
  """Parses an index about to be written (and its binary table) by the reader's own
  rules, so that a save never commits a checkpoint that a load refuses (a param id or
  a count of optimizer scalars past a reader's bound).

  Raises:
    ArchiveError: what the reader would refuse, and that nothing is committed.
  """
  where = f"{directory}/{INDEX_FILE}"
  path = f"{directory}/{_table.TABLE_FILE}"
  try:
    if len(raw) > MAX_INDEX_BYTES:
      raise ArchiveError(f"{where} would have {len(raw)} bytes (a reader takes {MAX_INDEX_BYTES})")
    if table is not None and len(table) > _table.MAX_TABLE_BYTES:
      raise ArchiveError(
        f"{path} would have {len(table)} bytes (a reader takes {_table.MAX_TABLE_BYTES})"
      )
    with no_gc():
      _tableindex.parse_signed(
        raw, where, lambda entry: _table.arrays_of(table, entry, where, path)
      )
  except ReshardError as e:
    raise ArchiveError(f"this save would not load, so nothing is committed: {e}") from None


def dump_index(directory: str, value: dict) -> None:
  """``write_index`` into the existing directory ``directory``, fsync'ed with it."""
  with _shardfile.OutDir.open(directory) as held:
    write_index(held, value)
    held.sync()
    held.drain()


def dump(path: str, obj: dict) -> None:
  """Writes the index or an ``archive.json`` into the new file ``path``: signed JSON
  (see ``_archive_format``), fsync'ed with its directory."""
  with _shardfile.OutDir.open(os.path.dirname(path) or ".") as held:
    held.write_bytes(os.path.basename(path), fmt.signed_json(obj))
    held.sync()
    held.drain()


def write_checkpoint(
  directory: Any,
  records: Iterable[ShardRecord],
  *,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  progress: Callable[[int, int], None] | None = None,
  where: str | None = None,
) -> IndexBuilder:
  """Writes every record into an existing empty ``directory``; returns what it wrote.

  ``directory`` is a held :class:`_shardfile.OutDir` or a path. Records are
  written one at a time as the iterable yields them; ``progress(archive,
  nbytes)`` is called after each. ``SourcedRecords`` give the index their
  ``Source``. Every file and directory is fsync'ed (when ``directory`` is
  durable) before it returns. Not atomic by itself: ``save_records`` and the
  orbax handler supply the atomic commit. ``where``: the path a refusal of the index
  names (``save_records``: the checkpoint's, not its temporary directory's).
  """
  if not isinstance(directory, _shardfile.OutDir):
    with _shardfile.OutDir.open(os.fspath(directory)) as held:
      return write_checkpoint(
        held, records, chunk_bytes=chunk_bytes, progress=progress, where=where
      )
  builder = IndexBuilder(source=records.source if isinstance(records, SourcedRecords) else None)
  one = _record.CheckpointOf()  # parts of two saves are never written into one
  for index, record in enumerate(records):
    one.add(index, record)
    nbytes = write_archive(directory, index, record, builder, chunk_bytes)
    if progress is not None:
      progress(index, nbytes)
  write_index(directory, builder.index(), where)
  directory.sync()
  directory.drain()
  return builder

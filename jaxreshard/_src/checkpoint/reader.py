"""A checkpoint on disk: its index, its archives and their buffers (format version 3).

Layout::

  CHECKPOINT/
    jaxreshard.json          # the index, written last: the whole layout (signed)
    archive_00000/           # one source rank's archive
      archive.json           # (signed) checkpoint id; digests of what the index says of
                             # it (layout, clock, params at each rank); per dtype:
                             # elements, chunk, crc32c's
      float32/               # every float32 history buffer of the rank, back to back
        zarr.json            #   (zarr v3, one shard, a crc32c per chunk: see _shardfile)
        c/0
      bfloat16/ ...
    archive_00001/ ...

The index carries everything planning needs, once for the whole checkpoint:

* ``params``: distinct ``[id, shape, dtype, trainable]`` entries;
* ``groups``: parameters split the same way: ``world_size``, the param
  entries and the ``[archive, rank]`` pairs that hold them;
* ``layouts``: distinct state layouts: the optax state's tree (scalars and
  history buffers as numbered leaves) and, per leaf, a clock scalar's number
  or a history buffer's ``[param, dtype, slots]``;
* ``clocks``: distinct optimizer clocks (the scalar leaves, exact bits);
* ``archives``: ``[name, layout, clock]`` of each archive;
* ``checkpoint``: an identity shared by every archive of one save;
* ``source``: null, or for the output of a reshard (whole or some ranks) the
  checkpoint it was resharded from: that checkpoint's identity, the target
  world size and the target's layout (a sha256 of every param's id, shape,
  dtype, trainability and history buffer dtypes), which every part of one
  reshard shares, so that parts of two saves are never merged.

The index and every ``archive.json`` are signed JSON: the first member is
``"checksum":"sha256:..."``, the sha256 of the file's JSON body, checked on
the raw bytes before anything in the file is parsed or used
(``_archive_format.verified_json``). A file without it (format version 2 and
earlier) is refused.

A rank's buffers of one dtype lie in *packing order* (parameters sorted by id,
then the optimizer subtrees in order), so an archive's offsets follow from its
layout alone; planning a target rank reads the index and then only the
archives that overlap it. Files grow with ranks x dtypes, not with buffers.

Everything read here is untrusted: JSON sizes are bounded, checksums are
checked before parsing, every field is type-checked, names are checked before
they become paths, every file is opened below the one descriptor of the root
held for the checkpoint's life, without following links (``_shardfile.Dir``),
sizes in the metadata are checked against the bytes on disk before anything
is allocated, and every archive read must carry the index's checkpoint
identity. Data that contradicts the layout is refused on every read: the
padding slots of a rank's buffer (past the elements its flat shard owns) must
hold zero bits, checked on every buffer of an archive read whole
(``Checkpoint.record``) and, for reads of runs, on the tail of every buffer a
read copies from (``Checkpoint.read_runs``) and on the all-padding ranks the
caller names (``Checkpoint.check_padding``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.exec import bitview as _bitview
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.errors import ArchiveError, PlacementError, ShapeError
from jaxreshard._src.core.geometry import MAX_WORLD_SIZE, FlatShard
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.checkpoint.index import (  # noqa: F401  (re-exported)
    ARCHIVE_FILE, DEFAULT_CHUNK_BYTES, FORMAT, FORMAT_VERSION, INDEX_FILE, MAX_ARCHIVE_BYTES,
    MAX_CLOCK_SCALARS_BASE, MAX_CLOCK_SCALARS_PER_PARAM, MAX_ID_CHARS, MAX_INDEX_BYTES,
    STAGING_BYTES, _ID, _INDEX_KEYS, _SHA256, _SOURCE_KEYS, _TERM_MOD, _TWICE, Group, LeafInfo,
    Layout, ParamEntry, ReadStats, Source, SourcedRecords, _Pads, _ScalarSlot, _json_digest,
    _param_term, _placements_digest, _signed, allocate, path_arg)
from jaxreshard._src.checkpoint.writer import (  # noqa: F401  (re-exported)
    IndexBuilder, dump, target_layout, write_archive, write_checkpoint)

__all__ = ["Checkpoint", "FORMAT_VERSION", "LeafInfo", "ReadStats", "Source", "SourcedRecords",
           "open_checkpoint", "target_layout", "write_checkpoint"]


class Checkpoint:
  """An opened checkpoint: the index checked, archives opened on demand.

  It answers the questions validation asks of sources (``_validate.Sources``),
  so ``restore`` runs the same pipeline as ``reshard``, and it caches what it
  learns (archive metadata, open files are not kept) for as long as it lives.
  """

  def __init__(self, directory: Any):
    self.directory = path_arg(directory)
    # The root is opened once; every file below it is opened relative to this
    # descriptor, which lives as long as the object (or until ``close``).
    self._root = _shardfile.Dir.root(self.directory)
    self._closer = weakref.finalize(self, self._root.close)
    try:
      if not self._root.exists(INDEX_FILE):
        raise ArchiveError(
            f"{os.fspath(directory)} is not a jaxreshard checkpoint (no {INDEX_FILE}; a save"
            " that did not finish leaves none)")
      where = f"{self.directory}/{INDEX_FILE}"
      raw = self._root.read_bytes(INDEX_FILE, MAX_INDEX_BYTES)
      from jaxreshard._src.engine.pipeline import no_gc  # pylint: disable=g-import-not-at-top

      with no_gc():  # parsing makes many small objects and no cycles
        self._parse(_signed(raw, where, FORMAT))
    except BaseException:
      self.close()
      raise
    self._lock = threading.Lock()
    self._archive_meta: dict[int, dict] = {}
    self._facts = _sources.FactsCache()
    # Packed target layouts by the validated groups they were made from (ids of
    # facts this object keeps alive).
    self.target_layouts: dict = {}
    self._group_facts: dict[tuple[int, str], _validate.SourceFacts] = {}
    self._uniform: dict[int, bool] = {}
    self._complete: Optional[list] = None
    self._group_by_sources: dict[int, tuple[tuple, int]] = {}
    self._clock_classes = _validate.ClockClasses()
    self._by_archive: dict[int, dict[str, Any]] = {}
    self._pads: dict[tuple[int, np.dtype], _Pads] = {}

  def close(self) -> None:
    """Closes the root's descriptor; reading archives afterwards is refused."""
    self._closer()

  def __enter__(self) -> "Checkpoint":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --- the index ---------------------------------------------------------------

  def _parse(self, index: Any) -> None:
    where = f"{self.directory}/{INDEX_FILE}"
    if not isinstance(index, dict) or index.get("format") != FORMAT:
      raise ArchiveError(f"{where} does not describe a {FORMAT}")
    version = index.get("format_version")
    if version != FORMAT_VERSION:
      raise ArchiveError(
          f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
          f" reads version {FORMAT_VERSION} (a version-1 checkpoint needs the jaxreshard"
          " that wrote it: load it there and save it again)" if version == 1 else
          f"{where}: checkpoint format version {fmt.short(version)} is not supported; this jaxreshard"
          f" reads version {FORMAT_VERSION}")
    if set(index) != _INDEX_KEYS:
      raise ArchiveError(f"{where}: unexpected index keys {sorted(index)}")
    self.id = index["checkpoint"]
    if not isinstance(self.id, str) or not _ID.match(self.id):
      raise ArchiveError(f"{where}: invalid checkpoint identity {str(self.id)[:80]!r}")
    self.record_version = fmt.expect(index["record_version"], int, where)
    if self.record_version != RECORD_VERSION:
      raise PlacementError(
          f"{where}: record version {self.record_version!r} is not supported"
          f" (only version {RECORD_VERSION} exists)")
    self.params = [self._param(e, f"{where}, param {i}")
                   for i, e in enumerate(fmt.expect(index["params"], list, where))]
    self._param_terms = [_param_term(e) for e in index["params"]]
    archives = fmt.expect(index["archives"], list, where)
    if not archives:
      raise ArchiveError(f"{where}: the archive list is empty")
    self.layouts = [self._layout(e, f"{where}, layout {i}")
                    for i, e in enumerate(fmt.expect(index["layouts"], list, where))]
    self.clocks = [self._clock(e, f"{where}, clock {i}")
                   for i, e in enumerate(fmt.expect(index["clocks"], list, where))]
    # What each archive.json says the index holds for it (checked on every read).
    self._layout_digests = [_json_digest(e) for e in index["layouts"]]
    self._clock_digests = [_json_digest(e) for e in index["clocks"]]
    self.names, self.archive_layout, self.archive_clock = [], [], []
    for i, e in enumerate(archives):
      aw = f"{where}, archive {i}"
      if not (isinstance(e, list) and len(e) == 3):
        raise ArchiveError(f"{aw}: expected [name, layout, clock]")
      name = fmt.check_name(e[0], fmt.ARCHIVE_NAME, aw)
      layout, clock = fmt.expect(e[1], int, aw), fmt.expect(e[2], int, aw)
      if not (0 <= layout < len(self.layouts) and 0 <= clock < len(self.clocks)):
        raise ArchiveError(f"{aw}: layout {layout} or clock {clock} does not exist")
      if self.layouts[layout].n_scalars != len(self.clocks[clock]):
        raise ArchiveError(f"{aw}: its clock has {len(self.clocks[clock])} scalars but its"
                           f" layout {self.layouts[layout].n_scalars}")
      self.names.append(name)
      self.archive_layout.append(layout)
      self.archive_clock.append(clock)
    if len(set(self.names)) != len(self.names):
      raise ArchiveError(f"{where}: the archive list has repeats")
    # Archives are listed in the order of their names (the i-th record is written
    # as archive_i), so reordering the list cannot relabel whose data is whose.
    numbers = [int(n[len("archive_"):]) for n in self.names]
    for i in range(1, len(numbers)):
      if numbers[i] <= numbers[i - 1]:
        raise ArchiveError(f"{where}, archive {i}: {self.names[i]} is listed after"
                           f" {self.names[i - 1]}; archives are listed in the order of their names")
    self.groups = [self._group(e, f"{where}, group {i}")
                   for i, e in enumerate(fmt.expect(index["groups"], list, where))]
    self._membership()
    self.source = self._source(index["source"], f"{where}, source")

  def _source(self, e: Any, where: str) -> Optional[Source]:
    """The checkpoint a reshard read (None for a save of its own); its world size is
    every group's."""
    if e is None:
      return None
    fmt.expect(e, dict, where)
    if set(e) != _SOURCE_KEYS:
      raise ArchiveError(f"{where}: expected checkpoint, world_size and layout, got keys"
                         f" {fmt.short(sorted(e))}")
    if not (isinstance(e["checkpoint"], str) and _ID.match(e["checkpoint"])):
      raise ArchiveError(f"{where}: invalid checkpoint identity {fmt.short(e['checkpoint'])}")
    world = fmt.expect(e["world_size"], int, where)
    if not 1 <= world <= MAX_WORLD_SIZE:
      raise ArchiveError(f"{where}: world_size {world} must be between 1 and {MAX_WORLD_SIZE}")
    if not (isinstance(e["layout"], str) and _SHA256.match(e["layout"])):
      raise ArchiveError(f"{where}: invalid layout {fmt.short(e['layout'])} (a sha256 in hex)")
    for gi, g in enumerate(self.groups):
      if g.world_size != world:
        raise ArchiveError(f"{where}: world_size {world}, but group {gi} has world_size"
                           f" {g.world_size}")
    return Source(e["checkpoint"], world, e["layout"])

  def _param_names(self, params: Sequence[int]) -> str:
    names = [self.params[p].param for p in params[:3]]
    return f"{names}{'...' if len(params) > 3 else ''}"

  def _param(self, e: Any, where: str) -> ParamEntry:
    if not (isinstance(e, list) and len(e) == 4):
      raise ArchiveError(f"{where}: expected [id, shape, dtype, trainable]")
    if isinstance(e[0], str) and len(e[0]) > MAX_ID_CHARS:
      raise ArchiveError(f"{where}: a param id of {len(e[0])} characters (at most"
                         f" {MAX_ID_CHARS})")
    return ParamEntry(fmt.expect(e[0], str, where), fmt.shape_of(e[1], where),
                      fmt.np_dtype(e[2], where), fmt.expect(e[3], bool, where))

  def _layout(self, e: Any, where: str) -> Layout:
    fmt.expect(e, dict, where)
    if set(e) != {"tree", "leaves"}:
      raise ArchiveError(f"{where}: expected tree and leaves")
    leaves, n_scalars = [], 0
    for i, x in enumerate(fmt.expect(e["leaves"], list, where)):
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
        leaves.append(LeafInfo(fmt.expect(x[0], str, lw), (slots,), fmt.np_dtype(x[1], lw)))
      else:
        raise ArchiveError(f"{lw}: invalid leaf {str(x)[:80]!r}")
    return Layout(e["tree"], leaves, where)

  def _clock(self, e: Any, where: str) -> list[Any]:
    scalars = fmt.expect(e, list, where)
    limit = MAX_CLOCK_SCALARS_BASE + MAX_CLOCK_SCALARS_PER_PARAM * len(self.params)
    if len(scalars) > limit:
      raise ArchiveError(f"{where}: {len(scalars)} optimizer scalars for {len(self.params)}"
                         f" params, more than an optimizer has (at most {limit})")
    return [fmt.decode_scalar(x, f"{where}, scalar {k}") for k, x in enumerate(scalars)]

  def _group(self, e: Any, where: str) -> Group:
    fmt.expect(e, dict, where)
    if set(e) != {"world_size", "params", "ranks"}:
      raise ArchiveError(f"{where}: expected world_size, params and ranks")
    world = fmt.expect(e["world_size"], int, where)
    if not 1 <= world <= MAX_WORLD_SIZE:
      raise ArchiveError(f"{where}: world_size {world} must be between 1 and {MAX_WORLD_SIZE}")
    params = tuple(fmt.expect(p, int, where) for p in fmt.expect(e["params"], list, where))
    if any(not 0 <= p < len(self.params) for p in params):
      raise ArchiveError(f"{where}: a param index is out of range")
    ranks = []
    for pair in fmt.expect(e["ranks"], list, where):
      if not (isinstance(pair, list) and len(pair) == 2):
        raise ArchiveError(f"{where}: expected [archive, rank] pairs")
      a, r = fmt.expect(pair[0], int, where), fmt.expect(pair[1], int, where)
      if not 0 <= a < len(self.names):
        raise ArchiveError(f"{where}: archive {a} does not exist")
      if not 0 <= r < world:
        raise ArchiveError(f"{where}: archive {a} ({self.names[a]}) has rank {r}, outside"
                           f" world_size {world} of params {self._param_names(params)}")
      if ranks and a < ranks[-1][0]:
        raise ArchiveError(f"{where}: [archive, rank] pairs must list archives in increasing"
                           f" order; archive {a} follows archive {ranks[-1][0]}")
      ranks.append((a, r))
    return Group(world, params, tuple(ranks))

  def _membership(self) -> None:
    """Which groups (and ranks) each archive holds; each param once per archive."""
    self.member: list[list[tuple[int, int]]] = [[] for _ in self.names]
    for gi, g in enumerate(self.groups):
      for a, r in g.ranks:
        self.member[a].append((gi, r))
    self._param_index = [{self.params[p].param: p for p in g.params} for g in self.groups]
    self._group_terms = [sum(self._param_terms[p] for p in g.params) % _TERM_MOD
                         for g in self.groups]
    for gi, index in enumerate(self._param_index):
      if len(index) != len(self.groups[gi].params):
        raise ArchiveError(f"{self.directory}/{INDEX_FILE}: group {gi} lists a param twice")

  # --- the sources protocol ----------------------------------------------------

  def __len__(self) -> int:
    return len(self.names)

  def placement(self, archive: int, pid: str) -> Optional[ParamPlacement]:
    member = self.member[archive]
    if len(member) == 1:
      gi, rank = member[0]
      p = self._param_index[gi].get(pid)
    else:
      hit = self._archive_params(archive).get(pid)
      if hit is _TWICE:
        raise PlacementError(f"param {pid!r}: archive {archive} lists it twice")
      gi, rank, p = hit if hit is not None else (None, None, None)
    if p is None:
      return None
    e = self.params[p]
    return ParamPlacement(pid, e.shape, rank, self.groups[gi].world_size, e.dtype, e.trainable)

  def _archive_params(self, archive: int) -> dict[str, Any]:
    """``param id -> (group, rank, param entry)`` of an archive in several groups (or
    ``_TWICE``), made once: a lookup then costs O(1), not time in the groups."""
    index = self._by_archive.get(archive)
    if index is None:
      index = {}
      for gi, rank in self.member[archive]:
        for pid, p in self._param_index[gi].items():
          index[pid] = _TWICE if pid in index else (gi, rank, p)
      self._by_archive[archive] = index
    return index

  def placements(self, archive: int) -> list[ParamPlacement]:
    """Every placement an archive lists, sorted by param."""
    out = []
    for gi, rank in self.member[archive]:
      g = self.groups[gi]
      for p in g.params:
        e = self.params[p]
        out.append(ParamPlacement(e.param, e.shape, rank, g.world_size, e.dtype, e.trainable))
    out.sort(key=lambda p: p.param)
    for a, b in zip(out, out[1:]):
      if a.param == b.param:
        raise PlacementError(f"param {a.param!r}: archive {archive} lists it twice")
    return out

  def layout(self, archive: int) -> Layout:
    return self.layouts[self.archive_layout[archive]]

  def history(self, archive: int, pid: str) -> tuple[Any, ...]:
    return self.layout(archive).anatomy.history(pid)

  def clock_class(self, archive: int) -> int:
    """The rule records in memory follow (``_validate.ClockClasses``): one state structure
    and bit-identical clock scalars; archives of one layout and clock share it."""
    return self._clock_classes.of(
        self, archive, (self.archive_layout[archive], self.archive_clock[archive]))

  def skeleton(self, archive: int) -> tuple[Any, ...]:
    return _validate.skeleton_key(self.layout(archive).anatomy)

  def scalars(self, archive: int) -> list[Any]:
    return self.clocks[self.archive_clock[archive]]

  def template(self, archive: int) -> _structure.StateParts:
    c = self.archive_clock[archive]
    with self._lock:
      return self.layout(archive).template(c, self.clocks[c])

  def check_archive(self, archive: int) -> None:
    """Refusals of one archive on its own: version, listing, histories of unlisted params.

    An archive of a uniform group (one layout whose buffers have the group's
    slots, checked once for the group) needs no check of its own.
    """
    if self.member[archive] and all(self._is_uniform(gi) for gi, _ in self.member[archive]):
      return
    placements = self.placements(archive)
    anatomy = self.layout(archive).anatomy
    for pid in sorted(anatomy.param_set() - {p.param for p in placements}):
      raise PlacementError(f"param {pid!r}: archive {archive} holds a history for it but"
                           " does not list it in its placements")
    for p in placements:
      try:
        slots = FlatShard(p.shape, p.rank, p.world_size).slots
      except PlacementError as e:
        raise PlacementError(f"param {p.param!r}: archive {archive}: {e}") from None
      for m, h in enumerate(anatomy.history(p.param)):
        if isinstance(h, LeafInfo) and h.shape != (slots,):
          raise ShapeError(
              f"param {p.param!r}: archive {archive}, history buffer {m} has shape {h.shape},"
              f" not ({slots},) of its flat layout (shape {p.shape}, world_size {p.world_size})")

  def complete_groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(param, shape, archive of each rank) of every param, from the groups alone."""
    with self._lock:
      if self._complete is not None:
        return self._complete
    seen: dict[str, int] = {}
    out = []
    for gi, g in enumerate(self.groups):
      by_rank = self._group_sources(gi)
      for p in g.params:
        e = self.params[p]
        if e.param in seen:
          raise PlacementError(
              f"param {e.param!r}: groups {seen[e.param]} and {gi} of the checkpoint both hold"
              " it; pass explicit migrations to pick one group")
        seen[e.param] = gi
        out.append((e.param, e.shape, by_rank))
    out.sort(key=lambda x: x[0])
    with self._lock:
      self._complete = out
    return out

  def _group_sources(self, gi: int) -> tuple[int, ...]:
    """The archive of each rank of group ``gi``, refusing an incomplete group."""
    g = self.groups[gi]
    name = self.params[g.params[0]].param if g.params else "?"
    sources = _validate.rank_sources(name, g.world_size, ((a, r) for a, r in g.ranks))
    self._group_by_sources[id(sources)] = (sources, gi)
    return sources

  def facts(self, pid: str, sources: tuple) -> _validate.SourceFacts:
    hit = self._group_by_sources.get(id(sources))
    if hit is not None and hit[0] is sources and self._is_uniform(hit[1]):
      key = (hit[1], pid)
      with self._lock:
        facts = self._group_facts.get(key)
      if facts is None:
        facts = self._uniform_facts(hit[1], pid, sources)
        with self._lock:
          self._group_facts[key] = facts
      return facts
    with self._lock:
      return self._facts.facts(pid, sources, self)

  def _is_uniform(self, gi: int) -> bool:
    """Every archive of the group has one layout and clock, with the group's slots."""
    u = self._uniform.get(gi)
    if u is None:
      g = self.groups[gi]
      archives = [a for a, _ in g.ranks]
      u = (len({self.archive_layout[a] for a in archives}) == 1
           and len({self.clock_class(a) for a in archives}) == 1
           and all(len(self.member[a]) == 1 for a in archives))
      if u:
        anatomy = self.layout(archives[0]).anatomy
        for p in g.params:
          e = self.params[p]
          slots = FlatShard.checked(e.shape, 0, g.world_size).slots
          for h in anatomy.history(e.param):
            if isinstance(h, LeafInfo) and h.shape != (slots,):
              u = False
        u = u and anatomy.param_set() <= set(self._param_index[gi])
      self._uniform[gi] = u
    return u

  def _uniform_facts(self, gi: int, pid: str, sources: tuple) -> _validate.SourceFacts:
    g = self.groups[gi]
    p = self._param_index[gi].get(pid)
    if p is None:
      raise _validate.not_listed(pid, sources[0], self)
    e = self.params[p]
    a0 = sources[0]
    _validate.check_storage_dtype(e.dtype, f"param {pid!r}: archive {a0}")
    hist = self.history(a0, pid)
    dtypes = []
    for m, h in enumerate(hist):
      if isinstance(h, LeafInfo):
        _validate.check_buffer_dtype(h.dtype, f"param {pid!r}: archive {a0}, history buffer {m}")
        dtypes.append(h.dtype)
      else:
        dtypes.append(None)
    return _validate.SourceFacts(
        param=pid, shape=e.shape, source=FlatShard.checked(e.shape, 0, g.world_size),
        by_rank=sources,
        dtype=e.dtype, trainable=e.trainable,
        history=tuple(True if isinstance(h, LeafInfo) else h for h in hist),
        buffer_dtypes=tuple(dtypes), clock=self.clock_class(a0))

  def locate(self, archive: int, group: Any, mirror: int, dtype: np.dtype) -> tuple[Any, int]:
    """A history buffer lives in its archive's packed buffer of its dtype."""
    d, offset, _ = self.layout(archive).offsets[(group.param, mirror)]
    return (archive, d), offset

  # --- archives and their buffers ----------------------------------------------

  def archive_meta(self, archive: int) -> dict:
    """An archive's ``archive.json``, checked against the index (read once)."""
    with self._lock:
      meta = self._archive_meta.get(archive)
    if meta is not None:
      return meta
    name = self.names[archive]
    where = f"archive {archive} ({self.directory}/{name})"
    try:
      with self._root.dir(name) as adir:
        raw = adir.read_bytes(ARCHIVE_FILE, MAX_ARCHIVE_BYTES)
        meta = _signed(raw, f"{adir.path}/{ARCHIVE_FILE}", f"{FORMAT} archive")
    except ArchiveError as e:
      raise ArchiveError(f"archive {archive}: {e}") from None
    if meta.get("format") != FORMAT or set(meta) != {"format", "format_version", "checkpoint",
                                                     "archive", "describes", "buffers"}:
      raise ArchiveError(f"{where}: {ARCHIVE_FILE} does not describe a {FORMAT} archive")
    if meta["format_version"] != FORMAT_VERSION:
      raise ArchiveError(f"{where}: archive format version {fmt.short(meta['format_version'])} is not"
                         f" supported; this jaxreshard reads version {FORMAT_VERSION}")
    if meta["checkpoint"] != self.id:
      raise ArchiveError(
          f"{where} belongs to checkpoint {str(meta['checkpoint'])[:40]!r}, not to this"
          f" checkpoint {self.id!r}; archives of two different saves are never combined")
    if meta["archive"] != name:
      raise ArchiveError(f"{where}: {ARCHIVE_FILE} names archive {str(meta['archive'])[:40]!r}")
    self._check_describes(archive, meta["describes"], where)
    layout = self.layout(archive)
    buffers = fmt.expect(meta["buffers"], dict, where)
    expected = {d.name: n for d, n in layout.sizes.items() if n}
    got = {}
    for dname, b in buffers.items():
      bw = f"{where}, buffer {dname!r}"
      fmt.expect(b, dict, bw)
      if set(b) != {"elements", "chunk", "crc32c"}:
        raise ArchiveError(f"{bw}: expected elements, chunk and crc32c")
      n, chunk = fmt.expect(b["elements"], int, bw), fmt.expect(b["chunk"], int, bw)
      crcs = fmt.expect(b["crc32c"], list, bw)
      if not (0 < chunk <= max(n, 1)) or not all(
          isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in crcs):
        raise ArchiveError(f"{bw}: invalid chunking or checksums")
      got[dname] = n
    if got != expected:
      raise ArchiveError(f"{where}: holds buffers {got} but its layout needs {expected}")
    with self._lock:
      self._archive_meta[archive] = meta
    return meta

  def describes(self, archive: int) -> dict[str, str]:
    """Digests of what the index says of ``archive``: its layout, its clock and its
    params' ``(id, shape, dtype, trainable)`` at each (world size, rank)."""
    buckets: dict[tuple[int, int], int] = {}
    for gi, r in self.member[archive]:
      key = (self.groups[gi].world_size, r)
      buckets[key] = buckets.get(key, 0) + self._group_terms[gi]
    return {"layout": self._layout_digests[self.archive_layout[archive]],
            "clock": self._clock_digests[self.archive_clock[archive]],
            "placements": _placements_digest(buckets)}

  def _check_describes(self, archive: int, got: Any, where: str) -> None:
    """An archive's data belongs to the index's layout, clock and ranks for it: its
    signed ``archive.json`` records their digests when it is written."""
    want = self.describes(archive)
    if not isinstance(got, dict) or set(got) != set(want):
      raise ArchiveError(f"{where}: {ARCHIVE_FILE} has no valid 'describes' entry")
    for key, words in (("placements", "which params it holds at which rank"),
                       ("layout", "its state layout"), ("clock", "its optimizer clock")):
      if got[key] != want[key]:
        raise ArchiveError(
            f"{where}: the index does not describe this archive as it was written"
            f" (the index and its {ARCHIVE_FILE} disagree on {words}); the index was edited or"
            " belongs to other archives")

  # --- padding: data that contradicts the layout ---------------------------------

  def _pad_table(self, archive: int, dtype: np.dtype) -> _Pads:
    """Where the padding of an archive's packed buffer of ``dtype`` lies (made once)."""
    key = (archive, np.dtype(dtype))
    with self._lock:
      pads = self._pads.get(key)
    if pads is not None:
      return pads
    entries = sorted((o, n, k) for k, (d, o, n) in self.layout(archive).offsets.items()
                     if d == key[1])
    starts, owned, stops, keys, shards, trailing = [], [], [], [], [], []
    for o, n, (pid, m) in entries:
      g, after = None, ()
      p = self.placement(archive, pid)
      if p is not None:
        try:
          g = FlatShard.checked(p.shape, p.rank, p.world_size)
        except PlacementError:
          g = None  # refused by validation, never read
      if g is not None and g.slots == n:
        own = g.owned
        if g.owned and g.stop == g.count and g.rank + 1 < g.world_size:
          after = self._ranks_after(archive, pid, g.rank)
      else:
        g, own = None, n  # a buffer the index does not lay out is refused before reads
      starts.append(o)
      owned.append(o + own)
      stops.append(o + n)
      keys.append((pid, m))
      shards.append(g)
      trailing.append(after)
    pads = _Pads(np.asarray(starts, np.int64), np.asarray(owned, np.int64),
                 np.asarray(stops, np.int64), keys, shards, trailing,
                 {k: i for i, k in enumerate(keys)})
    with self._lock:
      self._pads[key] = pads
    return pads

  def _ranks_after(self, archive: int, pid: str, rank: int) -> tuple[int, ...]:
    """The archives holding ranks after ``rank`` of ``pid``'s group in ``archive``."""
    out = set()
    for gi, r in self.member[archive]:
      if pid in self._param_index[gi] and r == rank:
        out.update(a for a, ra in self.groups[gi].ranks if ra > rank)
    return tuple(sorted(out))

  def _padding_error(self, archive: int, pads: _Pads, k: int, local: int) -> ArchiveError:
    pid, m = pads.keys[k]
    g = pads.shards[k]
    return ArchiveError(
        f"param {pid!r}: history buffer {m} of archive {archive}"
        f" ({self.directory}/{self.names[archive]}): padding is not zero (nonzero bits at local"
        f" index {local}); the index gives rank {g.rank} of shape {g.shape} over world_size"
        f" {g.world_size}, which owns {g.owned} of its {g.slots} slots, so the data"
        " contradicts the layout")

  def check_padding_of(self, archive: int, dtype: np.dtype, packed: np.ndarray) -> None:
    """Every padding slot of an archive's whole packed buffer of ``dtype`` is zero bits."""
    pads = self._pad_table(archive, dtype)
    view = _bitview.bits(packed)
    for k in np.flatnonzero(pads.owned < pads.stops).tolist():
      nz = np.flatnonzero(view[pads.owned[k]:pads.stops[k]])
      if nz.size:
        raise self._padding_error(archive, pads, k,
                                  int(pads.owned[k] - pads.starts[k]) + int(nz[0]))

  def check_padding(self, trailing: set, scratch: np.ndarray,
                    stats: Optional[ReadStats] = None) -> None:
    """Reads the padding of the buffers in ``trailing`` and checks it is zero bits.

    ``trailing`` holds ``(archive, dtype, (param, mirror))``: buffers of
    all-padding ranks, which no run copies from (``read_runs`` collects them, or
    ``_restore.all_padding_sources``).
    """
    by_file: dict[tuple[int, np.dtype], list] = {}
    for archive, dtype, key in trailing:
      by_file.setdefault((archive, dtype), []).append(key)
    for (archive, dtype), keys in sorted(by_file.items(), key=lambda kv: (kv[0][0],
                                                                          kv[0][1].name)):
      self.check_archive(archive)
      pads = self._pad_table(archive, dtype)
      ks = sorted(pads.index[key] for key in keys if key in pads.index)
      ks = [k for k in ks if pads.owned[k] < pads.stops[k]]
      if not ks:
        continue
      empty = np.zeros(0, np.int64)
      self._read(archive, dtype, pads, np.asarray(ks, np.int64), empty, empty, empty, None,
                 scratch, stats)

  def open_buffer(self, archive: int, dtype: np.dtype) -> _shardfile.ShardFile:
    meta = self.archive_meta(archive)
    b = meta["buffers"][np.dtype(dtype).name]
    with self._root.dir(self.names[archive]) as adir:
      return _shardfile.ShardFile(adir, np.dtype(dtype).name, b["elements"], dtype, b["chunk"],
                                  b["crc32c"], label=f"archive {archive}")

  def read_buffer(self, archive: int, dtype: np.dtype) -> np.ndarray:
    """A whole packed buffer, read straight into a fresh array."""
    n = self.layout(archive).sizes.get(dtype, 0)
    if not n:
      return np.empty(0, dtype)
    f = self.open_buffer(archive, dtype)  # metadata, size and index checked first
    try:
      out = allocate(n, dtype, f"archive {archive} ({self.directory}/{self.names[archive]})",
                     zeros=False)
      f.read_all(out)
    finally:
      f.close()
    return out

  def check_files(self, archive: int) -> None:
    """Every buffer file of an archive against its metadata, before anything is allocated."""
    self.archive_meta(archive)
    for d, n in self.layout(archive).sizes.items():
      if n:
        self.open_buffer(archive, d).close()

  def read_runs(self, archive: int, dtype: np.dtype, src: np.ndarray, dst: np.ndarray,
                length: np.ndarray, out: np.ndarray, scratch: np.ndarray,
                stats: Optional[ReadStats] = None, trailing: Optional[set] = None) -> None:
    """Copies runs of one packed buffer into ``out``, reading only their chunks.

    The padding of every history buffer the runs copy from is read as well
    (usually inside a chunk read anyway) and must be zero bits: data where the
    layout says padding contradicts the layout, and is refused.

    ``scratch`` (uint8) holds the chunk spans read; it grows to one chunk if smaller.
    ``stats``, when given, counts the chunk spans read. ``trailing``, when
    given, collects the all-padding ranks after each rank the runs copy a
    param's last elements from, for :meth:`check_padding`.
    """
    pads = self._pad_table(archive, dtype)
    touched = np.unique(np.searchsorted(pads.starts, src, side="right") - 1)
    touched = touched[touched >= 0]
    if trailing is not None:
      for k in touched.tolist():
        for a in pads.trailing[k]:
          trailing.add((a, np.dtype(dtype), pads.keys[k]))
    checks = touched[pads.owned[touched] < pads.stops[touched]]
    self._read(archive, dtype, pads, checks, src, dst, length, out, scratch, stats)

  def _read(self, archive: int, dtype: np.dtype, pads: _Pads, checks: np.ndarray, src, dst,
            length, out, scratch: np.ndarray, stats: Optional[ReadStats]) -> None:
    """Copies the runs and checks the padding of buffers ``checks`` (indices into ``pads``)."""
    zero = (pads.owned[checks], pads.stops[checks] - pads.owned[checks])

    def refuse(i: int, pos: int) -> ArchiveError:
      k = int(checks[i])
      return self._padding_error(archive, pads, k, pos - int(pads.starts[k]))

    f = self.open_buffer(archive, dtype)
    try:
      if len(scratch) < f.stride:
        scratch = np.empty(f.stride, np.uint8)
      _read_runs(f, src, dst, length, out, scratch, stats, zero=zero, refuse=refuse)
    finally:
      f.close()

  def metadata_record(self, archive: int) -> ShardRecord:
    """An archive's record with ``LeafInfo`` (shape and dtype, no data) as buffers."""
    layout = self.layout(archive)
    return ShardRecord(version=self.record_version, placements=tuple(self.placements(archive)),
                       state=layout.state(self.scalars(archive), layout.infos()),
                       roles=layout.roles)

  def record(self, archive: int) -> ShardRecord:
    """One whole archive, read from disk."""
    layout = self.layout(archive)
    packed = {d: self.read_buffer(archive, d) for d in layout.sizes}
    for d, data in packed.items():
      self.check_padding_of(archive, d, data)
    buffers = {key: packed[d][o:o + n] for key, (d, o, n) in layout.offsets.items()}
    state = layout.state(self.scalars(archive), buffers)
    return ShardRecord(version=self.record_version, placements=tuple(self.placements(archive)),
                       state=state, roles=layout.roles)



def _read_runs(f: _shardfile.ShardFile, src, dst, length, out, scratch,
               stats: Optional[ReadStats] = None, zero=None, refuse=None) -> None:
  """Copies runs ``src -> dst`` of ``f`` into ``out``, reading each chunk span once.

  ``zero``: ``(starts, lengths)`` of ranges of ``f`` that must be zero bits,
  read with the same spans; ``refuse(i, position)`` makes the error for range ``i``.
  """
  n_copy = len(src)
  if zero is not None and len(zero[0]):
    src = np.concatenate([src, zero[0]])
    length = np.concatenate([length, zero[1]])
    dst = np.concatenate([dst, np.zeros(len(zero[0]), np.int64)])
  if f.size and (int((src + length).max(initial=0)) > f.size or int(src.min(initial=0)) < 0):
    raise ArchiveError(f"{f.path}: a planned read lies outside its {f.size} elements")
  if not len(src):
    return
  c = f.chunk
  first, last = src // c, (src + length - 1) // c
  pieces = last - first + 1
  run = np.repeat(np.arange(len(src)), pieces)
  chunk = first[run] + (np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces))
  lo = np.maximum(src[run], chunk * c)
  hi = np.minimum(src[run] + length[run], (chunk + 1) * c)
  to = dst[run] + (lo - src[run])
  order = np.argsort(chunk, kind="stable")
  per_span = max(1, len(scratch) // f.stride)
  view = _bitview.bits(out) if n_copy else None
  data, span_first, span_n = None, -1, 0
  needed = np.unique(chunk)
  pos = 0
  for j in order.tolist():
    ch = int(chunk[j])
    if not span_first <= ch < span_first + span_n:
      # The next span: consecutive needed chunks from this one, as many as fit.
      pos = int(np.searchsorted(needed, ch))
      n = 1
      while (pos + n < len(needed) and n < per_span and needed[pos + n] == ch + n):
        n += 1
      data = f.read_chunks(ch, n, scratch)
      span_first, span_n = ch, n
      if stats is not None:
        stats.reads += 1
        stats.chunks += n
        stats.bytes += n * f.stride
    row = data[ch - span_first]
    a, b, t = int(lo[j]) - ch * c, int(hi[j]) - ch * c, int(to[j])
    r = int(run[j])
    if r < n_copy:
      view[t:t + b - a] = row[a:b]
    else:
      nz = np.flatnonzero(row[a:b])
      if nz.size:
        raise refuse(r - n_copy, ch * c + a + int(nz[0]))



def open_checkpoint(directory: os.PathLike | str) -> Checkpoint:
  """Reads and checks a checkpoint's index; reads no archive.

  The checkpoint directory is opened once: every later read of this object
  opens its files below that descriptor, which is closed by ``close()`` (or
  ``with``) or when the object is garbage collected.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ArchiveError: it is not a jaxreshard checkpoint of this format version, its
      index fails its checksum, or its index is malformed.
  """
  return Checkpoint(directory)

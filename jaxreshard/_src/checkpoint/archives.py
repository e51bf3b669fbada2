"""Reading an archive's files: its packed buffers and their padding (its ``archive.json``
through ``archivejson``).

Everything read here is untrusted (see ``reader``): an ``archive.json`` is
checked against the index before it is used, buffer files against their
metadata before anything is allocated, and the padding slots of every buffer
a read copies from must hold zero bits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import archivejson as _archivejson
from jaxreshard._src.checkpoint import pads as _pads
from jaxreshard._src.checkpoint import runread as _runread
from jaxreshard._src.checkpoint import shardread as _shardread
from jaxreshard._src.checkpoint import zeroread as _zeroread
from jaxreshard._src.checkpoint.index import ARCHIVE_FILE, ArchiveLayout, Index
from jaxreshard._src.checkpoint.shardfile import INDEX_ENTRY_BYTES, META_FILE, SHARD_KEY
from jaxreshard._src.checkpoint.shardread import ReadStats
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.errors import ArchiveError, ReshardError
from jaxreshard._src.exec import bitview as _bitview
from jaxreshard._src.exec import fresh as _fresh


def allocate(n: int, dtype: np.dtype, what: str, *, zeros: bool = True) -> np.ndarray:
  """A fresh ``(n,)`` buffer for a read; more than the process can get is a ReshardError."""
  dtype = np.dtype(dtype)
  try:
    return _fresh.zeros(n, dtype) if zeros else np.empty(n, dtype)
  except MemoryError:
    raise ReshardError(
      f"{what}: a buffer of {n} {dtype.name} elements ({n * dtype.itemsize} bytes) needs more"
      " memory than this process can get"
    ) from None


def path_arg(directory: Any, what: str = "directory") -> str:
  """``directory`` as an absolute path; anything that is not a path is refused by name."""
  if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
    raise ReshardError(
      f"{what} must be a path (str or os.PathLike), got {type(directory).__name__}"
    )
  try:
    path = os.fspath(directory)
  except TypeError as e:  # an os.PathLike whose __fspath__ gives neither str nor bytes
    raise ReshardError(f"{what} is not a usable path ({e})") from None
  if not isinstance(path, str) or not path or "\0" in path:
    raise ReshardError(f"{what} {path!r} is not a usable path")
  parts = os.path.join(os.getcwd(), path).split(os.sep)
  if ".." not in parts:
    return os.path.abspath(path)
  # A ``..`` after a link is the link target's parent, as the kernel takes it (not
  # the link's, as a textual normalisation would): what comes before the last one
  # is resolved (``realpath``), what follows it is normalised as text.
  last = len(parts) - 1 - parts[::-1].index("..")
  head = os.path.realpath(os.sep.join(parts[: last + 1]) or os.sep)
  return os.path.normpath(os.path.join(head, *parts[last + 1 :]))


# The bytes at the end of a buffer file that opening it reads (its shard index)
# for a file of up to 4,096 chunks; more only for larger files.
_SHARD_INDEX_TAIL = 4096 * INDEX_ENTRY_BYTES + 4


class ArchiveReader:
  """The archives of one opened checkpoint: their metadata, buffers and padding.

  It owns what it learns of each archive (its checked ``archive.json`` in
  ``metas``, where the padding of each packed buffer lies) for as long as it lives.

  Args:
    directory: the checkpoint's path (for messages).
    root: the checkpoint's root descriptor (``_shardread.Dir``).
    index: the parsed index.
    placement: a weak reference to ``placement(archive, pid)`` of the checkpoint (a
      strong one would keep the checkpoint, and its root descriptor, alive in a cycle).
  """

  def __init__(self, directory: str, root: Any, index: Index, placement: Callable):
    self.directory = directory
    self.index = index
    self._root = root
    self._placement = placement
    self.metas = _archivejson.ArchiveMetas(directory, root, index)
    self._pads: dict[tuple[int, np.dtype], _pads.Pads] = {}
    self._bases: dict[tuple[int, np.dtype], _pads.PadBase] = {}  # by (layout, group, dtype)

  def _layout(self, archive: int) -> ArchiveLayout:
    return self.index.layouts[self.index.archive_layout[archive]]

  def archive_meta(self, archive: int) -> dict:
    """An archive's ``archive.json``, checked against the index (read once)."""
    return self.metas.get(archive)

  def _pad_table(self, archive: int, dtype: np.dtype) -> _pads.Pads:
    """Where the padding of an archive's packed buffer of ``dtype`` lies (made once)."""
    key = (archive, np.dtype(dtype))
    pads = self._pads.get(key)  # a dict's get and set are atomic; a race makes one twice
    if pads is None:
      layout = self._layout(archive)
      pads = _pads.for_archive(self.index, layout, self._placement(), archive, key[1], self._bases)
      self._pads[key] = pads
    return pads

  def _padding_error(self, archive: int, pads: _pads.Pads, k: int, local: int) -> ArchiveError:
    where = f"{self.directory}/{self.index.names[archive]}"
    return _pads.error_at(where, self._placement(), archive, pads.keys[k], local)

  def check_padding_of(self, archive: int, dtype: np.dtype, packed: np.ndarray) -> None:
    """Every padding slot of an archive's whole packed buffer of ``dtype`` is zero bits."""
    pads = self._pad_table(archive, dtype)
    view = _bitview.bits(packed)
    for k in np.flatnonzero(pads.owned < pads.stops).tolist():
      nz = np.flatnonzero(view[pads.owned[k] : pads.stops[k]])
      if nz.size:
        raise self._padding_error(
          archive, pads, k, int(pads.owned[k] - pads.starts[k]) + int(nz[0])
        )

  def check_padding(
    self,
    files: Iterable[tuple[int, np.dtype, np.ndarray, np.ndarray]],
    scratch: np.ndarray,
    stats: ReadStats | None = None,
    held: dict | None = None,
    before: Callable[[int], None] | None = None,
  ) -> None:
    """Reads the padding of buffers ``(names[i], mirrors[i])`` of each ``(archive,
    dtype, names, mirrors)`` of ``files`` and checks it is zero bits, file after file.

    They are buffers of ``archive``'s packed buffer of ``dtype`` on all-padding
    ranks, which no run copies from (``_pads.Trailing``), their params by number
    in the index's ``tables.pids``. The files' reads are planned together
    (``zeroread``); their checks and refusals are those of one read per file, in
    order. ``held``: ``(archive, dtype) -> ShardFile`` the caller holds open;
    ``before(archive)``: the caller's own check of each archive, made at its turn.
    """

    def prepare(row):
      archive, dtype, names, mirrors = row
      if before is not None:
        before(archive)
      pads = self._pad_table(archive, dtype)
      ks = pads.find(names, mirrors)
      owned = pads.at(ks)
      pad = owned < pads.stops[ks]
      ks, owned = ks[pad], owned[pad]
      if not len(ks):
        return None
      f = None if held is None else held.get((archive, dtype))
      mine = f is None
      f = self.open_buffer(archive, dtype) if mine else f
      return f, mine, owned, pads.stops[ks] - owned, self._refuse(archive, pads, ks)

    _zeroread.ZeroReads(scratch, stats).check(files, prepare)

  def _refuse(self, archive: int, pads: _pads.Pads, checks: np.ndarray) -> Callable:
    """The refusal of nonzero bits at file element ``pos`` in the padding of buffer
    ``checks[i]``."""

    def refuse(i: int, pos: int) -> ArchiveError:
      k = int(checks[i])
      return self._padding_error(archive, pads, k, pos - int(pads.starts[k]))

    return refuse

  def warmer(self, keys: Sequence[tuple[int, np.dtype]]) -> Warmer:
    """What asks the kernel ahead for buffers ``keys`` (``(archive, dtype)``, in the
    order they are opened) when they are not in the page cache (``Warmer``)."""
    return Warmer(self._root, self.index, self.metas, list(keys))

  def open_buffer(self, archive: int, dtype: np.dtype) -> _shardread.ShardFile:
    meta = self.archive_meta(archive)
    b = meta["buffers"][np.dtype(dtype).name]
    with self._root.dir(self.index.names[archive]) as adir:
      return _shardread.ShardFile(
        adir,
        np.dtype(dtype).name,
        b["elements"],
        dtype,
        b["chunk"],
        b["crc32c"],
        label=f"archive {archive}",
      )

  def read_buffer(self, archive: int, dtype: np.dtype) -> np.ndarray:
    """A whole packed buffer, read straight into a fresh array."""
    n = self._layout(archive).sizes.get(dtype, 0)
    if not n:
      return np.empty(0, dtype)
    f = self.open_buffer(archive, dtype)  # metadata, size and index checked first
    try:
      out = allocate(
        n, dtype, f"archive {archive} ({self.directory}/{self.index.names[archive]})", zeros=False
      )
      z = np.zeros(1, np.int64)  # one run over the whole buffer
      _runread.read_runs(f, z, z, np.array([n], np.int64), out, np.empty(0, np.uint8))
    finally:
      f.close()
    return out

  def read_all(self, archive: int) -> dict[tuple[str, int], np.ndarray]:
    """Every history buffer of an archive, by (param, mirror): its packed buffers read
    whole, their padding checked."""
    layout = self._layout(archive)
    packed = {d: self.read_buffer(archive, d) for d in layout.sizes}
    for d, data in packed.items():
      self.check_padding_of(archive, d, data)
    return {key: packed[d][o : o + n] for key, (d, o, n) in layout.offsets.items()}

  def check_files(self, archive: int) -> None:
    """Every buffer file of an archive against its metadata, before anything is allocated."""
    self.archive_meta(archive)
    for d, n in self._layout(archive).sizes.items():
      if n:
        self.open_buffer(archive, d).close()

  def read_runs(
    self,
    archive: int,
    dtype: np.dtype,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    out: np.ndarray,
    scratch: np.ndarray,
    stats: ReadStats | None = None,
    f: _shardread.ShardFile | None = None,
  ) -> None:
    """Copies runs of one packed buffer into ``out``, reading only their chunks.

    The padding of every history buffer the runs copy from is read as well
    (usually inside a chunk read anyway) and must be zero bits: data where the
    layout says padding contradicts the layout, and is refused.

    ``scratch`` (uint8) holds the chunk spans read; it grows to one chunk if smaller.
    ``stats``, when given, counts the chunk spans read. ``f``: the buffer's
    file, when the caller holds it open (``open_buffer``).
    """
    pads = self._pad_table(archive, dtype)
    touched = _copyplan.unique_ints(np.searchsorted(pads.starts, src, side="right") - 1)
    touched = touched[touched >= 0]
    owned = pads.at(touched)
    pad = owned < pads.stops[touched]
    checks, owned = touched[pad], owned[pad]
    zero = (owned, pads.stops[checks] - owned)
    refuse = self._refuse(archive, pads, checks)
    opened = f is None
    f = self.open_buffer(archive, dtype) if opened else f
    try:
      scratch = _runread.staging(scratch, f.stride, f)
      _runread.read_runs(f, src, dst, length, out, scratch, stats, zero=zero, refuse=refuse)
    finally:
      if opened:
        f.close()


class Warmer:
  """Asks the kernel ahead for the files of a read, when they are on disk only.

  A read opens its buffer files in turn (``opened``), then reads their chunks in
  the same order. When the first file's first chunk to read is not in the page
  cache (a restart reads a checkpoint nobody has read since it was written, or
  since the cache dropped it), every later file's metadata and chunks are asked
  for at once, on threads (``shardread.warm``): the disk serves them while this
  thread reads the first file (whose sequential reads the kernel reads ahead of
  by itself) and checks and copies. When it is in the cache, nothing is asked:
  the threads would only compete with the copies.
  """

  def __init__(self, root: Any, index: Index, metas: Any, keys: list[tuple[int, np.dtype]]):
    self._root, self._index, self._metas, self._keys = root, index, metas, keys
    self.cold: bool | None = None  # None: not yet known
    self._stop = threading.Event()

  def close(self) -> None:
    """The read is over (or refused): what was not asked for yet is left."""
    self._stop.set()

  def opened(self, i: int, f: _shardread.ShardFile, src, length) -> None:
    """File ``i`` of the keys is open; its runs read elements ``[src, src + length)``."""
    src, length = np.asarray(src, np.int64), np.asarray(length, np.int64)
    keep = length > 0
    src, length = src[keep], length[keep]
    if not len(src):
      return
    if self.cold is None:
      self.cold = not f.cached(int(src.min()))
      if self.cold:
        self._warm_meta(self._keys[i + 1 :])
    elif self.cold:
      parts = (self._index.names[self._keys[i][0]], f.dtype.name, *SHARD_KEY)
      _shardread.warm(self._root, [(parts, f.chunk_ranges(src, length))], self._stop)

  def _warm_meta(self, keys: Sequence[tuple[int, np.dtype]]) -> None:
    """Asks for the metadata that checking and opening buffers ``keys`` reads: each
    archive's ``archive.json`` not yet read, each buffer file's ``zarr.json`` and
    shard index."""
    files: list[_shardread.FileHint] = []
    for archive, dtype in keys:
      name, d = self._index.names[archive], np.dtype(dtype).name
      if not self._metas.has(archive):
        files.append(((name, ARCHIVE_FILE), [(0, 0)]))
      files.append(((name, d, META_FILE), [(0, 0)]))
      files.append(((name, d, *SHARD_KEY), [(-_SHARD_INDEX_TAIL, 0)]))
    _shardread.warm(self._root, files, self._stop)

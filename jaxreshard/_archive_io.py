"""Archives on disk: one checkpoint directory holding every rank's archive.

Layout (``save_records``)::

  CHECKPOINT/
    jaxreshard.json            # written last: format, version, archive names
    archive_00000/             # rank 0's archive (the i-th record given)
      record.json              # version, placements, roles, tree, clock scalars
      b00001/                  # one zarr v3 array per history buffer (leaf index)
        zarr.json
        c/0                    # one shard: uncompressed chunks, each with a crc32c
    archive_00001/ ...

History buffers are written through orbax's tensorstore array specs (the
``file`` kvstore, zarr v3, no OCDBT, no compression) with one change: every
inner chunk carries a crc32c, so a flipped bit is an error and not a silently
wrong optimizer state, and a whole buffer lives in one shard file whose index
lets a reader fetch only the chunks it needs. An uncompressed shard's size is
fixed by its shape, dtype and chunk, so every size in the metadata is checked
against ``stat`` of the file before anything is read or allocated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import uuid
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from jaxreshard import _archive_format as fmt
from jaxreshard import _structure, _validate
from jaxreshard._archive_format import ArchiveError, ArchiveExistsError
from jaxreshard._errors import PlacementError, ReshardError
from jaxreshard._record import ShardRecord

__all__ = [
    "ArchiveError",
    "ArchiveExistsError",
    "Checkpoint",
    "LazyBuffer",
    "Reader",
    "load_records",
    "open_checkpoint",
    "save_records",
    "write_checkpoint",
]

FORMAT = "jaxreshard-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "jaxreshard.json"
RECORD_FILE = "record.json"
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_JSON_BYTES = 1 << 30
_CRC_BYTES = 4
_INDEX_ENTRY_BYTES = 16  # per inner chunk: offset and length, uint64 each


# --- writing ------------------------------------------------------------------


def _chunk_elems(size: int, itemsize: int, chunk_bytes: int) -> int:
  return max(1, min(size, chunk_bytes // itemsize))


def _write_spec(path: epath.Path, shape, dtype: np.dtype, chunk: int, ctx) -> dict:
  info = ocp.type_handlers.ParamInfo(
      name=path.name, parent_dir=path.parent, use_zarr3=True, use_compression=False,
      is_ocdbt_checkpoint=False, ts_context=ctx)
  spec = ocp.type_handlers.get_json_tspec_write(
      info, use_ocdbt=False, global_shape=tuple(shape), local_shape=tuple(shape), dtype=dtype)
  # One shard per buffer; crc32c on each inner chunk (orbax checksums only the index).
  spec["metadata"] = {
      "shape": list(shape),
      # A shard must be a whole number of inner chunks.
      "chunk_grid": {"name": "regular", "configuration": {
          "chunk_shape": [-(-shape[0] // chunk) * chunk]}},
      "codecs": [{"name": "sharding_indexed", "configuration": {
          "chunk_shape": [chunk],
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
          "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "crc32c"}],
          "index_location": "end",
      }}],
  }
  return spec


def _shard_bytes(size: int, itemsize: int, chunk: int) -> int:
  """Exact size of an uncompressed one-shard buffer file (see the module doc)."""
  n = -(-size // chunk)
  return n * (chunk * itemsize + _CRC_BYTES) + n * _INDEX_ENTRY_BYTES + _CRC_BYTES


def _dump(path: str, obj: Any) -> None:
  with open(path, "x") as f:
    json.dump(obj, f, separators=(",", ":"), allow_nan=False)


def _write_archive(archive_dir: epath.Path, index: int, record: Any, chunk_bytes: int, ctx) -> None:
  if not isinstance(record, ShardRecord):
    raise PlacementError(f"archive {index}: expected a ShardRecord, got {type(record).__name__}")
  try:
    roles = _structure.roles_of(record)
  except _structure.AnatomyError as e:
    raise PlacementError(f"archive {index}: {e}") from None
  tree, leaves = fmt.encode_tree(record.state)
  if len(leaves) != len(roles):
    raise PlacementError(f"archive {index}: {len(leaves)} state leaves but {len(roles)} roles")
  os.mkdir(archive_dir)
  entries, writes = [], []
  for i, (leaf, role) in enumerate(zip(leaves, roles)):
    if role is None:
      entries.append({"scalar": fmt.encode_scalar(leaf, f"archive {index}, leaf {i}")})
      continue
    value = np.asarray(leaf)
    dtype = fmt.np_dtype(value.dtype.name, f"param {role!r}: archive {index}")
    chunk = _chunk_elems(value.size, dtype.itemsize, chunk_bytes)
    name = f"b{i:05d}"
    entries.append({"buffer": {"name": name, "shape": list(value.shape),
                               "dtype": dtype.name, "chunk": chunk}})
    if value.size:
      spec = _write_spec(archive_dir / name, (value.size,), dtype, chunk, ctx)
      store = ts.open(spec, create=True, context=ctx).result()
      writes.append(store.write(value.reshape(-1)))
  for w in writes:
    w.result()
  _dump(str(archive_dir / RECORD_FILE), {
      "format": FORMAT,
      "version": record.version,
      "placements": [fmt.encode_placement(p) for p in record.placements],
      "roles": list(roles),
      "tree": tree,
      "leaves": entries,
  })


def write_checkpoint(directory: Any, records: Iterable[ShardRecord], *,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
  """Writes every record into an existing empty ``directory``; returns the count.

  Records are written one at a time as the iterable yields them. Not atomic by
  itself: ``save_records`` and the orbax handler supply the atomic commit.
  """
  directory = epath.Path(directory)
  ctx = ts.Context()
  names = []
  for index, record in enumerate(records):
    name = f"archive_{index:05d}"
    _write_archive(directory / name, index, record, chunk_bytes, ctx)
    names.append(name)
  if not names:
    raise PlacementError("no archives supplied")
  _dump(str(directory / INDEX_FILE),
        {"format": FORMAT, "format_version": FORMAT_VERSION, "archives": names})
  return len(names)


def new_temp_dir(final: str) -> str:
  """Creates the hidden sibling a checkpoint is written into before its rename.

  Raises:
    ArchiveExistsError: ``final`` exists (a checkpoint is never overwritten).
    FileNotFoundError: its parent directory does not exist.
  """
  if os.path.lexists(final):
    raise ArchiveExistsError(f"{final} already exists; jaxreshard never overwrites a checkpoint")
  parent = os.path.dirname(final)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"parent directory {parent} of {final} does not exist")
  tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex}")
  os.mkdir(tmp)
  return tmp


def save_records(directory: Any, records: Iterable[ShardRecord], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
  """Saves every rank's archive as one checkpoint directory, atomically.

  Args:
    directory: the checkpoint directory to create; it must not exist.
    records: the archives, in any iterable (a generator is written one record
      at a time, so a whole reshard never needs every rank in memory). Archive
      ``i`` is the ``i``-th record yielded.
    chunk_bytes: bytes per stored chunk, the granularity of partial reads.

  Raises:
    ArchiveExistsError: ``directory`` already exists.
    FileNotFoundError: its parent directory does not exist.
    ReshardError: a record that cannot be stored (no records, a state node
      type the format cannot re-create).

  Everything is written into a temporary sibling directory that is renamed to
  ``directory`` at the very end: a failed or killed save leaves no
  ``directory`` behind (at most a ``.NAME.tmp-*`` sibling, never loadable).

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, records)
    >>> [r.state[0].mu["w"].shape for r in load_records(path)]
    [(3,), (3,)]
  """
  if chunk_bytes < 1:
    raise ReshardError(f"chunk_bytes {chunk_bytes} must be positive")
  final = os.path.abspath(os.fspath(directory))
  tmp = new_temp_dir(final)
  try:
    write_checkpoint(tmp, records, chunk_bytes=chunk_bytes)
    if os.path.lexists(final):
      raise ArchiveExistsError(f"{final} appeared while it was being written")
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


# --- reading ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class LazyBuffer:
  """A history buffer still on disk: enough for the core's checks, no data.

  ``np.shape`` and ``.dtype`` work on it, so the core's validation runs on
  records whose buffers have not been read.
  """

  path: str  # the buffer's directory, already checked to lie in the checkpoint
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: int
  where: str

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  def file(self) -> str:
    return os.path.join(self.path, "c", "0")

  def check_file(self) -> None:
    """Refuses a buffer whose file does not have exactly the bytes its metadata says."""
    if self.size == 0:
      return
    expected = _shard_bytes(self.size, self.dtype.itemsize, self.chunk)
    try:
      actual = os.stat(self.file()).st_size
    except FileNotFoundError:
      raise ArchiveError(f"{self.where}: array file {self.file()} is missing") from None
    if actual != expected:
      raise ArchiveError(
          f"{self.where}: array file {self.file()} has {actual} bytes but its metadata"
          f" (shape {self.shape}, {self.dtype.name}, chunk {self.chunk}) needs {expected};"
          " the file is truncated or not from this checkpoint")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A checkpoint's metadata, read and checked; history buffers are LazyBuffers."""

  directory: str
  archive_names: tuple[str, ...]
  records: tuple[ShardRecord, ...]

  def buffers(self, index: int) -> list[LazyBuffer]:
    return [x for x in jax.tree.leaves(self.records[index].state) if isinstance(x, LazyBuffer)]


def _inside(root: str, *parts: str) -> str:
  path = os.path.join(root, *parts)
  real = os.path.realpath(path)
  if os.path.commonpath([real, root]) != root:
    raise ArchiveError(f"{path} leads outside the checkpoint {root}")
  return path


def _read_json(path: str, where: str) -> Any:
  try:
    size = os.stat(path).st_size
  except FileNotFoundError:
    raise ArchiveError(f"{where}: {path} is missing") from None
  if size > MAX_JSON_BYTES:
    raise ArchiveError(f"{where}: {path} has {size} bytes, more than metadata can have")
  try:
    with open(path, "rb") as f:
      text = f.read(MAX_JSON_BYTES + 1).decode("utf-8")
  except UnicodeDecodeError:
    raise ArchiveError(f"{where}: {path} is not UTF-8 JSON") from None
  return fmt.loads(text, f"{where}: {path}")


def _read_archive(root: str, index: int, name: str) -> ShardRecord:
  where = f"archive {index}"
  adir = _inside(root, name)
  if not os.path.isdir(adir):
    raise ArchiveError(f"{where}: the archive directory {adir} is missing")
  meta = fmt.expect(_read_json(_inside(root, name, RECORD_FILE), where), dict, where)
  # Buffer names match a strict pattern (no separators, no ".."), so only a
  # symbolic link could lead elsewhere: one directory listing finds them all,
  # instead of resolving every buffer's path.
  with os.scandir(adir) as listing:
    links = {e.name for e in listing if e.is_symlink()}
  if meta.get("format") != FORMAT:
    raise ArchiveError(f"{where}: {adir} is not a {FORMAT} archive")
  version = fmt.expect(meta.get("version"), int, f"{where} version")
  if set(meta) != {"format", "version", "placements", "roles", "tree", "leaves"}:
    # Another format version may use other keys: say so before anything else.
    if version != FORMAT_VERSION:
      raise PlacementError(f"archive {index}: record version {version!r} is not supported"
                           f" (only version {FORMAT_VERSION} exists)")
    raise ArchiveError(f"{where}: unexpected metadata keys {sorted(meta)}")
  placements = tuple(fmt.decode_placement(p, f"{where}, placement {k}")
                     for k, p in enumerate(fmt.expect(meta["placements"], list, where)))
  roles = fmt.expect(meta["roles"], list, where)
  entries = fmt.expect(meta["leaves"], list, where)
  if len(roles) != len(entries) or not all(r is None or isinstance(r, str) for r in roles):
    raise ArchiveError(f"{where}: roles do not describe the {len(entries)} stored leaves")
  leaves, names = [], set()
  for i, (entry, role) in enumerate(zip(entries, roles)):
    lw = f"{where}, leaf {i}"
    fmt.expect(entry, dict, lw)
    if set(entry) == {"scalar"} and role is None:
      leaves.append(fmt.decode_scalar(entry["scalar"], lw))
    elif set(entry) == {"buffer"} and role is not None:
      b = fmt.expect(entry["buffer"], dict, lw)
      if set(b) != {"name", "shape", "dtype", "chunk"}:
        raise ArchiveError(f"{lw}: invalid buffer entry {sorted(b)}")
      bname = fmt.check_name(b["name"], fmt.BUFFER_NAME, lw)
      if bname in names:
        raise ArchiveError(f"{lw}: buffer {bname} is used twice")
      names.add(bname)
      bw = f"param {role!r}: archive {index}, buffer {bname}"
      chunk = fmt.expect(b["chunk"], int, lw)
      shape = fmt.shape_of(b["shape"], lw)
      if chunk < 1 or (math.prod(shape) and chunk > math.prod(shape)):
        raise ArchiveError(f"{lw}: chunk {chunk} does not fit shape {shape}")
      if bname in links:
        raise ArchiveError(f"{lw}: {os.path.join(adir, bname)} is a symbolic link; a"
                           " checkpoint's buffers must lie inside it")
      leaves.append(LazyBuffer(os.path.join(adir, bname), shape,
                               fmt.np_dtype(b["dtype"], lw), chunk, bw))
    else:
      raise ArchiveError(f"{lw}: entry {sorted(entry)} disagrees with its role {role!r}")
  state = fmt.decode_tree(meta["tree"], leaves, where)
  return ShardRecord(version=version, placements=placements, state=state, roles=tuple(roles))


def open_checkpoint(directory: Any) -> Checkpoint:
  """Reads and checks every archive's metadata; reads no array data.

  Raises:
    FileNotFoundError: ``directory`` does not exist (the message names it).
    ArchiveError: it is not a jaxreshard checkpoint, or an archive or its
      metadata is missing or malformed.
    PlacementError: an archive of another format version.
  """
  root = os.path.realpath(os.fspath(directory))
  if not os.path.exists(root):
    raise FileNotFoundError(f"checkpoint directory {os.fspath(directory)} does not exist")
  if not os.path.isdir(root):
    raise ArchiveError(f"{os.fspath(directory)} is not a directory, so not a jaxreshard checkpoint")
  index_path = os.path.join(root, INDEX_FILE)
  if not os.path.isfile(index_path):
    raise ArchiveError(f"{os.fspath(directory)} is not a jaxreshard checkpoint (no {INDEX_FILE};"
                       " a save that did not finish leaves none)")
  index = fmt.expect(_read_json(index_path, "checkpoint"), dict, INDEX_FILE)
  if index.get("format") != FORMAT or set(index) != {"format", "format_version", "archives"}:
    raise ArchiveError(f"{index_path} does not describe a {FORMAT}")
  if index["format_version"] != FORMAT_VERSION:
    raise ArchiveError(f"{index_path}: checkpoint format version {index['format_version']!r}"
                       f" is not supported (only {FORMAT_VERSION})")
  names = fmt.expect(index["archives"], list, INDEX_FILE)
  for n in names:
    fmt.check_name(n, fmt.ARCHIVE_NAME, INDEX_FILE)
  if not names or len(set(names)) != len(names):
    raise ArchiveError(f"{index_path}: the archive list is empty or has repeats")
  records = tuple(_read_archive(root, i, n) for i, n in enumerate(names))
  return Checkpoint(root, tuple(names), records)


class Reader:
  """Reads flat ranges of history buffers, opening each array at most once.

  Every buffer is checked (file size, then the zarr metadata against the
  record's) before its first read; a tensorstore failure (a bad checksum, a
  truncated shard) becomes an ``ArchiveError`` naming the file.
  """

  def __init__(self):
    self._ctx = ts.Context()
    self._open: dict[str, Any] = {}
    self._lock = threading.Lock()
    self.opened = 0  # arrays opened so far (each at most once)

  def _store(self, buf: LazyBuffer):
    with self._lock:
      store = self._open.get(buf.path)
    if store is None:
      self._open_all([buf])
      with self._lock:
        store = self._open[buf.path]
    return store

  def _open_all(self, bufs) -> None:
    """Opens every not-yet-open buffer of ``bufs``: all opens in flight at once."""
    pending, seen = [], set()
    for buf in bufs:
      with self._lock:
        known = buf.path in self._open
      if known or buf.path in seen:
        continue
      seen.add(buf.path)
      buf.check_file()
      info = ocp.type_handlers.ParamInfo(
          name=os.path.basename(buf.path), parent_dir=epath.Path(os.path.dirname(buf.path)),
          use_zarr3=True, is_ocdbt_checkpoint=False, ts_context=self._ctx)
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=False)
      pending.append((buf, ts.open(spec, open=True, context=self._ctx)))
    for buf, future in pending:
      try:
        store = future.result()
      except Exception as e:  # tensorstore raises ValueError/RuntimeError variants
        raise ArchiveError(f"{buf.where}: cannot open {buf.path}: {e}") from None
      if (tuple(store.shape) != (buf.size,) or np.dtype(store.dtype.numpy_dtype) != buf.dtype
          or list(store.chunk_layout.read_chunk.shape) != [buf.chunk]):
        raise ArchiveError(
            f"{buf.where}: {buf.path} holds {store.dtype.name}{list(store.shape)} in chunks of"
            f" {list(store.chunk_layout.read_chunk.shape)} but the archive says"
            f" {buf.dtype.name}[{buf.size}] in chunks of {buf.chunk}")
      with self._lock:
        self._open[buf.path] = store
        self.opened += 1

  def read(self, requests: list[tuple[LazyBuffer, int, int]]) -> list[np.ndarray]:
    """Reads flat ``[lo, hi)`` of each buffer, all at once; every buffer is checked first."""
    for buf, lo, hi in requests:
      if not 0 <= lo <= hi <= buf.size:
        raise ArchiveError(f"{buf.where}: range [{lo}, {hi}) is outside its {buf.size} elements")
    self._open_all([buf for buf, _, _ in requests if buf.size])
    futures = [self._store(b)[lo:hi].read() if hi > lo else None for b, lo, hi in requests]
    out = []
    for (buf, lo, hi), fut in zip(requests, futures):
      if fut is None:
        out.append(np.zeros((0,), buf.dtype))
        continue
      try:
        out.append(fut.result())
      except Exception as e:
        raise ArchiveError(f"{buf.where}: reading {buf.path} failed (corrupted or truncated):"
                           f" {e}") from None
    return out


def load_records(directory: Any) -> list[ShardRecord]:
  """Loads every archive of a checkpoint, exactly as it was saved.

  Needs neither the optimizer nor the model: the state's tree structure,
  placements, roles and clock scalars come from the archives' metadata.

  Args:
    directory: a checkpoint written by ``save_records``.

  Returns:
    The records, archive 0 first, with jax arrays as buffers.

  Raises:
    FileNotFoundError: ``directory`` does not exist.
    ReshardError: not a jaxreshard checkpoint, a missing archive, an archive of
      another version, a truncated, corrupted or inconsistent file.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(3.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=3))
    >>> [r.placements[0].rank for r in load_records(path)]
    [0, 1, 2]
  """
  ckpt = open_checkpoint(directory)
  for i, rec in enumerate(ckpt.records):
    _validate.check_archive(i, rec)  # version and duplicate refusals, before any read
  reader = Reader()
  for i in range(len(ckpt.records)):
    for buf in ckpt.buffers(i):
      buf.check_file()  # every size against the bytes present before allocating
  out = []
  for i, rec in enumerate(ckpt.records):
    bufs = ckpt.buffers(i)
    data = iter(reader.read([(b, 0, b.size) for b in bufs]))
    values = {id(b): jnp.asarray(next(data).reshape(b.shape)) for b in bufs}
    state = jax.tree.map(lambda x: values.get(id(x), x) if isinstance(x, LazyBuffer) else x,
                         rec.state)
    out.append(dataclasses.replace(rec, state=state))
  return out

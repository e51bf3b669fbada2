"""One flat buffer on disk: a zarr v3 array of one shard, a crc32c on every chunk.

The file format is zarr v3's ``sharding_indexed`` codec, exactly as tensorstore
and orbax read it (``zarr.json`` plus the shard ``c/0``): the buffer is cut
into chunks of ``chunk`` elements (the last one zero-padded), each stored as
its little-endian bytes followed by their crc32c; after them comes the shard
index (per chunk: byte offset and length, uint64 little-endian) and its own
crc32c. jaxreshard writes and reads these bytes itself: with one ``writev`` /
``preadv`` per span of chunks straight from and into the caller's buffers,
and a hardware crc32c, it runs at the speed of the page cache, which
tensorstore's general read path does not (see ``benchmarks/README.md``).

Reading trusts nothing: files are opened below a directory descriptor of the
checkpoint without following symbolic links and must be regular files, the
metadata must be exactly what this module writes, the file must have exactly
the size that metadata implies, the index must be the one this module
writes, and every chunk read is checked against its own crc32c and against the
crc32c the archive's metadata recorded for it.

The reading side (``Dir``, ``ShardFile``) is ``shardread``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
from typing import Any

import google_crc32c
import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.errors import ArchiveError

__all__ = [
  "OutDir",
  "check_byte_order",
  "chunk_elements",
  "file_size",
  "json_bytes",
  "write_array",
  "zarr_metadata",
]

CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
META_FILE = "zarr.json"
SHARD_KEY = ("c", "0")
MAX_META_BYTES = 1 << 16
_IOV_MAX = 512  # iovecs per system call, well below Linux's 1024

# zarr's name of each dtype a buffer is stored in (``encoding.BUFFER_DTYPES``).
_ZARR_DTYPES = {name: name for name in fmt.BUFFER_DTYPES}


# Chunks per buffer at most: an archive's metadata lists the crc32c of every chunk
# (up to 11 bytes of JSON each), and must stay well inside the 64 MiB a reader
# accepts (``MAX_ARCHIVE_BYTES``) with a buffer of each dtype. A larger buffer gets
# larger chunks than ``chunk_bytes`` (16 GiB of 16 KiB chunks).
MAX_CHUNKS = 1 << 20


def check_byte_order() -> None:
  """Buffer files hold little-endian bytes, written and read as the host holds
  them, never converted: a host of the other byte order is refused."""
  if sys.byteorder != "little":
    raise ArchiveError(
      f"this host is {sys.byteorder}-endian: buffer files hold little-endian bytes, which"
      " jaxreshard neither writes nor reads on such a host (resharding in memory works)"
    )


def chunk_elements(size: int, itemsize: int, chunk_bytes: int) -> int:
  """Elements per chunk for a buffer of ``size`` elements: ``chunk_bytes`` worth, or
  more where that would make more than ``MAX_CHUNKS`` chunks."""
  return max(1, min(size, max(chunk_bytes // itemsize, -(-size // MAX_CHUNKS))))


def n_chunks(size: int, chunk: int) -> int:
  return -(-size // chunk)


def file_size(size: int, itemsize: int, chunk: int) -> int:
  """Exact bytes of the shard file of a buffer of ``size`` elements."""
  n = n_chunks(size, chunk)
  return n * (chunk * itemsize + CRC_BYTES) + n * INDEX_ENTRY_BYTES + CRC_BYTES


def zarr_metadata(size: int, dtype: np.dtype, chunk: int) -> dict:
  """The ``zarr.json`` of a buffer: one shard holding every chunk."""
  le = {"name": "bytes", "configuration": {"endian": "little"}}
  return {
    "zarr_format": 3,
    "node_type": "array",
    "shape": [size],
    "data_type": _ZARR_DTYPES[np.dtype(dtype).name],
    "chunk_grid": {
      "name": "regular",
      "configuration": {"chunk_shape": [n_chunks(size, chunk) * chunk]},
    },
    "chunk_key_encoding": {"name": "default"},
    "fill_value": 0.0,
    "codecs": [
      {
        "name": "sharding_indexed",
        "configuration": {
          "chunk_shape": [chunk],
          "codecs": [le, {"name": "crc32c"}],
          "index_codecs": [le, {"name": "crc32c"}],
          "index_location": "end",
        },
      }
    ],
  }


def _normalized(meta: Any) -> Any:
  """``index_location: end`` is zarr's default; tensorstore leaves it out."""
  try:
    conf = meta["codecs"][0]["configuration"]
    if isinstance(conf, dict):
      conf.setdefault("index_location", "end")
  except (KeyError, IndexError, TypeError):
    pass
  return meta


def _crc(data: Any) -> int:
  if not isinstance(data, (bytes, np.ndarray)):
    data = np.frombuffer(data, np.uint8)  # the C implementation takes arrays, not memoryviews
  return google_crc32c.value(data)


class _Syncer:
  """Fsyncs handed-over descriptors on a few threads, then closes them.

  Files are fsync'ed while the writer goes on writing the next ones, and
  concurrent fsyncs share the file system's journal commits, so a checkpoint
  of many small files costs a few commits instead of one per file. At most
  ``limit`` descriptors wait at a time. :meth:`drain` waits for every fsync
  and raises the first failure, naming its file.
  """

  def __init__(self, threads: int = 8, limit: int = 64):
    self._pool = concurrent.futures.ThreadPoolExecutor(threads, "jaxreshard-fsync")
    self._slots = threading.BoundedSemaphore(limit)
    self._pending: list[concurrent.futures.Future] = []

  def submit(self, job: list[int], path: str) -> None:
    """Hands ``job`` (``[fd]``) over: fsync'ed and closed by a worker. Raising, it
    leaves the descriptor closed, or in ``job`` for the caller to close (an interrupt
    that lands as this is called)."""
    try:
      self._slots.acquire()
    except BaseException:  # Ctrl-C while every slot is taken: the descriptor is still ours
      _close_job(job)
      raise
    # The descriptor and its slot belong to whoever pops it from ``job`` first (one
    # atomic step): the worker, or this thread when the hand-over fails. An interrupt
    # (Ctrl-C) may land after the pool took the job and before it is recorded: then
    # the worker still fsyncs and closes it, and it is never closed twice (a second
    # close could close another file that reused the number) nor its slot freed twice.
    try:
      self._pending.append(self._pool.submit(self._sync, job, path))
    except BaseException:
      if _close_job(job):  # not the worker's
        self._slots.release()
      raise
    if len(self._pending) > 1024:  # keep the list short: collect what finished
      done = [f for f in self._pending if f.done()]
      self._pending = [f for f in self._pending if not f.done()]
      for f in done:
        f.result()

  def _sync(self, job: list, path: str) -> None:
    try:
      fd = job.pop()
    except IndexError:  # the hand-over failed, and the submitter closed it
      return
    try:
      os.fsync(fd)
    except OSError as e:
      raise OSError(e.errno, e.strerror, path) from None
    finally:
      os.close(fd)
      self._slots.release()

  def drain(self) -> None:
    """Waits for every fsync handed over; raises the first that failed."""
    pending, self._pending = self._pending, []
    error = None
    for f in pending:
      try:
        f.result()
      except OSError as e:
        error = error or e
    if error is not None:
      raise error

  def shutdown(self) -> None:
    """Waits for every fsync (failures ignored: the caller is failing already)."""
    try:
      self.drain()
    except OSError:
      pass
    except BaseException:  # Ctrl-C while waiting: the threads end once their fsyncs are done
      self._pool.shutdown(wait=False)
      raise
    self._pool.shutdown(wait=True)


class OutDir:
  """A directory being written, held by its descriptor: every name is created below it.

  The directory is opened once (``O_DIRECTORY | O_NOFOLLOW``); files and
  subdirectories are created relative to that descriptor (``openat``,
  ``mkdirat``, never following a symbolic link), so a rename or replacement of
  its path while it is written cannot redirect a single byte. With ``durable``
  every file is fsync'ed once written, and :meth:`sync` fsyncs the directory
  itself (its entries), which the writer calls once a directory is complete;
  the fsyncs run in the background, and :meth:`drain` on the directory that was
  opened (the root of what is written) waits for all of them.
  """

  def __init__(self, fd: int, path: str, durable: bool = True, syncer: _Syncer | None = None):
    self.path, self.durable = path, durable
    self._own_syncer = durable and syncer is None
    self._syncer = (_Syncer() if self._own_syncer else syncer) if durable else None
    # Last: interrupted before this, the caller still owns ``fd`` and closes it (and
    # ``__del__`` does not); from here the object does.
    self.fd = fd

  @classmethod
  def open(cls, path: str, durable: bool = True) -> OutDir:
    """Holds the existing directory ``path``."""
    try:
      fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
      raise OSError(e.errno, e.strerror, path) from None
    return cls(fd, path, durable)

  def drain(self) -> None:
    """Waits until every file and directory handed over below this one is fsync'ed.

    Raises:
      OSError: an fsync failed (``filename`` is its file).
    """
    if self._syncer is not None:
      self._syncer.drain()

  def close(self) -> None:
    """Closes the directory; the one that was opened first waits for its fsyncs."""
    fd, self.fd = self.fd, -1
    try:
      if fd >= 0:
        os.close(fd)
    finally:
      if self._own_syncer:
        self._own_syncer = False
        self._syncer.shutdown()

  def __del__(self):
    # An interrupt (Ctrl-C) that lands in a ``with`` block's exit drops the object
    # unclosed: its descriptor goes with it, not kept on a removed directory for the
    # life of the process. (Its fsyncs are waited for by whoever holds the root.)
    fd, self.fd = getattr(self, "fd", -1), -1
    if fd >= 0:
      try:
        os.close(fd)
      except Exception:  # noqa: BLE001 - a finalizer reports nothing
        pass

  def __enter__(self) -> OutDir:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def mkdir(self, name: str) -> OutDir:
    """Creates the subdirectory ``name`` and holds it."""
    path = os.path.join(self.path, name)
    try:
      os.mkdir(name, 0o777, dir_fd=self.fd)
      fd = os.open(
        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd
      )
    except OSError as e:
      raise OSError(e.errno, e.strerror, path) from None
    try:
      return OutDir(fd, path, self.durable, self._syncer)
    except BaseException:  # an interrupt before the OutDir holds it
      os.close(fd)
      raise

  def create(self, name: str) -> int:
    """A new file ``name`` (never an existing one or a link), open for writing."""
    try:
      return os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=self.fd,
      )
    except OSError as e:
      raise OSError(e.errno, e.strerror, os.path.join(self.path, name)) from None

  def finish(self, job: list[int], name: str) -> None:
    """Hands a written file (``job``: ``[fd]``) over to be fsync'ed and closed (closes
    it when not durable). Raising, it leaves the descriptor closed or in ``job``: the
    caller closes what is left there (``_close_job``), never twice."""
    if self._syncer is None:
      _close_job(job)
    else:
      self._syncer.submit(job, os.path.join(self.path, name))

  def write_bytes(self, name: str, data: bytes) -> None:
    """Writes ``data`` as the new file ``name``; errors name the file."""
    job = [self.create(name)]
    try:
      try:
        _writev(job[0], [data])
      except OSError as e:  # a full disk reports itself without the file's name
        raise OSError(e.errno, e.strerror, os.path.join(self.path, name)) from None
      self.finish(job, name)
    except BaseException:  # an error, or an interrupt (Ctrl-C) up to the hand-over: the
      _close_job(job)  # file is removed with its directory, and no descriptor keeps it
      raise

  def write_json(self, name: str, obj: Any) -> None:
    """Writes ``obj`` as compact JSON into the new file ``name``."""
    self.write_bytes(name, json_bytes(obj))

  def sync(self) -> None:
    """Hands the directory's own entries over to be fsync'ed (when durable)."""
    if self._syncer is not None:
      job = [os.dup(self.fd)]
      try:
        self._syncer.submit(job, self.path)
      except BaseException:  # an interrupt as it is handed over
        _close_job(job)
        raise


def _close_job(job: list[int]) -> bool:
  """Closes the descriptor in ``job`` unless another took it first; whether it did."""
  try:
    fd = job.pop()
  except IndexError:
    return False
  os.close(fd)
  return True


def json_bytes(obj: Any) -> bytes:
  """``obj`` as the compact JSON bytes jaxreshard writes."""
  # json.dumps, not json.dump: only the former uses the C encoder.
  return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def write_array(directory: OutDir | str, name: str, data: np.ndarray, chunk: int) -> list[int]:
  """Writes ``data`` (1-D, non-empty) as the zarr array ``directory/name``.

  ``directory`` is a held :class:`OutDir` (or a path, held for this call); the
  array's files and subdirectories are fsync'ed when it is durable.

  Returns:
    The crc32c of every chunk, for the archive's metadata.
  """
  check_byte_order()
  if not isinstance(directory, OutDir):
    with OutDir.open(directory) as held:
      return write_array(held, name, data, chunk)
  data = np.ascontiguousarray(data).reshape(-1)
  size, itemsize = data.size, data.dtype.itemsize
  with directory.mkdir(name) as adir:
    adir.write_json(META_FILE, zarr_metadata(size, data.dtype, chunk))
    with adir.mkdir(SHARD_KEY[0]) as cdir:
      raw = memoryview(data.view(np.uint8))
      job = [cdir.create(SHARD_KEY[1])]
      try:
        try:
          crcs = _write_chunks(job[0], raw, size, itemsize, chunk)
        except OSError as e:  # a full disk or a quota: say which file
          raise OSError(e.errno, e.strerror, os.path.join(cdir.path, SHARD_KEY[1])) from None
        cdir.finish(job, SHARD_KEY[1])
      except BaseException:  # an error, or an interrupt up to the hand-over: the file is
        _close_job(job)  # removed with its directory, and a descriptor left open would
        raise  # keep its blocks until the process ends
      cdir.sync()
    adir.sync()
  return crcs


def _write_chunks(fd: int, raw: memoryview, size: int, itemsize: int, chunk: int) -> list[int]:
  """Writes every chunk, its crc32c and the shard index; returns the chunks' crc32c."""
  cb = chunk * itemsize
  n = n_chunks(size, chunk)
  tail = bytes(n * cb - size * itemsize)  # zero padding of the last chunk
  data = np.frombuffer(raw, np.uint8)
  parts = [data[i * cb : (i + 1) * cb] for i in range(n)]
  value = google_crc32c.value
  crcs = [value(p) for p in parts]
  if tail:
    crcs[-1] = google_crc32c.extend(crcs[-1], tail)
    parts[-1] = np.concatenate([parts[-1], np.frombuffer(tail, np.uint8)])
  stored = np.array(crcs, "<u4").view(np.uint8).reshape(n, CRC_BYTES)
  offsets = np.arange(n, dtype="<u8") * (cb + CRC_BYTES)
  index = np.stack([offsets, np.full(n, cb + CRC_BYTES, "<u8")], axis=1)
  index_bytes = index.tobytes()
  per_call = _IOV_MAX // 2
  for lo in range(0, n, per_call):
    iov = [x for i in range(lo, min(n, lo + per_call)) for x in (parts[i], stored[i])]
    if lo + per_call >= n:
      iov += [index_bytes, _crc(index_bytes).to_bytes(4, "little")]
    _writev(fd, iov)
  return crcs


def _writev(fd: int, iov: list) -> None:
  total = sum(len(b) for b in iov)
  done = os.writev(fd, iov)
  while done < total:  # a short write: finish the rest
    rest, skip = [], done
    for b in iov:
      b = memoryview(b)
      if skip >= len(b):
        skip -= len(b)
        continue
      rest.append(b[skip:])
      skip = 0
    iov, total = rest, total - done
    done = os.writev(fd, iov)

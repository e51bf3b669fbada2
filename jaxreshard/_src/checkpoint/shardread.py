"""Reading a flat buffer on disk (``shardfile``'s format), trusting nothing.

Files are opened below a directory descriptor of the checkpoint without
following symbolic links and must be regular files, the metadata must be
exactly what ``shardfile`` writes, the file must have exactly the size that
metadata implies, the index must be the one ``shardfile`` writes, and every
chunk read is checked against its own crc32c and against the crc32c the
archive's metadata recorded for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import shlex
import stat
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.checkpoint.shardfile import (
  CRC_BYTES,
  INDEX_ENTRY_BYTES,
  MAX_META_BYTES,
  META_FILE,
  SHARD_KEY,
  _crc,
  _normalized,
  check_byte_order,
  file_size,
  n_chunks,
  zarr_metadata,
)
from jaxreshard._src.core import workers as _workers
from jaxreshard._src.errors import ArchiveError
from jaxreshard._src.exec import bitview as _bitview

# Threads that ask the kernel for files before they are read (``warm``).
WARM_THREADS = 8
# Byte ranges of a file closer than this are asked for as one (``hint_ranges``):
# a gap under a page is read with the pages around it anyway. A wider gap is
# not asked for: at 4,096 -> 3,072 ranks one target rank's runs lie in one
# chunk of every few of each archive, and merging gaps of up to 128 KiB had the
# disk read 474 MiB where the rank reads 207 MiB of chunks (246 MiB with gaps
# of a page, and a restore from the disk about a fifth faster).
HINT_GAP_BYTES = 1 << 12

# ``(path components below the root, byte ranges)``: a range is ``(offset,
# length)``, a negative offset counts from the end of the file and a length of 0
# runs to it.
FileHint = tuple[tuple[str, ...], list[tuple[int, int]]]


def warm(
  root: Dir, files: Sequence[FileHint], stop: threading.Event | None = None
) -> list[concurrent.futures.Future]:
  """Asks the kernel to bring byte ranges of files below ``root`` into the page
  cache, on ``WARM_THREADS`` threads, without waiting for them.

  On a cold cache every file costs a few synchronous reads (its directories,
  its bytes), and asking the kernel for a range can itself wait on the disk;
  asked for on several threads, they are under way at once, and the checked
  reads that follow, in the same order, find them in memory. Only a hint:
  nothing is read into this process, and a path that is not a regular file
  reached without symbolic links is skipped.

  Args:
    root: the directory the paths are below.
    files: what to ask for, in the order it is read.
    stop: once set, the files not yet asked for are left (the read is over).

  Returns:
    The tasks (callers need not wait for them).
  """
  if root.fd < 0 or not files or not hasattr(os, "posix_fadvise"):
    return []
  pool = _workers.pool("warm", WARM_THREADS)
  # Each task holds its own descriptor of the root: closing ``root`` meanwhile
  # can never send an open to another directory. Files are dealt round-robin,
  # so the threads go through them in the order given.
  return [
    pool.submit(_warm, os.dup(root.fd), files[k::WARM_THREADS], stop)
    for k in range(min(WARM_THREADS, len(files)))
  ]


def hint_ranges(starts: np.ndarray, stops: np.ndarray) -> list[tuple[int, int]]:
  """Byte ranges ``[starts, stops)`` as ``(offset, length)``, sorted, those closer
  than ``HINT_GAP_BYTES`` merged."""
  if not len(starts):
    return []
  order = np.argsort(starts, kind="stable")
  starts, stops = starts[order], np.maximum.accumulate(stops[order])
  new = np.concatenate([[True], starts[1:] - stops[:-1] > HINT_GAP_BYTES])
  first = np.flatnonzero(new)
  last = np.append(first[1:], len(starts)) - 1
  a, b = starts[first], stops[last]
  return list(zip(a.tolist(), (b - a).tolist()))


def _warm(root_fd: int, files: Sequence[FileHint], stop: threading.Event | None) -> None:
  try:
    for parts, ranges in files:
      if stop is not None and stop.is_set():
        return
      fds: list[int] = []
      try:
        at = root_fd
        for name in parts[:-1]:
          at = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
          fds.append(at)
        st = os.stat(parts[-1], dir_fd=at, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
          continue
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fds.append(os.open(parts[-1], flags, dir_fd=at))
        for offset, length in ranges:
          start = max(0, st.st_size + offset) if offset < 0 else offset
          os.posix_fadvise(fds[-1], start, length, os.POSIX_FADV_WILLNEED)
      except OSError:
        continue  # a hint only: the checked read reports what is wrong
      finally:
        for fd in fds:
          os.close(fd)
  finally:
    os.close(root_fd)


@dataclasses.dataclass
class ReadStats:
  """What ``ArchiveReader.read_runs`` read from buffer files: a counter the caller owns.

  Attributes:
    reads: read calls (one per span of consecutive chunks).
    chunks: chunks read, each with its crc32c.
    bytes: bytes read from the shard files (chunk data and checksums).
  """

  reads: int = 0
  chunks: int = 0
  bytes: int = 0


__all__ = ["Dir", "ReadStats", "ShardFile"]


class _Owned:
  """An object that owns the descriptor ``fd`` (-1 once closed) and closes it once."""

  fd: int

  def close(self) -> None:
    # The number is given up before it is closed: an interrupt between the two never
    # leaves it to be closed again (by ``__del__``), when another file may have it.
    fd, self.fd = getattr(self, "fd", -1), -1
    if fd >= 0:
      os.close(fd)

  def __del__(self):
    # An interrupt (Ctrl-C) that lands in a ``with`` block's exit, or between an open
    # and its owner's hold, drops the object unclosed: its descriptor goes with it.
    try:
      self.close()
    except Exception:  # noqa: BLE001 - a finalizer reports nothing
      pass


def _unfinished_saves(path: str) -> str:
  """Words on the temporary siblings that saves to ``path`` left, or ''."""
  parent, base = os.path.split(os.path.normpath(path))
  stem = _tempname.temp_stem(base)
  try:
    left = sorted(
      n
      for n in os.listdir(parent or ".")
      if (m := _tempname.TEMP_NAME.match(n)) and m["name"] == stem
    )
  except (OSError, ValueError):
    return ""
  if not left:
    return ""
  more = f" and {len(left) - 1} more" if len(left) > 1 else ""
  return (
    f" ({left[0]}{more}: the temporary directory of a save to it that has not finished;"
    f" `jaxreshard clean {shlex.quote(parent or '.')}` removes those of killed saves)"
  )


class Dir(_Owned):
  """A directory of the checkpoint, open as a descriptor; names never leave it.

  Every open goes through ``openat`` with ``O_NOFOLLOW``: a symbolic link
  anywhere below the checkpoint root is refused, and so is anything that is
  not a directory (for :meth:`dir`) or a regular file (for :meth:`file`).
  """

  def __init__(self, fd: int, path: str):
    self.fd, self.path = fd, path

  @classmethod
  def root(cls, path: str) -> Dir:
    """Opens the checkpoint directory itself (a user's path may be a link)."""
    try:
      fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
      raise FileNotFoundError(
        f"checkpoint directory {path} does not exist{_unfinished_saves(path)}"
      ) from None
    except NotADirectoryError:
      raise ArchiveError(f"{path} is not a directory, so not a jaxreshard checkpoint") from None
    try:
      return cls(fd, path)
    except BaseException:  # an interrupt before the object holds it
      os.close(fd)
      raise

  def __enter__(self) -> Dir:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _open(self, name: str, flags: int, what: str) -> int:
    if self.fd < 0:
      raise ArchiveError(
        f"{os.path.join(self.path, name)}: the checkpoint was closed; open it again to read it"
      )
    try:
      return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
    except OSError as e:
      raise self._refused(name, e, what) from None

  def _refused(self, name: str, e: OSError, what: str) -> Exception:
    """The refusal of an entry ``name`` that ``os.open`` would not open (its path is
    joined only here: opens that succeed never need it)."""
    path = os.path.join(self.path, name)
    link = ArchiveError(
      f"{path} is a symbolic link; every {what} of a checkpoint must lie inside it as a"
      " regular entry"
    )
    if isinstance(e, FileNotFoundError):
      return ArchiveError(self._removed(name) or f"{path} is missing")
    if isinstance(e, NotADirectoryError):  # O_DIRECTORY on a link fails with ENOTDIR, not ELOOP
      return link if self._is_link(name) else ArchiveError(f"{path} is not a directory")
    if e.errno == errno.ELOOP:
      return link
    if e.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket or a device
      return ArchiveError(f"{path} is not a regular file")
    return OSError(e.errno, e.strerror, path)

  def _removed(self, name: str) -> str:
    """The refusal of a missing entry ``name`` when this directory itself was removed
    after it was opened (the checkpoint deleted, or replaced by another at its path,
    since); '' when it is still in place (the entry itself is missing)."""
    try:
      held = os.fstat(self.fd)
    except OSError:
      return ""
    if held.st_nlink != 0:  # still linked: in place, or moved (read where it went)
      return ""
    try:
      now = os.stat(self.path)
      replaced = (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
    except OSError:
      replaced = False
    return (
      f"{self.path} changed since the checkpoint was opened: that directory was removed"
      f"{' and another is at its path now' if replaced else ''}, so its {name} cannot be"
      " read; open the checkpoint again to read what is there now"
    )

  def _is_link(self, name: str) -> bool:
    try:
      return stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
    except OSError:
      return False

  def dir(self, name: str) -> Dir:
    path = os.path.join(self.path, name)
    fd = self._open(name, os.O_RDONLY | os.O_DIRECTORY, "directory")
    try:
      return Dir(fd, path)
    except BaseException:  # an interrupt before the object holds it
      os.close(fd)
      raise

  def exists(self, name: str) -> bool:
    try:
      os.stat(name, dir_fd=self.fd, follow_symlinks=False)
      return True
    except FileNotFoundError:
      return False

  def file(self, name: str) -> tuple[int, os.stat_result]:
    """Opens a regular file for reading; returns the descriptor and its stat."""
    # Never open what is not a regular file (a device node may act when opened); a
    # link is refused by the open itself, with its own message.
    if self.fd >= 0:
      try:
        mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
      except OSError:
        mode = None  # the open says why
      if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise ArchiveError(f"{os.path.join(self.path, name)} is not a regular file")
    # O_NONBLOCK: a FIFO put there after the check must not make the open wait.
    fd = self._open(name, os.O_RDONLY | os.O_NONBLOCK, "file")
    try:
      st = os.fstat(fd)
      if not stat.S_ISREG(st.st_mode):
        raise ArchiveError(f"{os.path.join(self.path, name)} is not a regular file")
    except BaseException:  # refused, or an interrupt: the caller never holds it
      os.close(fd)
      raise
    return fd, st

  def read_bytes(self, name: str, max_bytes: int) -> bytes:
    """A small file's bytes, refused beyond ``max_bytes``."""
    fd, st = self.file(name)
    try:
      path = os.path.join(self.path, name)
      if st.st_size > max_bytes:
        raise ArchiveError(
          f"{path} has {st.st_size} bytes, more than its metadata can have ({max_bytes})"
        )
      data = os.pread(fd, min(st.st_size, max_bytes) + 1, 0)
    finally:
      os.close(fd)
    if len(data) > st.st_size:
      raise ArchiveError(f"{path} grew while it was read")
    return data

  def read_json(self, name: str, max_bytes: int) -> Any:
    """A small JSON file, refused beyond ``max_bytes``; strict parsing."""
    data = self.read_bytes(name, max_bytes)
    path = os.path.join(self.path, name)
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError:
      raise ArchiveError(f"{path} is not UTF-8 JSON") from None
    from jaxreshard._src.checkpoint.encoding import loads  # pylint: disable=g-import-not-at-top

    return loads(text, path)


class ShardFile(_Owned):
  """An open buffer file, checked against the metadata that describes it.

  Attributes:
    size: elements; dtype; chunk: elements per chunk; crcs: the crc32c of
    every chunk as the archive's metadata recorded them.
  """

  def __init__(
    self,
    parent: Dir,
    name: str,
    size: int,
    dtype: np.dtype,
    chunk: int,
    crcs: Sequence[int],
    label: str = "",
  ):
    check_byte_order()
    self.size, self.dtype, self.chunk = size, np.dtype(dtype), chunk
    self.crcs = list(crcs)
    self.crc_table = np.asarray(self.crcs, np.int64)  # the same, for whole-span comparisons
    # Messages name what the file is (``label``, e.g. "archive 3") and its path.
    self.path = (f"{label} " if label else "") + os.path.join(parent.path, name)
    self.n = n_chunks(size, chunk)
    self.chunk_bytes = chunk * self.dtype.itemsize
    self.stride = self.chunk_bytes + CRC_BYTES
    if len(self.crcs) != self.n:
      raise ArchiveError(
        f"{self.path}: the archive records {len(self.crcs)} chunk checksums for {self.n} chunks"
      )
    with parent.dir(name) as d:
      meta = _normalized(d.read_json(META_FILE, MAX_META_BYTES))
      if meta != zarr_metadata(size, self.dtype, chunk):
        raise ArchiveError(
          f"{self.path}/{META_FILE} does not describe {self.dtype.name}[{size}] in chunks of"
          f" {chunk} as jaxreshard writes it (codecs, key encoding and chunking must match)"
        )
      with d.dir(SHARD_KEY[0]) as c:
        self.fd, st = c.file(SHARD_KEY[1])
    # From here ``self.fd`` is this object's: an interrupt in the exits of the ``with``
    # blocks above drops the object, and ``__del__`` closes it.
    try:  # a refused file is closed here: its caller never holds it
      expected = file_size(size, self.dtype.itemsize, chunk)
      if st.st_size != expected:
        raise ArchiveError(
          f"{self.path}/c/0 has {st.st_size} bytes but its metadata ({self.dtype.name}[{size}],"
          f" chunks of {chunk}) needs {expected}; the file is truncated or not from this"
          " checkpoint"
        )
      self._check_index()
    except BaseException:
      self.close()
      raise

  def chunk_ranges(self, src: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """The byte ranges of the chunks that hold elements ``[src, src + length)``
    (with their checksums), for ``warm``."""
    src, length = np.asarray(src, np.int64), np.asarray(length, np.int64)
    keep = length > 0
    src, length = src[keep], length[keep]
    first, last = src // self.chunk, (src + length - 1) // self.chunk
    return hint_ranges(first * self.stride, (last + 1) * self.stride)

  def cached(self, element: int) -> bool:
    """Whether the chunk holding ``element`` is in the page cache, as far as the
    kernel says without waiting (``RWF_NOWAIT``); True where it cannot tell. A
    look that misses may start reading the chunk in."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not hasattr(os, "preadv"):
      return True
    try:
      os.preadv(self.fd, [bytearray(1)], element // self.chunk * self.stride, flag)
    except BlockingIOError:
      return False
    except OSError:  # not supported here: assume cached (read as before)
      return True
    return True

  def _pread(self, n: int, offset: int) -> bytes:
    try:
      data = os.pread(self.fd, n, offset)
    except OSError as e:
      raise OSError(e.errno, e.strerror, f"{self.path}/c/0") from None
    if len(data) != n:
      raise ArchiveError(f"{self.path}/c/0 ended early (truncated while read)")
    return data

  def _check_index(self) -> None:
    nbytes = self.n * INDEX_ENTRY_BYTES
    raw = self._pread(nbytes + CRC_BYTES, self.n * self.stride)
    if _crc(raw[:nbytes]) != int.from_bytes(raw[nbytes:], "little"):
      raise ArchiveError(f"{self.path}/c/0: the shard index fails its crc32c (corrupted)")
    # Each chunk's offset and length, as jaxreshard writes them: back to back, whole.
    index = np.frombuffer(raw, "<u8", count=2 * self.n)
    stride = np.uint64(self.stride)
    if not (
      (index[1::2] == stride).all()
      and (index[0::2] == np.arange(self.n, dtype=np.uint64) * stride).all()
    ):
      raise ArchiveError(
        f"{self.path}/c/0: the shard index does not lay chunks out as jaxreshard writes them"
      )

  def _verify(self, first: int, views: Sequence[memoryview], crcs: Sequence[bytes]) -> None:
    for k, (data, stored) in enumerate(zip(views, crcs)):
      i = first + k
      actual = _crc(data)
      if actual != int.from_bytes(stored, "little") or actual != self.crcs[i]:
        raise self.bad_chunk(i)

  def bad_chunk(self, chunk: int) -> ArchiveError:
    """The refusal of a chunk whose bytes or stored checksum are not the recorded ones."""
    return ArchiveError(
      f"{self.path}/c/0: chunk {chunk} fails its crc32c check (the file is corrupted or not"
      " the one this archive's metadata describes)"
    )

  def read_chunks(self, first: int, count: int, into: np.ndarray) -> np.ndarray:
    """Reads chunks ``[first, first + count)`` into ``into`` (uint8, reused scratch).

    Returns:
      A ``(count, chunk)`` unsigned-integer view of the chunks' elements, every
      chunk checked against its crc32c first.
    """
    span = memoryview(into)[: count * self.stride]
    try:
      got = os.preadv(self.fd, [span], first * self.stride)
    except OSError as e:
      raise OSError(e.errno, e.strerror, f"{self.path}/c/0") from None
    if got != len(span):
      raise ArchiveError(f"{self.path}/c/0 ended early (truncated while read)")
    rows = into[: count * self.stride].reshape(count, self.stride)
    self._verify(
      first,
      [memoryview(r[: self.chunk_bytes]) for r in rows],
      [bytes(r[self.chunk_bytes :]) for r in rows],
    )
    return rows[:, : self.chunk_bytes].view(_bitview.UINT[self.dtype.itemsize])

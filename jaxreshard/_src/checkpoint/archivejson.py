"""An archive's ``archive.json``: read, its checksum verified, checked against the index.

Every ``archive.json`` is untrusted (see ``reader``): a signed file is parsed
only once its checksum holds, and its value is used only once it is shown to
belong to this checkpoint and to say what the index says of its archive.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.checkpoint.index import (
  ARCHIVE_FILE,
  FORMAT,
  MAX_ARCHIVE_BYTES,
  READ_WORDS,
  Index,
)
from jaxreshard._src.errors import ArchiveError

__all__ = ["ArchiveMetas", "check_archive_meta", "signed_value"]


def signed_value(raw: bytes, where: str, what: str) -> dict:
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
      f"{where}: checkpoint format version 1 is not supported; this jaxreshard reads"
      f" {READ_WORDS} (a version-1 checkpoint needs the jaxreshard that wrote it: load it"
      " there and save it again)"
    )
  if version == 2:
    raise ArchiveError(
      f"{where}: checkpoint format version 2 is not supported; this jaxreshard reads"
      f" {READ_WORDS}: version 2 has no checksum over its index and archive metadata, so"
      " an edited or damaged value could not be told apart (load it with the jaxreshard that"
      " wrote it and save it again)"
    )
  return fmt.verified_json(raw, where)  # refuses it: no checksum


_ARCHIVE_KEYS = frozenset(
  {"format", "format_version", "checkpoint", "archive", "describes", "buffers"}
)


class ArchiveMetas:
  """The checked ``archive.json`` of each archive of one opened checkpoint, each read once
  and kept for as long as this object (its ``ArchiveReader``) lives.

  Args:
    directory: the checkpoint's path (for messages).
    root: the checkpoint's root descriptor (``_shardread.Dir``).
    index: the parsed index.
  """

  def __init__(self, directory: str, root: Any, index: Index):
    self.directory, self.index, self._root = directory, index, root
    self._lock = threading.Lock()
    self._meta: dict[int, dict] = {}

  def has(self, archive: int) -> bool:
    """Whether the archive's ``archive.json`` was read and checked."""
    with self._lock:
      return archive in self._meta

  def get(self, archive: int) -> dict:
    """An archive's ``archive.json``, checked against the index (read once)."""
    with self._lock:
      meta = self._meta.get(archive)
    if meta is not None:
      return meta
    name = self.index.names[archive]
    where = f"archive {archive} ({self.directory}/{name})"
    try:
      with self._root.dir(name) as adir:
        raw = adir.read_bytes(ARCHIVE_FILE, MAX_ARCHIVE_BYTES)
        meta = signed_value(raw, f"{adir.path}/{ARCHIVE_FILE}", f"{FORMAT} archive")
    except ArchiveError as e:
      raise ArchiveError(f"archive {archive}: {e}") from None
    check_archive_meta(self.index, archive, meta, where)
    with self._lock:
      self._meta[archive] = meta
    return meta


def check_archive_meta(index: Index, archive: int, meta: dict, where: str) -> None:
  """An archive's ``archive.json`` belongs to this checkpoint and matches its index."""
  if meta.get("format") != FORMAT or set(meta) != _ARCHIVE_KEYS:
    raise ArchiveError(f"{where}: {ARCHIVE_FILE} does not describe a {FORMAT} archive")
  if type(meta["format_version"]) is not int or meta["format_version"] != index.version:
    raise ArchiveError(
      f"{where}: archive format version {fmt.short(meta['format_version'])} is not"
      f" supported; an archive of this checkpoint has its index's version {index.version}"
    )
  if meta["checkpoint"] != index.id:
    raise ArchiveError(
      f"{where} belongs to checkpoint {str(meta['checkpoint'])[:40]!r}, not to this"
      f" checkpoint {index.id!r}; archives of two different saves are never combined"
    )
  if meta["archive"] != index.names[archive]:
    raise ArchiveError(f"{where}: {ARCHIVE_FILE} names archive {str(meta['archive'])[:40]!r}")
  check_describes(index, meta["describes"], archive, where)
  layout = index.layouts[index.archive_layout[archive]]
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
    # Exactly ints (a bool is not a checksum), each in [0, 2**32): one check per chunk,
    # so it runs in C (``map``, ``min``, ``max``), not in a Python loop.
    if not (0 < chunk <= max(n, 1)) or (
      crcs and not (set(map(type, crcs)) == {int} and min(crcs) >= 0 and max(crcs) < 2**32)
    ):
      raise ArchiveError(f"{bw}: invalid chunking or checksums")
    got[dname] = n
  if got != expected:
    raise ArchiveError(f"{where}: holds buffers {got} but its layout needs {expected}")


def check_describes(index: Index, got: Any, archive: int, where: str) -> None:
  """An archive's data belongs to the index's layout, clock and ranks for it: its
  signed ``archive.json`` records their digests when it is written."""
  want = index.describes(archive)
  if not isinstance(got, dict) or set(got) != set(want):
    raise ArchiveError(f"{where}: {ARCHIVE_FILE} has no valid 'describes' entry")
  for key, words in (
    ("placements", "which params it holds at which rank"),
    ("layout", "its state layout"),
    ("clock", "its optimizer clock"),
  ):
    if got[key] != want[key]:
      raise ArchiveError(
        f"{where}: the index does not describe this archive as it was written"
        f" (the index and its {ARCHIVE_FILE} disagree on {words}); the index was edited or"
        " belongs to other archives"
      )

"""Helpers of the archive tests: file hashes, bytes on disk, where a buffer's file lies,
and the signed JSON of a checkpoint's index and ``archive.json`` (read and re-signed
here independently of the library, so that a test's edit reaches the rule it tests)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from unittest import mock

_PREFIX = b'{"checksum":"sha256:'


@contextlib.contextmanager
def padding_unchecked():
  """Saves inside skip the writer's refusal of nonzero padding: how a checkpoint whose
  padding is not zero reaches a disk (another writer, or bits changed after a save),
  for the tests of what its readers refuse."""
  from jaxreshard._src.checkpoint import historycheck  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.core import assembly  # pylint: disable=g-import-not-at-top

  with (
    mock.patch.object(historycheck, "_check_padding", lambda *args: None),
    mock.patch.object(assembly.Assembly, "nonzero_padding", lambda *args: None),
  ):
    yield


@contextlib.contextmanager
def set_unchecked():
  """Saves inside skip the refusal of archives that are not one restorable set (ranks
  missing, clocks, structures or dtypes that differ): how such a checkpoint reaches a
  disk (another writer, archives copied together by hand), for the tests of what its
  readers refuse."""
  from jaxreshard._src.checkpoint import store  # pylint: disable=g-import-not-at-top

  with mock.patch.object(store, "check_restorable", lambda *args: None):
    yield


def write_signed_json(path, obj: dict) -> None:
  """Writes ``obj`` as a signed JSON file: its compact ASCII body, with the sha256 of
  that body as the first member ``"checksum":"sha256:<hex>"``."""
  body = json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")
  assert body.startswith(b"{") and body != b"{}" and "checksum" not in obj
  data = _PREFIX + hashlib.sha256(body).hexdigest().encode("ascii") + b'",' + body[1:]
  with open(path, "wb") as f:
    f.write(data)


def read_json(path) -> dict:
  """A JSON file's value; a signed one's checksum must match and is left out."""
  with open(path, "rb") as f:
    data = f.read()
  value = json.loads(data)
  if data.startswith(_PREFIX):
    head = len(_PREFIX) + 64 + 2
    assert data[head - 2 : head] == b'",', path
    assert "sha256:" + hashlib.sha256(b"{" + data[head:]).hexdigest() == value.pop("checksum"), path
  return value


def file_hashes(directory: str) -> dict[str, str]:
  """Every file (relative path -> sha256) and directory under ``directory``."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), directory) + "/"] = "dir"
    for f in files:
      path = os.path.join(root, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def dir_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)


def buffer_file(directory: str, archive: int = 0) -> str:
  """The shard file of the first history buffer of one archive."""
  adir = os.path.join(directory, f"archive_{archive:05d}")
  name = sorted(n for n in os.listdir(adir) if n.startswith("b"))[0]
  return os.path.join(adir, name, "c", "0")


def shard_file(directory: str, archive: int = 0, dtype: str = "float32") -> str:
  """The shard file (``c/0``) of one archive's packed buffer of ``dtype``."""
  return os.path.join(directory, f"archive_{archive:05d}", dtype, "c", "0")


def _canonical(obj) -> bytes:
  return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("ascii")


def describes(index: dict) -> list[dict]:
  """What each archive.json must record of the index, computed from the format's own
  words: the sha256 of the canonical JSON (compact, keys sorted) of the archive's
  layout entry and of its clock entry, and of its placements: per (world_size,
  rank) it holds, the sum mod 2**128 of a term per param (the first 16 bytes,
  little-endian, of the sha256 of the compact JSON of ``[id, shape, dtype,
  trainable]``), as sorted ``[world_size, rank, "<32 hex digits>"]`` entries."""
  buckets = [{} for _ in index["archives"]]
  for g in index["groups"]:
    for a, r in g["ranks"]:
      for p in g["params"]:
        term = int.from_bytes(
          hashlib.sha256(
            json.dumps(index["params"][p], separators=(",", ":")).encode("ascii")
          ).digest()[:16],
          "little",
        )
        key = (g["world_size"], r)
        buckets[a][key] = buckets[a].get(key, 0) + term
  out = []
  for (_, layout, clock), b in zip(index["archives"], buckets):
    placements = sorted([w, r, f"{t % (1 << 128):032x}"] for (w, r), t in b.items())
    out.append(
      {
        k: hashlib.sha256(_canonical(v)).hexdigest()
        for k, v in (
          ("layout", index["layouts"][layout]),
          ("clock", index["clocks"][clock]),
          ("placements", placements),
        )
      }
    )
  return out


def write_consistent_index(root, index: dict) -> None:
  """Writes ``index`` as the checkpoint's (signed) index and re-signs every
  archive.json to agree with it: an edit made consistently across the files,
  which reaches the checks behind the signatures and digests."""
  write_signed_json(os.path.join(root, "jaxreshard.json"), index)
  for (name, _, _), d in zip(index["archives"], describes(index)):
    path = os.path.join(root, name, "archive.json")
    meta = read_json(path)
    meta["describes"] = d
    write_signed_json(path, meta)


def files_of(root) -> dict[str, bytes]:
  """Every file under ``root``, by path relative to it: its bytes."""
  out = {}
  for dirpath, _, names in os.walk(root):
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def assert_same_files(a, b) -> None:
  """Two directories hold the same files, byte for byte."""
  fa, fb = files_of(a), files_of(b)
  assert sorted(fa) == sorted(fb)
  for rel in fa:
    assert fa[rel] == fb[rel], rel


def spy_leaf_by_leaf(monkeypatch) -> list:
  """The archives a save registers leaf by leaf (the writer's ``_add_record``), in order."""
  from jaxreshard._src.checkpoint import writer  # pylint: disable=g-import-not-at-top

  calls = []
  add = writer.IndexBuilder._add_record
  monkeypatch.setattr(
    writer.IndexBuilder, "_add_record", lambda self, *a: calls.append(a[0]) or add(self, *a)
  )
  return calls


@contextlib.contextmanager
def zero_file_reading_a_directory(directory):
  """An open shard file ``b`` of 64 zero float32 elements in chunks of 8, written in
  ``directory``, whose descriptor then reads ``directory`` itself: every read of it
  fails with EISDIR, as a read that fails in the kernel does. Closed on leaving."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.checkpoint import shardfile, shardread  # pylint: disable=g-import-not-at-top

  crcs = shardfile.write_array(str(directory), "b", np.zeros(64, np.float32), 8)
  root = shardread.Dir.root(str(directory))
  f = shardread.ShardFile(root, "b", 64, np.float32, 8, crcs)
  d = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
  os.dup2(d, f.fd)
  os.close(d)
  try:
    yield f
  finally:
    f.close()
    root.close()

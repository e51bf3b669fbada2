"""Helpers of the archive tests: file hashes, bytes on disk, where a buffer's file lies."""

from __future__ import annotations

import hashlib
import os


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

"""Checkpoints on disk for the restore, CLI and RSS benchmarks (jaxreshard and orbax)."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

import jaxreshard as jr
from benchmarks import _workload

__all__ = [
  "write_jaxreshard",
  "write_orbax_plain",
  "history_tree",
  "flat_tree",
  "dir_bytes",
  "durable_copy",
  "rmtree",
]


def write_jaxreshard(path: str, history: int, n_params: int, world: int, seed: int) -> list:
  """Saves an Adam checkpoint of ``world`` archives with ``jr.save_records``; returns them."""
  records = _workload.adam_records(history, n_params, world, seed, as_numpy=True)
  jr.save_records(path, records)
  return records


def history_tree(records) -> dict:
  """``{"r<rank>": {"mu"|"nu": {param: array}}}``: the history buffers as a plain pytree."""
  out = {}
  for i, rec in enumerate(records):
    adam = rec.state[0]
    out[f"r{i:05d}"] = {"mu": flat_tree(adam.mu), "nu": flat_tree(adam.nu)}
  return out


def flat_tree(tree: dict) -> dict:
  """``{layer: {name: x}}`` as ``{"layer.name": numpy x}`` (orbax's key rules)."""
  return {f"{a}.{b}": np.asarray(x) for a, sub in tree.items() for b, x in sub.items()}


def write_orbax_plain(path: str, tree: dict) -> None:
  """Saves a pytree of numpy arrays with orbax's standard checkpointer."""
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), tree)


def restore_orbax_plain(path: str) -> dict:
  """Restores a ``write_orbax_plain`` checkpoint as numpy arrays."""
  import jax
  import orbax.checkpoint as ocp

  path = os.path.abspath(path)
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)
  tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  args = jax.tree.map(
    lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree.tree if hasattr(tree, "tree") else tree
  )
  return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def dir_bytes(path: str) -> int:
  """Bytes of every file under ``path``."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def durable_copy(src: str, dst: str) -> None:
  """Copies the tree at ``src`` to a new ``dst`` as a durable save writes it: every
  file read whole, written to a new file and fsynced, every directory fsynced after
  its entries (``dst``'s parent last). The floor of any command that reads a
  checkpoint's files and writes as many files again: it costs per file as well as
  per byte."""
  for root, _, files in os.walk(src):
    out = os.path.normpath(os.path.join(dst, os.path.relpath(root, src)))
    os.mkdir(out)
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        data = f.read()
      fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      try:
        os.write(fd, data)
        os.fsync(fd)
      finally:
        os.close(fd)
  for root, _, _ in os.walk(dst, topdown=False):
    fd = os.open(root, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  fd = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def rmtree(path: str) -> None:
  shutil.rmtree(path, ignore_errors=True)


def drop_cache(path: str) -> bool:
  """Drops every file below ``path`` from the page cache (``POSIX_FADV_DONTNEED``: any
  user may drop the clean pages of a file it can open), so that the next read comes
  from the disk; whether it took (the largest file's first page is no longer cached,
  as ``RWF_NOWAIT`` tells; False where the file system keeps files in memory)."""
  if not hasattr(os, "posix_fadvise"):
    return False
  largest, size = None, -1
  for root, _, files in os.walk(path):
    for name in files:
      f = os.path.join(root, name)
      fd = os.open(f, os.O_RDONLY)
      try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if os.fstat(fd).st_size > size:
          largest, size = f, os.fstat(fd).st_size
      finally:
        os.close(fd)
  if largest is None or not hasattr(os, "RWF_NOWAIT"):
    return False
  fd = os.open(largest, os.O_RDONLY)
  try:
    # Pages under a read still in flight (the kernel's read-ahead, a hint) are not
    # dropped: drop again once it has landed, a few times.
    for _ in range(10):
      try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
      except BlockingIOError:
        return True
      except OSError:
        return False
      time.sleep(0.05)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return False
  finally:
    os.close(fd)

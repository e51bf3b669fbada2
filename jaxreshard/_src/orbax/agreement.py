"""What every process of a multi-process save agrees on before any archive is written.

The primary process makes the save's identity and writes the index from its own
state; every other process's archives must be those that index describes. So the
primary sends, with the identity, digests of its state's layout (the index its
state makes, clock aside) and of its optimizer clock, and every process compares
its own with them (``handler.prepare_save``) whether or not it writes an archive.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxreshard._src.core import clock as _clock
from jaxreshard._src.exec import bitview as _bitview

__all__ = [
  "clock_digest",
  "layout_digest",
  "records_digest",
  "save_layout_digest",
  "shared_checkpoint_id",
]


def shared_checkpoint_id(
  primary_host: int | None, clock: bytes = bytes(32), layout: bytes = bytes(32)
) -> tuple[str, bytes, bytes]:
  """One new identity for this save, the same in every process (the primary's), and the
  primary's ``clock`` and ``layout`` (32-byte digests of its optimizer clock and of
  its state's layout, ``clock_digest`` and ``layout_digest``)."""
  raw = np.frombuffer(uuid.uuid4().bytes + clock + layout, np.uint8).astype(np.int32)
  if jax.process_count() > 1:
    raw = np.asarray(
      ocp.multihost.broadcast_one_to_all(raw, is_source=ocp.multihost.is_primary_host(primary_host))
    )
  raw = bytes(raw.astype(np.uint8).tolist())
  return raw[:16].hex(), raw[16:48], raw[48:]


def layout_digest(checked: Any) -> bytes:
  """A digest of what this process's state makes of the checkpoint's index, clock
  aside (tree structure, params' shapes and dtypes, trainability, placements over
  the mesh axis): the primary writes the index from its own, so every process's
  must be the same, or its archives would not be those the index describes."""
  h = hashlib.sha256()
  h.update(json.dumps(checked.index, sort_keys=True, default=_json_default).encode())
  return h.digest()


def _json_default(x: Any) -> Any:
  """numpy values of an index (its tables) as JSON: dtype, shape and bytes."""
  if isinstance(x, np.ndarray | np.generic):
    a = np.asarray(x)
    return [a.dtype.str, list(a.shape), a.tobytes().hex()]
  raise TypeError(f"not in an index: {type(x).__name__}")


def clock_digest(checked: Any) -> bytes:
  """A digest of the optimizer clock of this process's state (every clock scalar's
  dtype, shape and bits), whether or not the process writes an archive: a process
  whose shards another process writes (a mesh axis besides the flat one spanning
  processes) still holds a clock, which must be the primary's. Zeros where the
  process holds no part of a clock leaf (nothing of it to compare)."""
  h = hashlib.sha256()
  for leaf, role in zip(checked.tree[1], checked.roles):
    if role is None:
      if isinstance(leaf, jax.Array):
        if not leaf.addressable_shards:
          return bytes(32)
        if leaf.is_fully_replicated or not leaf.is_fully_addressable:
          leaf = leaf.addressable_data(0)
      h.update(repr(_clock.scalar_bits(leaf)).encode())
  return h.digest()


def records_digest(records: Any) -> bytes:
  """A digest of every record a process passes to a save of records (its version,
  placements and roles, its state's tree structure and every leaf's dtype, shape,
  weak type and the crc32c of its bits): the primary writes the archives from its
  own records, so every process must pass the same, or the checkpoint would hold
  another state than the process asked to save."""
  h = hashlib.sha256()
  for record in records:
    leaves, treedef = jax.tree_util.tree_flatten(record.state)
    h.update(repr((record.version, record.placements, record.roles, treedef)).encode())
    for leaf in leaves:
      # A typed PRNG key (noisy_sgd's) by its implementation and key data.
      if _clock.is_key(leaf):
        h.update(str(jax.random.key_impl(leaf)).encode())
        leaf = jax.random.key_data(leaf)
      value = np.asarray(leaf)
      h.update(f"{value.dtype.name}{value.shape}{_clock.is_weak(leaf)}".encode())
      crc = google_crc32c.value(_bitview.bits(value).view(np.uint8))
      h.update(crc.to_bytes(4, "little"))
  return h.digest()


def save_layout_digest(args: Any, checked: Any) -> bytes:
  """What this process compares with the primary's before a save (``ReshardSave``
  ``args``, ``checked`` by it): its state's layout and its mesh; with records, in a multi-process
  save, the records themselves (the primary writes every archive from its own);
  zeros (nothing to compare) in one process."""
  if args.state is not None:
    # The mesh too: which process writes each rank follows from it, so two processes
    # given two meshes would both write some archives and none others.
    mesh = args.mesh
    where = (mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat], args.axis)
    return hashlib.sha256(layout_digest(checked) + repr(where).encode()).digest()
  if jax.process_count() > 1:
    return records_digest(args.records)
  return bytes(32)

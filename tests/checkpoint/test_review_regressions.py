"""Regressions found reviewing the direct disk read path (runread, pads, lazy index digests)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct

import google_crc32c
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import runread, shardfile, shardread
from tests._archive_util import read_json, shard_file, write_consistent_index, write_signed_json


def _open(tmp_path, data, chunk):
  crcs = shardfile.write_array(str(tmp_path), "b", data, chunk)
  root = shardread.Dir.root(str(tmp_path))
  return root, shardread.ShardFile(root, "b", data.size, data.dtype, chunk, crcs)


def test_only_empty_ranges_read_nothing(tmp_path):
  # Ranges that are all empty (no run to copy, zero ranges of no elements) read
  # no chunk; the direct path used to index an empty span list (IndexError).
  data = np.arange(1, 3, dtype=np.float16)
  root, f = _open(tmp_path, data, 2)
  stats = shardread.ReadStats()
  empty = np.zeros(0, np.int64)
  try:
    for at in (0, 1, 2):
      runread.read_runs(
        f,
        empty,
        empty,
        empty,
        np.zeros(0, np.float16),
        np.empty(0, np.uint8),
        stats,
        zero=(np.array([at]), np.array([0])),
        refuse=None,
      )
  finally:
    f.close()
    root.close()
  assert stats.reads == 0


# --- a chunk larger than the process can hold ---------------------------------------


def _huge_chunks(root, n, chunk):
  """A checkpoint whose one float32 buffer is re-signed as ``n`` elements in chunks of
  ``chunk`` (a chunk may be as large as the buffer): a sparse file with the right size
  and shard index, every chunk's checksum wrong (nothing may get that far)."""
  opt = optax.sgd(1e-3, momentum=0.9)
  params = {"w": jnp.zeros((8,), jnp.float32)}
  jr.save_records(root, jr.shard_state(opt, params, opt.init(params), 1))
  index = read_json(os.path.join(root, "jaxreshard.json"))
  index["params"][0][1] = [n]
  index["layouts"][0]["leaves"][0][2] = n
  meta_path = os.path.join(root, "archive_00000", "archive.json")
  meta = read_json(meta_path)
  count = -(-n // chunk)
  meta["buffers"]["float32"] = {"elements": n, "chunk": chunk, "crc32c": [0] * count}
  write_signed_json(meta_path, meta)
  write_consistent_index(root, index)
  with open(os.path.join(root, "archive_00000", "float32", "zarr.json"), "w") as f:
    json.dump(shardfile.zarr_metadata(n, np.dtype(np.float32), chunk), f)
  stride = chunk * 4 + 4
  entries = b"".join(struct.pack("<QQ", i * stride, stride) for i in range(count))
  with open(shard_file(root), "r+b") as f:
    f.truncate(0)
    f.truncate(count * stride)
    f.seek(count * stride)
    f.write(entries + struct.pack("<I", google_crc32c.value(entries)))


@contextlib.contextmanager
def _address_space_cap(headroom=3 << 30):
  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  cap = mapped + headroom
  if hard != resource.RLIM_INFINITY:
    cap = min(cap, hard)
  resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_chunk_too_large_to_stage_is_a_reshard_error(tmp_path):
  # The target rank (1 MiB) fits, but its runs lie in one chunk of 32 GiB that is read
  # whole to check its crc32c: the scratch buffer for it was allocated with np.empty,
  # so a MemoryError escaped instead of a ReshardError.
  root = str(tmp_path / "ck")
  _huge_chunks(root, 1 << 33, 1 << 33)
  with _address_space_cap():
    with pytest.raises(jr.ReshardError, match="memory"):
      jr.restore_ranks(root, [0], world_size=1 << 15)


def test_a_last_chunk_tail_too_large_is_a_reshard_error(tmp_path):
  # A whole-buffer read (2 GiB, allocated untouched) of two chunks of n - 1 elements:
  # the last chunk's tail past the buffer (2 GiB less 8 bytes) was a bytearray, and a
  # MemoryError escaped from load_records.
  root = str(tmp_path / "ck")
  _huge_chunks(root, 1 << 29, (1 << 29) - 1)
  with _address_space_cap():
    with pytest.raises(jr.ReshardError, match="memory"):
      jr.load_records(root)


def test_restore_ranks_refuses_a_checkpoint_opened_at_another_directory(tmp_path):
  """``checkpoint=`` is ``open_checkpoint(directory)``; one opened at another
  directory gave that checkpoint's bits under ``directory``'s name. The same
  directory named another way (a trailing slash, a symbolic link) is the same."""
  opt = optax.adam(1e-3)
  params = {"w": jnp.arange(4.0)}
  state = opt.init(params)
  p, q = tmp_path / "p", tmp_path / "q"
  for path, value in ((p, 1.0), (q, 2.0)):
    full = (state[0]._replace(mu={"w": jnp.full(4, value)}),) + state[1:]
    jr.save_records(path, jr.shard_state(opt, params, full, world_size=2))
  with pytest.raises(jr.ArchiveError, match="checkpoint= is the checkpoint opened at .*p, not"):
    jr.restore_ranks(q, [0], world_size=3, checkpoint=jr.open_checkpoint(p))
  os.symlink(q, tmp_path / "link")
  for name in (str(q) + "/", tmp_path / "link"):
    (got,) = jr.restore_ranks(name, [0], world_size=3, checkpoint=jr.open_checkpoint(q))
    assert np.asarray(got.state[0].mu["w"]).tolist() == [2.0, 2.0]

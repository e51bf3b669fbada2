"""Regressions found reviewing the direct disk read path (runread, pads, lazy index digests)."""

from __future__ import annotations

import numpy as np

from jaxreshard._src.checkpoint import runread, shardfile, shardread


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

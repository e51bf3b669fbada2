"""How a save cuts buffers into chunks: the default size, the cap on chunks per buffer,
and checkpoints of any chunk size reading back the same."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import shardfile
from tests._core_util import adam_records

SHAPES = {"w": ((300, 200), jnp.float32), "b": ((200,), jnp.float32)}


def _chunks(path, archive=0):
  with open(path / f"archive_{archive:05d}" / "archive.json") as f:
    meta = json.load(f)
  meta = meta.get("value", meta)
  return {d: (b["chunk"], len(b["crc32c"])) for d, b in meta["buffers"].items()}


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_the_default_chunk_is_16_kib(tmp_path):
  jr.save_records(tmp_path / "ck", adam_records(2, SHAPES))
  ((chunk, n),) = _chunks(tmp_path / "ck").values()
  assert chunk == (16 << 10) // 4 and n > 1


def test_chunks_per_buffer_are_capped(tmp_path, monkeypatch):
  assert shardfile.chunk_elements(10**12, 4, 16 << 10) == -(-(10**12) // shardfile.MAX_CHUNKS)
  assert shardfile.chunk_elements(100, 4, 16 << 10) == 100
  assert shardfile.chunk_elements(100, 4, 2) == 1
  monkeypatch.setattr(shardfile, "MAX_CHUNKS", 7)
  records = adam_records(2, SHAPES)
  jr.save_records(tmp_path / "ck", records, chunk_bytes=4)
  for chunk, n in _chunks(tmp_path / "ck").values():
    assert n <= 7 and chunk > 1
  loaded = jr.load_records(tmp_path / "ck")
  assert [_bits(r.state) for r in loaded] == [_bits(r.state) for r in records]


@pytest.mark.parametrize("chunk_bytes", [4, 1000, 16 << 10, 256 << 10])
def test_any_chunk_size_restores_the_same_bits(tmp_path, chunk_bytes):
  records = adam_records(4, SHAPES)
  jr.save_records(tmp_path / "ref", records, chunk_bytes=1 << 30)
  jr.save_records(tmp_path / "ck", records, chunk_bytes=chunk_bytes)
  for rank in range(3):
    want = jr.restore(tmp_path / "ref", world_size=3, rank=rank)
    got = jr.restore(tmp_path / "ck", world_size=3, rank=rank)
    assert _bits(got.state) == _bits(want.state)

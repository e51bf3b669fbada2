"""crc32c of consecutive chunks from each chunk's crc32c, against google_crc32c itself."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from jaxreshard._src.checkpoint import crcspan


def _bytes(rng, n):
  return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_combine_is_the_crc_of_the_concatenation():
  rng = np.random.default_rng(0)
  for _ in range(300):
    a, b = _bytes(rng, int(rng.integers(0, 400))), _bytes(rng, int(rng.integers(0, 400)))
    got = crcspan.combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    assert got == google_crc32c.value(a + b)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 255, 16384, 262144 + 7])
def test_shift_is_combining_with_zero_bytes_crc_removed(n):
  rng = np.random.default_rng(n)
  a, zeros = _bytes(rng, 100), bytes(n)
  want = google_crc32c.value(a + zeros) ^ google_crc32c.value(zeros)
  assert crcspan.shift(google_crc32c.value(a), n) == want


def test_a_short_last_chunk_combines():
  rng = np.random.default_rng(1)
  data = _bytes(rng, 10 * 64 + 17)
  crc = google_crc32c.value(data[:64])
  for i in range(64, len(data), 64):
    part = data[i : i + 64]
    crc = crcspan.combine(crc, google_crc32c.value(part), len(part))
  assert crc == google_crc32c.value(data)


@pytest.mark.parametrize("length", [1, 5, 64, 16384])
def test_run_crcs_are_the_crc_of_each_run(length):
  rng = np.random.default_rng(length)
  n = 300 if length < 16384 else 40
  data = _bytes(rng, n * length)
  crcs = [google_crc32c.value(data[i * length : (i + 1) * length]) for i in range(n)]
  # Runs of 1 .. 150 chunks, the first at 0, then random cuts.
  cuts = np.sort(rng.choice(np.arange(1, n), 12, replace=False))
  first = np.concatenate([[0], cuts, [n - 1]])
  first = np.unique(first)
  got = crcspan.run_crcs(crcs, first, length)
  ends = np.append(first[1:], n)
  want = [google_crc32c.value(data[a * length : b * length]) for a, b in zip(first, ends)]
  assert got.dtype == np.uint32 and got.tolist() == want


def test_run_crcs_of_no_runs():
  assert crcspan.run_crcs([], [], 8).tolist() == []


def test_a_changed_chunk_changes_its_run_crc():
  rng = np.random.default_rng(2)
  length, n = 32, 64
  data = bytearray(_bytes(rng, n * length))
  crcs = [google_crc32c.value(bytes(data[i * length : (i + 1) * length])) for i in range(n)]
  whole = int(crcspan.run_crcs(crcs, [0], length)[0])
  assert google_crc32c.value(bytes(data)) == whole
  for pos in rng.choice(n * length, 50, replace=False).tolist():
    bit = 1 << int(rng.integers(0, 8))
    data[pos] ^= bit
    assert google_crc32c.value(bytes(data)) != whole
    data[pos] ^= bit

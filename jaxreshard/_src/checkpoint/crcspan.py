"""The crc32c of consecutive chunks, from the crc32c of each chunk.

crc32c (Castagnoli, reflected, initial value and final xor ``0xFFFFFFFF``)
combines: ``crc(A + B) == shift(crc(A), len(B)) ^ crc(B)``, where
``shift(c, n)`` multiplies ``c`` by ``x**(8 * n)`` modulo the polynomial. That
map is linear over GF(2): a 32x32 bit matrix, applied with four 256-entry
tables (one per byte of ``c``). Chunks of one file all have the same length,
so the crc32c of every run of consecutive chunks follows from theirs with a
segmented prefix scan whose step ``2**j`` applies ``shift`` by ``2**j`` chunks.

A reader can then check a run of chunks with one crc32c call over their bytes
against the combination of their recorded checksums. A corruption confined to
one chunk changes the run's crc32c exactly when it changes that chunk's
(``x**k`` is invertible modulo the polynomial), and crc32c detects every
error of at most three bits in runs of up to 2**31 bits; errors in several
chunks that cancel out are as unlikely (2**-32) as ones a chunk's crc32c
misses.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["combine", "run_crcs", "shift"]

_POLY = 0x82F63B78  # crc32c, reflected
_X8 = 1 << 23  # x**8, reflected (bit 31 is x**0)


def _mul(a: int, b: int) -> int:
  """``a * b`` modulo the polynomial (both reflected)."""
  out, m = 0, 1 << 31
  while m:
    if a & m:
      out ^= b
    b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    m >>= 1
  return out


@functools.lru_cache(maxsize=256)
def _x_pow(nbytes: int) -> int:
  """``x**(8 * nbytes)`` modulo the polynomial."""
  out, sq, n = 1 << 31, _X8, nbytes
  while n:
    if n & 1:
      out = _mul(out, sq)
    sq, n = _mul(sq, sq), n >> 1
  return out


def shift(crc: int, nbytes: int) -> int:
  """``crc`` moved past ``nbytes`` more bytes (``combine(crc, 0, nbytes)``)."""
  return _mul(_x_pow(nbytes), crc)


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
  """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
  return shift(crc_a, len_b) ^ crc_b


@functools.lru_cache(maxsize=64)
def _tables(nbytes: int) -> np.ndarray:
  """``(4, 256)`` uint32: ``shift`` by ``nbytes`` of each byte value at each byte place."""
  p = _x_pow(nbytes)
  cols = np.array([_mul(p, 1 << i) for i in range(32)], np.uint32).reshape(4, 8)
  v = np.arange(256)
  out = np.zeros((4, 256), np.uint32)
  for bit in range(8):
    out ^= np.where(((v >> bit) & 1).astype(bool)[None, :], cols[:, bit, None], np.uint32(0))
  return out


def _shift_all(crcs: np.ndarray, nbytes: int) -> np.ndarray:
  t = _tables(nbytes)
  b = crcs.astype("<u4").view(np.uint8).reshape(-1, 4)
  return t[0][b[:, 0]] ^ t[1][b[:, 1]] ^ t[2][b[:, 2]] ^ t[3][b[:, 3]]


def run_crcs(crcs, first, length: int) -> np.ndarray:
  """The crc32c of each run of consecutive chunks, each chunk ``length`` bytes.

  ``crcs``: the crc32c of every chunk of the runs, run after run; ``first``:
  the position in ``crcs`` of each run's first chunk (increasing, the first
  one 0). Returns one uint32 per run.
  """
  x = np.asarray(crcs).astype(np.uint32)
  first = np.asarray(first, np.int64)
  if not len(first):
    return np.zeros(0, np.uint32)
  i = np.arange(len(x))
  start = np.repeat(first, np.diff(np.append(first, len(x))))
  step, longest = 1, int(np.diff(np.append(first, len(x))).max())
  while step < longest:
    # Hillis-Steele: x[k] becomes the crc32c of chunks [max(start, k - 2 * step + 1), k].
    has = np.flatnonzero(i - step >= start)
    x[has] ^= _shift_all(x[has - step], step * length)
    step *= 2
  return x[np.append(first[1:], len(x)) - 1]

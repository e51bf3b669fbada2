"""The host executor: target buffers assembled with numpy copies, no compilation.

Sources in host memory (numpy arrays, bytes read from disk, arrays of the CPU
backend, which numpy views without a copy) are copied run by run into one
fresh buffer per (target rank, dtype). Copies move unsigned-integer views of
the bytes, so no value is ever interpreted: NaN payloads, -0.0, subnormals and
bfloat16 all arrive bit for bit. Padding is the zeros of the fresh buffer.

A fresh buffer pays a page fault per page on first touch; two threads copying
disjoint halves of the runs (numpy releases the GIL while it copies) hide
much of it, so large targets are split between ``THREADS`` workers.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard._src.core.copyplan import Runs
from jaxreshard._src.exec import bitview as _bitview

__all__ = ["bits", "execute", "host_bits", "host_view"]

THREADS = 2
# Below this many bytes a second thread costs more than it saves.
_PARALLEL_BYTES = 4 << 20

_POOL_LOCK = threading.Lock()
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


bits = _bitview.bits


def host_view(x: Any) -> np.ndarray:
  """``x`` as a flat numpy array; arrays of the CPU backend are viewed, not copied."""
  return np.asarray(x).reshape(-1)


def host_bits(x: Any) -> np.ndarray:
  """``bits(host_view(x))``: a flat, contiguous 1-D array of a width with an unsigned
  type is viewed in one step."""
  a = np.asarray(x)
  uint = _bitview.UINT.get(a.dtype.itemsize)
  if a.ndim == 1 and uint is not None and a.flags.c_contiguous:
    return a.view(uint)
  return bits(host_view(a))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  with _POOL_LOCK:
    if not _POOL:
      _POOL.append(
        concurrent.futures.ThreadPoolExecutor(THREADS - 1, thread_name_prefix="jaxreshard-copy")
      )
    return _POOL[0]


def _copy(out: np.ndarray, sources: Sequence[np.ndarray], runs: Runs, lo: int, hi: int) -> None:
  """Copies runs ``lo:hi`` (sorted by ``dst``): runs that follow each other in
  ``out`` without a gap are one ``np.concatenate`` into that stretch, so Python
  handles a run in a slice and an append while numpy moves the bytes."""
  dst, length = runs.dst[lo:hi], runs.length[lo:hi]
  end = dst + length
  # A stretch starts at a run whose dst is not where the previous one ended.
  starts = np.flatnonzero(np.concatenate([[True], dst[1:] != end[:-1]]))
  stops = np.append(starts[1:], len(dst))
  pieces = [
    sources[s][a : a + n]
    for s, a, n in zip(runs.source[lo:hi].tolist(), runs.src[lo:hi].tolist(), length.tolist())
  ]
  for i, j, b, e in zip(
    starts.tolist(), stops.tolist(), dst[starts].tolist(), end[stops - 1].tolist()
  ):
    if j - i == 1:
      out[b:e] = pieces[i]
    else:
      np.concatenate(pieces[i:j], out=out[b:e])


def execute(sources: Sequence[np.ndarray], runs: Runs, size: int, dtype: np.dtype) -> np.ndarray:
  """A fresh ``(size,)`` array of ``dtype``: the runs copied in, zeros elsewhere.

  Args:
    sources: flat arrays of ``dtype``, or unsigned-integer views of their bytes
      (only bytes move).
    runs: run tables indexing ``sources``; runs never overlap in the output.
    size: elements of the target buffer.
    dtype: its dtype.
  """
  dtype = np.dtype(dtype)
  out = np.zeros(size, dtype)
  if not len(runs):
    return out
  view = bits(out)
  src = [s if s.dtype.kind == "u" else bits(s) for s in sources]
  if len(runs) > 1 and (np.diff(runs.dst) < 0).any():
    order = np.argsort(runs.dst, kind="stable")
    runs = Runs(runs.source[order], runs.src[order], runs.dst[order], runs.length[order])
  n = len(runs)
  if (
    size * dtype.itemsize < _PARALLEL_BYTES
    or n < 2
    and runs.elements * dtype.itemsize < 2 * _PARALLEL_BYTES
  ):
    _copy(view, src, runs, 0, n)
    return out
  if n == 1:  # one long run: split it in two
    runs = _halves(runs)
    n = 2
  cut = int(np.searchsorted(np.cumsum(runs.length), runs.elements // 2)) + 1
  cut = min(max(cut, 1), n - 1)
  other = _pool().submit(_copy, view, src, runs, cut, n)
  _copy(view, src, runs, 0, cut)
  other.result()
  return out


def _halves(runs: Runs) -> Runs:
  half = int(runs.length[0]) // 2
  rest = int(runs.length[0]) - half
  return Runs(
    np.repeat(runs.source, 2),
    np.array([runs.src[0], runs.src[0] + half]),
    np.array([runs.dst[0], runs.dst[0] + half]),
    np.array([half, rest]),
  )

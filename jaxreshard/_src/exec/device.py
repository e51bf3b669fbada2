"""The device executor: target buffers built where the source bytes live.

When the source buffers already sit on an accelerator, a target buffer is
assembled there by jitted kernels instead of on the host. A target is a set of
*runs*: run ``i`` copies ``length[i]`` consecutive elements of source
``src_index[i]``, starting at ``src_start[i]``, to ``dst_start[i]`` of the
output; everything no run covers is zero.

The number of compiled programs is bounded by a small constant per dtype,
independent of the number of parameters and of the number of runs:

* Run tables are runtime arguments. The kernel expands them to element indices
  on the device (the run of each copied element is a prefix sum of marks
  scattered at the run ends), so the host never builds an array with one entry
  per element.
* Every runtime table is padded to a power-of-two number of runs (padded runs
  have length 0) and the number of elements copied by one call is padded to a
  power of two ``E`` (the surplus positions are scattered out of bounds and
  dropped). One call copies at most ``_MAX_RUNS_PER_CALL`` runs and
  ``_MAX_ELEMENTS_PER_CALL`` elements, so both buckets come from a short list.
* The output is built one source at a time, into a buffer that each call
  donates to the next (no copy of the output per source).

A gather program is therefore keyed by (dtype, source size, output size,
run bucket, element bucket, index width, device): a handful per dtype and
archive layout, and a repeated layout compiles nothing. The process keeps at
most ``kernels.MAX_PROGRAMS`` programs, dropping the least recently used, so
a long process that meets layout after layout does not hold them all.

Packing an archive's leaves into one buffer and splitting a target buffer back
into one array per leaf take a program with an argument or a result per leaf,
and XLA compiles such a program in time that grows faster than its leaves
(XLA:CPU: a split into 2,000 arrays ~2 s, into 5,000 ~7 s; a concatenate of
20,000 ~60 s). Past ``STAGE_ABOVE`` leaves, a pack or split goes through host
memory instead: ``jax.device_get`` of the leaves (or of the buffer), a numpy
concatenation (or views), one ``jax.device_put`` onto the device the program
would have run on (the arrays' own when committed, else jax's default). It
compiles nothing, so compile time no longer grows with the parameters; it
costs a transfer of the bytes each way and jax's own work per array. Transfers
copy bits and never convert a value; a dtype that ``device_put`` would narrow
(64-bit ones while x64 is off) keeps the program.

Index width: offsets are ``int32`` while every source and the output have at
most ``2**31 - 1`` elements, ``int64`` beyond. ``int64`` needs
``jax_enable_x64``; with it off, a buffer past ``int32`` is refused with a
``ValueError`` rather than indexed with wrapped offsets.

Bit exactness on every backend: the kernels only move unsigned integer views
(no float arithmetic can quiet a NaN, flush a subnormal or drop the sign of
-0.0). XLA:CPU has no bfloat16 arithmetic and rewrites a same-width bitcast
*into* bfloat16 through float32 (quieting signalling NaNs, flushing
subnormals), while a bitcast between bfloat16 and bytes (``uint8[..., 2]``) is
left alone, so bfloat16 is moved as byte pairs; other dtypes as same-width
unsigned integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.errors import ShapeError
from jaxreshard._src.exec import kernels as _kernels
from jaxreshard._src.exec.kernels import KernelCacheInfo, clear_kernel_cache, kernel_cache_info

__all__ = [
  "pack",
  "gather",
  "nonzero_runs",
  "split",
  "kernel_cache_info",
  "clear_kernel_cache",
  "KernelCacheInfo",
]

# Largest offset an int32 index holds; buffers past it need int64 indices.
_INT32_MAX = 2**31 - 1
# One kernel call copies at most this many runs and elements (longer work is
# cut into several calls of the same program). The element cap bounds the
# device memory of the per-element index arrays (a few bytes per element).
_MAX_RUNS_PER_CALL = 2**16
_MAX_ELEMENTS_PER_CALL = 2**24
# Smallest buckets: tiny tables and copies all share one program.
_MIN_RUNS_BUCKET = 16
_MIN_ELEMENTS_BUCKET = 256
# Packs and splits of more leaves than this go through host memory (no program).
STAGE_ABOVE = 256


def pack(leaves: Sequence[jax.Array]) -> jax.Array:
  """The 1-D concatenation of the flattened leaves, on their device.

  Up to ``STAGE_ABOVE`` leaves: one program per distinct tuple of leaf shapes
  (a source archive layout), cached; more: through host memory, no program.

  Args:
    leaves: arrays of one dtype on one device (any shapes, zero-size and
      scalars included).

  Returns:
    A ``(sum of leaf sizes,)`` array of the leaves' dtype, bit-identical to
    the flattened leaves in order.

  Raises:
    ValueError: no leaves, or leaves of several dtypes or devices.

  Examples:
    >>> import jax.numpy as jnp
    >>> pack([jnp.arange(2.0), jnp.ones((1, 2))]).tolist()
    [0.0, 1.0, 1.0, 1.0]
  """
  leaves = list(leaves)
  if not leaves:
    raise ValueError("pack: no leaves (the dtype of an empty pack is unknown)")
  device = _kernels.device_of(leaves, "pack")
  dtype = _kernels.dtype_of(leaves, "pack")
  if _staged(len(leaves), dtype):
    # On the CPU backend a leaf's host copy is a view of it (no transfer to batch).
    host = leaves if device.platform == "cpu" else jax.device_get(leaves)
    flat = np.concatenate([np.asarray(x).reshape(-1) for x in host])
    return _put(flat, device, any(x.committed for x in leaves))
  specs = tuple((tuple(x.shape), _kernels.weak(x)) for x in leaves)
  key = ("pack", dtype.name, specs, device, _kernels.x64())
  fn = _kernels.program(key, lambda: _kernels.make_pack(dtype, specs, device))
  return fn(leaves)


def split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
  """Consecutive 1-D pieces of ``flat`` of the given sizes.

  Up to ``STAGE_ABOVE`` pieces: one program per distinct ``sizes`` tuple (and
  ``flat`` size), cached; more: through host memory, no program.

  Args:
    flat: a 1-D array.
    sizes: piece sizes, ``sum(sizes) <= flat.size``; what follows the last
      piece is ignored.

  Returns:
    ``len(sizes)`` 1-D arrays of ``flat``'s dtype on its device, piece ``k``
    bit-identical to ``flat[sum(sizes[:k]):sum(sizes[:k + 1])]``.

  Raises:
    ValueError: ``flat`` is not 1-D, a size is negative or the sizes exceed
      ``flat``.

  Examples:
    >>> import jax.numpy as jnp
    >>> [p.tolist() for p in split(jnp.arange(5.0), [2, 0, 3])]
    [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
  """
  sizes = tuple(int(n) for n in sizes)
  device = _kernels.device_of([flat], "split")
  dtype = _kernels.dtype_of([flat], "split")
  if flat.ndim != 1:
    raise ValueError(f"split: flat must be 1-D, got shape {tuple(flat.shape)}")
  if any(n < 0 for n in sizes):
    raise ValueError(f"split: negative size in {sizes}")
  if sum(sizes) > flat.shape[0]:
    raise ValueError(f"split: sizes sum to {sum(sizes)} > flat size {flat.shape[0]}")
  if not sizes:
    return []
  if _staged(len(sizes), dtype):
    host = np.asarray(jax.device_get(flat))
    ends = np.cumsum(sizes).tolist()
    return list(_put([host[b - k : b] for k, b in zip(sizes, ends)], device, flat.committed))
  n = int(flat.shape[0])
  key = ("split", dtype.name, n, _kernels.weak(flat), sizes, device, _kernels.x64())
  fn = _kernels.program(key, lambda: _kernels.make_split(dtype, n, sizes, device))
  return list(fn(flat))


def nonzero_runs(
  sources: Sequence[jax.Array], src_index: np.ndarray, src_start: np.ndarray, length: np.ndarray
) -> bool:
  """Whether run ``i`` (``length[i]`` elements of ``sources[src_index[i]]`` from
  ``src_start[i]``) holds a nonzero bit (-0.0 and NaN payloads included), for any i.

  The runs are read on the sources' device, and only the answer comes back.
  Programs are keyed as ``gather``'s, without an output: (dtype, source size,
  run bucket, element bucket, index width, device).

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> a = jnp.array([1.0, 0.0, -0.0])
    >>> t = lambda *v: np.array(v, np.int64)
    >>> nonzero_runs([a], t(0), t(1), t(1)), nonzero_runs([a], t(0), t(1), t(2))
    (False, True)
  """
  sources = list(sources)
  if not sources:
    raise ValueError("nonzero_runs: no sources")
  device = _kernels.device_of(sources, "nonzero_runs")
  dtype = _kernels.dtype_of(sources, "nonzero_runs")
  src_sizes = [int(x.shape[0]) for x in sources]
  length = np.asarray(length, np.int64).reshape(-1)
  dst = np.cumsum(length) - length
  total = int(length.sum())
  src_index, src_start, dst, length = _checked_runs(
    src_sizes, total, src_index, src_start, dst, length
  )
  index_dtype = _index_dtype(max([total] + src_sizes))
  found = []
  for k, source, (s, _, n), runs_bucket, elements, key in _calls(
    sources, src_index, src_start, dst, length, total, index_dtype, device
  ):
    fn = _kernels.program(
      ("nonzero_runs", *key),
      lambda: _kernels.make_nonzero_runs(
        dtype, src_sizes[k], runs_bucket, elements, index_dtype, device
      ),
    )
    found.append(
      fn(source, _padded(s, runs_bucket, index_dtype), _padded(n, runs_bucket, np.int32))
    )
  return any(bool(f) for f in found)  # the calls are queued first, then read


def gather(
  sources: Sequence[jax.Array],
  src_index: np.ndarray,
  src_start: np.ndarray,
  dst_start: np.ndarray,
  length: np.ndarray,
  size: int,
) -> jax.Array:
  """A ``(size,)`` buffer of the sources' dtype, built from runs on their device.

  For each run ``i``::

    out[dst_start[i]:dst_start[i] + length[i]] =
        sources[src_index[i]][src_start[i]:src_start[i] + length[i]]

  and zeros everywhere else. Bit exact: NaN payloads, -0.0, subnormals and
  infinities are copied as they are.

  Args:
    sources: 1-D arrays of one dtype on one device (sizes may differ).
    src_index: ``int64[R]``, the source of each run.
    src_start: ``int64[R]``, the first source element of each run.
    dst_start: ``int64[R]``, the first output element of each run.
    length: ``int64[R]``, the elements of each run (0 is allowed).
    size: the output's number of elements.

  Returns:
    The output, on the sources' device.

  Raises:
    ValueError: tables of different lengths, a run outside its source or the
      output, runs that overlap in the output, sources of several dtypes or
      devices, or a buffer past ``2**31 - 1`` elements with ``jax_enable_x64``
      off (its offsets need ``int64``).

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> a, b = jnp.arange(1.0, 4.0), jnp.arange(10.0, 13.0)
    >>> t = lambda *v: np.array(v, np.int64)
    >>> gather([a, b], t(1, 0), t(0, 2), t(0, 4), t(2, 1), 6).tolist()
    [10.0, 11.0, 0.0, 0.0, 3.0, 0.0]
  """
  sources = list(sources)
  if not sources:
    raise ValueError("gather: no sources (the dtype of the output is unknown)")
  device = _kernels.device_of(sources, "gather")
  dtype = _kernels.dtype_of(sources, "gather")
  for k, x in enumerate(sources):
    if x.ndim != 1:
      raise ValueError(f"gather: source {k} must be 1-D, got shape {tuple(x.shape)}")
  size = int(size)
  if size < 0:
    raise ValueError(f"gather: negative output size {size}")
  src_sizes = [int(x.shape[0]) for x in sources]
  runs = _checked_runs(src_sizes, size, src_index, src_start, dst_start, length)

  index_dtype = _index_dtype(max([size] + src_sizes))
  x64 = _kernels.x64()
  zeros = _kernels.program(
    ("zeros", dtype.name, size, device, x64), lambda: _kernels.make_zeros(dtype, size, device)
  )
  out = zeros()
  if size == 0:
    return out
  for k, source, (s, d, n), runs_bucket, elements, key in _calls(
    sources, *runs, size, index_dtype, device
  ):
    fn = _kernels.program(
      ("gather", size, *key),
      lambda: _kernels.make_gather(
        dtype, src_sizes[k], size, runs_bucket, elements, index_dtype, device
      ),
    )
    out = fn(
      out,
      source,
      _padded(s, runs_bucket, index_dtype),
      _padded(d, runs_bucket, index_dtype),
      _padded(n, runs_bucket, np.int32),
    )
  return out


def _staged(leaves: int, dtype: np.dtype) -> bool:
  """Whether a pack or split of ``leaves`` leaves of ``dtype`` goes through host
  memory: past ``STAGE_ABOVE``, where ``device_put`` keeps the dtype as it is."""
  return leaves > STAGE_ABOVE and jax.dtypes.canonicalize_dtype(dtype) == dtype


def _put(x: Any, device: Any, committed: bool) -> Any:
  """``x`` (an array or a list of them) on the device a program given arrays so
  committed would run on and return them: ``device`` itself if committed, else
  jax's default device, uncommitted."""
  return jax.device_put(x, device) if committed else jax.device_put(x)


def _calls(sources, src_index, src_start, dst_start, length, size, index_dtype, device):
  """The kernel calls of checked runs: per source, its runs cut into calls of at
  most ``_MAX_RUNS_PER_CALL`` runs and ``_MAX_ELEMENTS_PER_CALL`` elements;
  yields (source index, source, (src, dst, length) of the call, run bucket,
  element bucket, the program's key but for the kernel's own fields)."""
  common = (np.dtype(index_dtype).name, _kernels.x64())
  order = np.argsort(src_index, kind="stable")
  bounds = np.searchsorted(src_index[order], np.arange(len(sources) + 1))
  for k, source in enumerate(sources):
    mine = order[bounds[k] : bounds[k + 1]]
    if not mine.size:
      continue
    s, d, n = _cut_long_runs(src_start[mine], dst_start[mine], length[mine])
    for lo, hi in _call_ranges(n):
      runs_bucket, elements = _buckets(hi - lo, int(n[lo:hi].sum()), size)
      key = (
        np.dtype(source.dtype).name,
        int(source.shape[0]),
        _kernels.weak(source),
        runs_bucket,
        elements,
        *common,
        device,
      )
      yield k, source, (s[lo:hi], d[lo:hi], n[lo:hi]), runs_bucket, elements, key


def _index_dtype(largest: int) -> Any:
  """``int32`` offsets up to ``2**31 - 1`` elements, ``int64`` (needs x64) beyond."""
  if largest <= _INT32_MAX:
    return np.int32
  if not _kernels.x64():
    raise ShapeError(
      f"the device executor: a buffer of {largest} elements needs int64 offsets (past"
      f" int32's {_INT32_MAX}), which jax gives only with jax_enable_x64 on; enable it,"
      " or pass executor='host'"
    )
  return np.int64


def _checked_runs(src_sizes, size, *tables):
  """The run tables as int64 arrays without their zero-length runs, after the
  checks that every run lies inside its source and the output and that no two
  runs overlap in the output."""
  src_index, src_start, dst_start, length = (
    np.asarray(t).astype(np.int64, copy=False).reshape(-1) for t in tables
  )
  if not len({len(src_index), len(src_start), len(dst_start), len(length)}) == 1:
    raise ValueError(
      "gather: run tables of different lengths "
      f"{[len(src_index), len(src_start), len(dst_start), len(length)]}"
    )
  if (length < 0).any():
    raise ValueError("gather: negative run length")
  keep = length > 0
  src_index, src_start, dst_start, length = (
    t[keep] for t in (src_index, src_start, dst_start, length)
  )
  if not length.size:
    return src_index, src_start, dst_start, length
  if (src_index < 0).any() or (src_index >= len(src_sizes)).any():
    raise ValueError(f"gather: source index outside [0, {len(src_sizes)})")
  limits = np.asarray(src_sizes, np.int64)[src_index]
  if (src_start < 0).any() or (src_start > limits - length).any():
    bad = int(np.flatnonzero((src_start < 0) | (src_start > limits - length))[0])
    raise ValueError(
      f"gather: run [{src_start[bad]}, +{length[bad]}) outside source "
      f"{src_index[bad]} of {limits[bad]} elements"
    )
  if (dst_start < 0).any() or (dst_start > size - length).any():
    raise ValueError(f"gather: a run lies outside the output of {size} elements")
  by_dst = np.argsort(dst_start, kind="stable")
  if (dst_start[by_dst][1:] < (dst_start + length)[by_dst][:-1]).any():
    raise ValueError("gather: runs overlap in the output")
  return src_index, src_start, dst_start, length


def _cut_long_runs(src_start, dst_start, length):
  """Runs longer than ``_MAX_ELEMENTS_PER_CALL`` cut into pieces of at most that."""
  cap = _MAX_ELEMENTS_PER_CALL
  if not (length > cap).any():
    return src_start, dst_start, length
  # Each run cut at multiples of the cap counted from its own first element.
  run, _, _, skip, pieces = _copyplan.cut_runs(np.zeros_like(length), length, cap)
  return src_start[run] + skip, dst_start[run] + skip, pieces


def _call_ranges(length):
  """``[lo, hi)`` run ranges, in order, of at most ``_MAX_RUNS_PER_CALL`` runs
  and ``_MAX_ELEMENTS_PER_CALL`` elements each (every run fits one call)."""
  ends = np.cumsum(length)
  ranges, lo = [], 0
  while lo < length.size:
    base = int(ends[lo - 1]) if lo else 0
    hi = min(
      lo + _MAX_RUNS_PER_CALL,
      int(np.searchsorted(ends, base + _MAX_ELEMENTS_PER_CALL, side="right")),
    )
    assert hi > lo, "a run longer than one call survived _cut_long_runs"
    ranges.append((lo, hi))
    lo = hi
  return ranges


def _buckets(runs: int, elements: int, size: int) -> tuple[int, int]:
  """Padded (run count, element count) of one call: powers of two, the element
  bucket at most the output size's (no call copies more than the output)."""
  elements_bucket = min(_bucket(elements, _MIN_ELEMENTS_BUCKET), _bucket(size, 1))
  runs_bucket = min(_bucket(runs, _MIN_RUNS_BUCKET), elements_bucket)
  assert runs <= runs_bucket and elements <= elements_bucket
  return runs_bucket, elements_bucket


def _bucket(n: int, smallest: int) -> int:
  """The smallest power of two ``>= max(n, smallest)``."""
  n = max(int(n), int(smallest), 1)
  return 1 << (n - 1).bit_length()


def _padded(table: np.ndarray, n: int, dtype: Any) -> np.ndarray:
  out = np.zeros(n, dtype)
  out[: table.size] = table
  return out

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
archive layout, and a repeated layout compiles nothing.

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

import threading
from typing import Any, Callable, NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["pack", "gather", "split", "device_cache_info", "clear_device_cache", "DeviceCacheInfo"]

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

# The kernels only move bits, so XLA's optimizations buy nothing at run time,
# and on XLA:CPU compilation dominates a cold run: backend optimization level 0
# and the classic (non-"fusion emitter") CPU codegen compile several times
# faster and stay bit exact with the byte-pair bfloat16 path. Other backends
# compile with their defaults.
_CPU_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_cpu_use_fusion_emitters": False,
}

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class DeviceCacheInfo(NamedTuple):
  programs: int  # distinct compiled programs held in the cache
  traces: int  # times any program was traced (== compiled) since the cache was cleared


class _Cache:

  def __init__(self):
    self.lock = threading.Lock()
    self.programs: dict[Any, Callable[..., Any]] = {}
    self.traces = 0


_CACHE = _Cache()


def device_cache_info() -> DeviceCacheInfo:
  """Programs held and traces done by the device executor (for tests and benchmarks).

  Examples:
    >>> info = device_cache_info()
    >>> info.programs >= 0 and info.traces >= 0
    True
  """
  with _CACHE.lock:
    return DeviceCacheInfo(len(_CACHE.programs), _CACHE.traces)


def clear_device_cache() -> None:
  """Drops every compiled program (the next call compiles afresh)."""
  with _CACHE.lock:
    _CACHE.programs.clear()
    _CACHE.traces = 0


def _count_trace() -> None:
  with _CACHE.lock:
    _CACHE.traces += 1


def _program(key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  """The cached program for ``key``, made by ``make()`` on first use.

  Every key holds the shapes, dtypes, weak types, device and x64 mode of the
  arguments, so each cached jitted function is traced and compiled once.
  """
  with _CACHE.lock:
    fn = _CACHE.programs.get(key)
    if fn is None:
      fn = _CACHE.programs[key] = make()
  return fn


def _compiler_options(device: Any) -> dict[str, Any]:
  return dict(_CPU_COMPILER_OPTIONS) if device.platform == "cpu" else {}


def _bits_dtype(dtype: Any) -> Any:
  dtype = np.dtype(dtype)
  return jnp.uint8 if dtype.name == "bfloat16" else _UINT_OF_WIDTH[dtype.itemsize]


def _bits_tail(dtype: Any) -> tuple[int, ...]:
  return (2,) if np.dtype(dtype).name == "bfloat16" else ()


def _to_bits(x: jax.Array) -> jax.Array:
  """A flat unsigned view of ``x``: ``(n,)``, or ``(n, 2)`` bytes for bfloat16."""
  bits = lax.bitcast_convert_type(x, _bits_dtype(x.dtype))
  return bits.reshape((-1,) + _bits_tail(x.dtype))


def _from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """The 1-D ``dtype`` array whose bits are ``bits`` (as made by ``_to_bits``)."""
  return lax.bitcast_convert_type(bits, dtype).reshape(-1)


def _bucket(n: int, smallest: int) -> int:
  """The smallest power of two ``>= max(n, smallest)``."""
  n = max(int(n), int(smallest), 1)
  return 1 << (n - 1).bit_length()


def _x64() -> bool:
  return bool(jax.config.jax_enable_x64)


def _device_of(arrays: Sequence[Any], what: str) -> Any:
  """The one device that holds every array of ``arrays``."""
  devices = set()
  for x in arrays:
    if not isinstance(x, jax.Array):
      raise TypeError(f"{what}: expected jax.Array, got {type(x).__name__}")
    devices |= set(x.devices())
  if len(devices) != 1:
    raise ValueError(f"{what}: the arrays must live on one device, got {sorted(map(str, devices))}")
  return devices.pop()


def _dtype_of(arrays: Sequence[jax.Array], what: str) -> np.dtype:
  dtypes = {np.dtype(x.dtype) for x in arrays}
  if len(dtypes) != 1:
    names = sorted(d.name for d in dtypes)
    raise ValueError(f"{what}: the arrays must share one dtype, got {names}")
  dtype = dtypes.pop()
  if dtype.itemsize not in _UINT_OF_WIDTH:
    raise ValueError(f"{what}: unsupported dtype {dtype.name}")
  return dtype


def _weak(x: jax.Array) -> bool:
  return bool(getattr(x, "weak_type", False))


# ---------------------------------------------------------------------------
# pack


def pack(leaves: Sequence[jax.Array]) -> jax.Array:
  """The 1-D concatenation of the flattened leaves, on their device.

  One program per distinct tuple of leaf shapes (a source archive layout),
  cached.

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
  device = _device_of(leaves, "pack")
  dtype = _dtype_of(leaves, "pack")
  specs = tuple((tuple(x.shape), _weak(x)) for x in leaves)
  key = ("pack", dtype.name, specs, device, _x64())
  fn = _program(key, lambda: _make_pack(dtype, specs, device))
  return fn(leaves)


def _make_pack(dtype: np.dtype, specs, device: Any) -> Callable[..., Any]:

  def kernel(leaves):
    _count_trace()
    chex.assert_equal(len(leaves), len(specs))
    parts = []
    for x, (shape, _) in zip(leaves, specs):
      chex.assert_shape(x, shape)
      chex.assert_type(x, dtype)
      parts.append(_to_bits(x))
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return _from_bits(flat, dtype)

  return jax.jit(kernel, compiler_options=_compiler_options(device))


# ---------------------------------------------------------------------------
# split


def split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
  """Consecutive 1-D pieces of ``flat`` of the given sizes.

  One program per distinct ``sizes`` tuple (and ``flat`` size), cached.

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
  device = _device_of([flat], "split")
  dtype = _dtype_of([flat], "split")
  if flat.ndim != 1:
    raise ValueError(f"split: flat must be 1-D, got shape {tuple(flat.shape)}")
  if any(n < 0 for n in sizes):
    raise ValueError(f"split: negative size in {sizes}")
  if sum(sizes) > flat.shape[0]:
    raise ValueError(f"split: sizes sum to {sum(sizes)} > flat size {flat.shape[0]}")
  if not sizes:
    return []
  key = ("split", dtype.name, int(flat.shape[0]), _weak(flat), sizes, device, _x64())
  fn = _program(key, lambda: _make_split(dtype, int(flat.shape[0]), sizes, device))
  return list(fn(flat))


def _make_split(dtype: np.dtype, n: int, sizes: tuple[int, ...], device: Any) -> Callable[..., Any]:

  def kernel(flat):
    _count_trace()
    chex.assert_shape(flat, (n,))
    chex.assert_type(flat, dtype)
    bits = _to_bits(flat)
    pieces, start = [], 0
    for size in sizes:
      pieces.append(_from_bits(lax.slice_in_dim(bits, start, start + size), dtype))
      start += size
    return pieces

  return jax.jit(kernel, compiler_options=_compiler_options(device))


# ---------------------------------------------------------------------------
# gather


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
  device = _device_of(sources, "gather")
  dtype = _dtype_of(sources, "gather")
  for k, x in enumerate(sources):
    if x.ndim != 1:
      raise ValueError(f"gather: source {k} must be 1-D, got shape {tuple(x.shape)}")
  size = int(size)
  if size < 0:
    raise ValueError(f"gather: negative output size {size}")
  src_sizes = [int(x.shape[0]) for x in sources]
  runs = _checked_runs(src_sizes, size, src_index, src_start, dst_start, length)

  index_dtype = _index_dtype(max([size] + src_sizes))
  x64 = _x64()
  zeros = _program(("zeros", dtype.name, size, device, x64),
                   lambda: _make_zeros(dtype, size, device))
  out = zeros()
  if size == 0:
    return out
  src_index, src_start, dst_start, length = runs
  order = np.argsort(src_index, kind="stable")
  bounds = np.searchsorted(src_index[order], np.arange(len(sources) + 1))
  for k, source in enumerate(sources):
    mine = order[bounds[k]:bounds[k + 1]]
    if not mine.size:
      continue
    s, d, n = _cut_long_runs(src_start[mine], dst_start[mine], length[mine])
    for lo, hi in _call_ranges(n):
      runs_bucket, elements = _buckets(hi - lo, int(n[lo:hi].sum()), size)
      key = ("gather", dtype.name, src_sizes[k], _weak(source), size, runs_bucket, elements,
             np.dtype(index_dtype).name, device, x64)
      fn = _program(key, lambda: _make_gather(dtype, src_sizes[k], size, runs_bucket, elements,
                                              index_dtype, device))
      out = fn(out, source, _padded(s[lo:hi], runs_bucket, index_dtype),
               _padded(d[lo:hi], runs_bucket, index_dtype),
               _padded(n[lo:hi], runs_bucket, np.int32))
  return out


def _index_dtype(largest: int) -> Any:
  """``int32`` offsets up to ``2**31 - 1`` elements, ``int64`` (needs x64) beyond."""
  if largest <= _INT32_MAX:
    return np.int32
  if not _x64():
    raise ValueError(
        f"gather: a buffer of {largest} elements needs int64 offsets (past int32's "
        f"{_INT32_MAX}); enable jax_enable_x64 to build it on the device")
  return np.int64


def _checked_runs(src_sizes, size, *tables):
  """The run tables as int64 arrays without their zero-length runs, after the
  checks that every run lies inside its source and the output and that no two
  runs overlap in the output."""
  src_index, src_start, dst_start, length = (np.asarray(t).astype(np.int64, copy=False).reshape(-1)
                                             for t in tables)
  if not len({len(src_index), len(src_start), len(dst_start), len(length)}) == 1:
    raise ValueError("gather: run tables of different lengths "
                     f"{[len(src_index), len(src_start), len(dst_start), len(length)]}")
  if (length < 0).any():
    raise ValueError("gather: negative run length")
  keep = length > 0
  src_index, src_start, dst_start, length = (
      t[keep] for t in (src_index, src_start, dst_start, length))
  if not length.size:
    return src_index, src_start, dst_start, length
  if (src_index < 0).any() or (src_index >= len(src_sizes)).any():
    raise ValueError(f"gather: source index outside [0, {len(src_sizes)})")
  limits = np.asarray(src_sizes, np.int64)[src_index]
  if (src_start < 0).any() or (src_start > limits - length).any():
    bad = int(np.flatnonzero((src_start < 0) | (src_start > limits - length))[0])
    raise ValueError(f"gather: run [{src_start[bad]}, +{length[bad]}) outside source "
                     f"{src_index[bad]} of {limits[bad]} elements")
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
  pieces = -(-length // cap)
  run = np.repeat(np.arange(length.size), pieces)
  first = np.cumsum(pieces) - pieces
  offset = (np.arange(run.size) - first[run]) * cap
  return src_start[run] + offset, dst_start[run] + offset, np.minimum(cap, length[run] - offset)


def _call_ranges(length):
  """``[lo, hi)`` run ranges, in order, of at most ``_MAX_RUNS_PER_CALL`` runs
  and ``_MAX_ELEMENTS_PER_CALL`` elements each (every run fits one call)."""
  ends = np.cumsum(length)
  ranges, lo = [], 0
  while lo < length.size:
    base = int(ends[lo - 1]) if lo else 0
    hi = min(lo + _MAX_RUNS_PER_CALL,
             int(np.searchsorted(ends, base + _MAX_ELEMENTS_PER_CALL, side="right")))
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


def _padded(table: np.ndarray, n: int, dtype: Any) -> np.ndarray:
  out = np.zeros(n, dtype)
  out[:table.size] = table
  return out


def _take(table: jax.Array, index: jax.Array) -> jax.Array:
  """``table[index]`` along axis 0; indices are never negative (no wrapping),
  and the ones past the end (padding, masked later) are clipped."""
  return table.at[index].get(mode="clip", wrap_negative_indices=False)


def _make_zeros(dtype: np.dtype, size: int, device: Any) -> Callable[..., Any]:

  def kernel():
    _count_trace()
    return _from_bits(jnp.zeros((size,) + _bits_tail(dtype), _bits_dtype(dtype)), dtype)

  return jax.jit(kernel, out_shardings=jax.sharding.SingleDeviceSharding(device),
                 compiler_options=_compiler_options(device))


def _make_gather(dtype: np.dtype, src_size: int, size: int, runs: int, elements: int,
                 index_dtype: Any, device: Any) -> Callable[..., Any]:
  """The program that copies up to ``runs`` runs, ``elements`` elements in all,
  from one source into the donated output."""

  def kernel(out, source, src_start, dst_start, length):
    _count_trace()
    chex.assert_shape(out, (size,))
    chex.assert_shape(source, (src_size,))
    chex.assert_type([out, source], dtype)
    chex.assert_shape([src_start, dst_start, length], (runs,))
    chex.assert_type([src_start, dst_start], index_dtype)
    chex.assert_type(length, jnp.int32)
    # Element j of this call belongs to run #{runs whose exclusive end is
    # <= j}: a prefix sum of marks scattered at the run ends (ends past the
    # call's elements are dropped). A zero-length run ends where the next one
    # starts, so it is skipped; positions past the last end are padding.
    ends = jnp.cumsum(length, dtype=jnp.int32)
    marks = jnp.zeros((elements,), jnp.int32).at[ends].add(
        1, mode="drop", wrap_negative_indices=False)
    run = jnp.minimum(jnp.cumsum(marks, dtype=jnp.int32), runs - 1)
    # Element j of run r reads source j + (src_start[r] - start_r) and writes
    # output j + (dst_start[r] - start_r), start_r being r's first element.
    first = (ends - length).astype(index_dtype)
    j = jnp.arange(elements, dtype=index_dtype)
    src = j + _take(src_start - first, run)
    # Padding positions are sent one past the output's end, where the scatter
    # drops them.
    dst = jnp.where(j < ends[-1].astype(index_dtype), j + _take(dst_start - first, run),
                    jnp.asarray(size, index_dtype))
    out_bits, src_bits = _to_bits(out), _to_bits(source)
    values = _take(src_bits, src)
    chex.assert_shape(values, (elements,) + _bits_tail(dtype))
    out_bits = out_bits.at[dst].set(values, mode="drop", wrap_negative_indices=False)
    return _from_bits(out_bits, dtype)

  return jax.jit(kernel, donate_argnums=0, compiler_options=_compiler_options(device))

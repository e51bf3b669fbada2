"""The device executor's compiled programs: the kernels and the cache that holds them.

Every program is made once per key by :func:`program` and kept in one cache
per process (a compiled program is a property of the process, not of any one
call), which :func:`kernel_cache_info` describes and :func:`clear_kernel_cache`
empties. The kernels only move unsigned integer views of their arguments, so
they are bit exact on every backend (see ``device``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
  "KernelCacheInfo",
  "clear_kernel_cache",
  "kernel_cache_info",
  "device_of",
  "dtype_of",
  "make_gather",
  "make_pack",
  "make_split",
  "make_zeros",
  "program",
  "weak",
  "x64",
]

# The kernels only move bits, so XLA's optimizations buy nothing at run time,
# and on XLA:CPU compilation dominates a cold run: backend optimization level 0
# and the classic (non-"fusion emitter") CPU codegen compile several times
# faster and stay bit exact with the byte-pair bfloat16 path. Other backends
# compile with their defaults.
_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class KernelCacheInfo(NamedTuple):
  programs: int  # distinct compiled programs held in the cache
  traces: int  # times any program was traced (== compiled) since the cache was cleared


# Programs kept at most: a layout needs a handful, so this holds dozens of
# layouts; past it the least recently used goes (a later call of its layout
# compiles it again), so a process that sees layout after layout (a new model
# size each time) does not keep every program it ever compiled.
MAX_PROGRAMS = 256


class _Cache:
  def __init__(self):
    self.lock = threading.Lock()
    # In order of last use, the most recent last.
    self.programs: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
    self.traces = 0


_CACHE = _Cache()


def kernel_cache_info() -> KernelCacheInfo:
  """Programs held and traces done by the device executor (for tests and benchmarks).

  Examples:
    >>> info = kernel_cache_info()
    >>> info.programs >= 0 and info.traces >= 0
    True
  """
  with _CACHE.lock:
    return KernelCacheInfo(len(_CACHE.programs), _CACHE.traces)


def clear_kernel_cache() -> None:
  """Drops every compiled program (the next call compiles afresh)."""
  with _CACHE.lock:
    _CACHE.programs.clear()
    _CACHE.traces = 0


def _count_trace() -> None:
  with _CACHE.lock:
    _CACHE.traces += 1


def program(key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  """The cached program for ``key``, made by ``make()`` on first use.

  Every key holds the shapes, dtypes, weak types, device and x64 mode of the
  arguments, so each cached jitted function is traced and compiled once while
  it is kept: at most ``MAX_PROGRAMS``, the least recently used dropped first.
  """
  with _CACHE.lock:
    fn = _CACHE.programs.get(key)
    if fn is None:
      fn = _CACHE.programs[key] = make()
      while len(_CACHE.programs) > MAX_PROGRAMS:
        _CACHE.programs.popitem(last=False)
    else:
      _CACHE.programs.move_to_end(key)
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


def x64() -> bool:
  return bool(jax.config.jax_enable_x64)


def device_of(arrays: Sequence[Any], what: str) -> Any:
  """The one device that holds every array of ``arrays``."""
  devices = set()
  for x in arrays:
    if not isinstance(x, jax.Array):
      raise TypeError(f"{what}: expected jax.Array, got {type(x).__name__}")
    devices |= set(x.devices())
  if len(devices) != 1:
    raise ValueError(f"{what}: the arrays must live on one device, got {sorted(map(str, devices))}")
  return devices.pop()


def dtype_of(arrays: Sequence[jax.Array], what: str) -> np.dtype:
  dtypes = {np.dtype(x.dtype) for x in arrays}
  if len(dtypes) != 1:
    names = sorted(d.name for d in dtypes)
    raise ValueError(f"{what}: the arrays must share one dtype, got {names}")
  dtype = dtypes.pop()
  if dtype.itemsize not in _UINT_OF_WIDTH:
    raise ValueError(f"{what}: unsupported dtype {dtype.name}")
  return dtype


def weak(x: jax.Array) -> bool:
  return bool(getattr(x, "weak_type", False))


def _take(table: jax.Array, index: jax.Array) -> jax.Array:
  """``table[index]`` along axis 0; indices are never negative (no wrapping),
  and the ones past the end (padding, masked later) are clipped."""
  return table.at[index].get(mode="clip", wrap_negative_indices=False)


def _moves_natively(dtype: np.dtype) -> bool:
  """Whether concatenations and slices of ``dtype`` may run on the values
  themselves: pure data movement, bit exact, except bfloat16, which XLA:CPU may
  widen to float32 around any op (so it moves as byte pairs)."""
  return np.dtype(dtype).name != "bfloat16"


def make_pack(dtype: np.dtype, specs, device: Any) -> Callable[..., Any]:
  """One concatenation of the flattened leaves. The traced program holds the
  leaves' reshapes and one concatenate (no per-leaf checks or bit views, which
  tripled its size), since XLA:CPU's compile time grows with the op count."""
  shapes = tuple(shape for shape, _ in specs)
  native = _moves_natively(dtype)

  def kernel(leaves):
    _count_trace()
    assert tuple(tuple(x.shape) for x in leaves) == shapes, "pack: leaf shapes changed"
    if native:
      parts = [lax.reshape(x, (x.size,)) for x in leaves]
    else:
      parts = [_to_bits(x) for x in leaves]
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return flat if native else _from_bits(flat, dtype)

  return jax.jit(kernel, compiler_options=_compiler_options(device))


def make_split(dtype: np.dtype, n: int, sizes: tuple[int, ...], device: Any) -> Callable[..., Any]:
  """Consecutive slices of ``flat``; slices of the values themselves but for bfloat16."""
  native = _moves_natively(dtype)

  def kernel(flat):
    _count_trace()
    chex.assert_shape(flat, (n,))
    chex.assert_type(flat, dtype)
    bits = flat if native else _to_bits(flat)
    pieces, start = [], 0
    for size in sizes:
      piece = lax.slice_in_dim(bits, start, start + size)
      pieces.append(piece if native else _from_bits(piece, dtype))
      start += size
    return pieces

  return jax.jit(kernel, compiler_options=_compiler_options(device))


def make_zeros(dtype: np.dtype, size: int, device: Any) -> Callable[..., Any]:

  def kernel():
    _count_trace()
    return _from_bits(jnp.zeros((size,) + _bits_tail(dtype), _bits_dtype(dtype)), dtype)

  return jax.jit(
    kernel,
    out_shardings=jax.sharding.SingleDeviceSharding(device),
    compiler_options=_compiler_options(device),
  )


def _run_of_element(length, runs: int, elements: int, index_dtype: Any) -> tuple:
  """(j, run of j, first element of each run, end of the last run) of a call's
  elements ``j`` in ``[0, elements)``.

  Element j belongs to run #{runs whose exclusive end is <= j}: a prefix sum
  of marks scattered at the run ends (ends past the call's elements are
  dropped). A zero-length run ends where the next one starts, so it is
  skipped; positions from the last end on are padding.
  """
  ends = jnp.cumsum(length, dtype=jnp.int32)
  marks = (
    jnp.zeros((elements,), jnp.int32).at[ends].add(1, mode="drop", wrap_negative_indices=False)
  )
  run = jnp.minimum(jnp.cumsum(marks, dtype=jnp.int32), runs - 1)
  first = (ends - length).astype(index_dtype)
  return jnp.arange(elements, dtype=index_dtype), run, first, ends[-1].astype(index_dtype)


def make_nonzero_runs(
  dtype: np.dtype, src_size: int, runs: int, elements: int, index_dtype: Any, device: Any
) -> Callable[..., Any]:
  """The program that says whether up to ``runs`` runs (``elements`` elements in
  all) of one source hold any nonzero bit: ``make_gather``'s reads, reduced."""

  def kernel(source, src_start, length):
    _count_trace()
    chex.assert_shape(source, (src_size,))
    chex.assert_type(source, dtype)
    chex.assert_shape([src_start, length], (runs,))
    j, run, first, end = _run_of_element(length, runs, elements, index_dtype)
    values = _take(_to_bits(source), j + _take(src_start - first, run))
    set_bits = values != jnp.zeros((), values.dtype)
    if set_bits.ndim > 1:  # bfloat16's byte pairs
      set_bits = jnp.any(set_bits, axis=-1)
    # Positions past the last run's end read clipped indices: left out.
    return jnp.any(set_bits & (j < end))

  return jax.jit(kernel, compiler_options=_compiler_options(device))


def make_gather(
  dtype: np.dtype, src_size: int, size: int, runs: int, elements: int, index_dtype: Any, device: Any
) -> Callable[..., Any]:
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
    # Element j of run r reads source j + (src_start[r] - start_r) and writes
    # output j + (dst_start[r] - start_r), start_r being r's first element.
    j, run, first, end = _run_of_element(length, runs, elements, index_dtype)
    src = j + _take(src_start - first, run)
    # Padding positions are sent one past the output's end, where the scatter
    # drops them.
    dst = jnp.where(j < end, j + _take(dst_start - first, run), jnp.asarray(size, index_dtype))
    out_bits, src_bits = _to_bits(out), _to_bits(source)
    values = _take(src_bits, src)
    chex.assert_shape(values, (elements,) + _bits_tail(dtype))
    out_bits = out_bits.at[dst].set(values, mode="drop", wrap_negative_indices=False)
    return _from_bits(out_bits, dtype)

  return jax.jit(kernel, donate_argnums=0, compiler_options=_compiler_options(device))

"""Jitted gather kernels that build flat target buffers from source slices.

A target buffer is the concatenation of the overlapping slices of a few source
buffers, followed by zero padding. The kernels do exactly that and nothing
else: every slice is a ``lax.dynamic_slice`` of a source reinterpreted as
unsigned integers (so NaN payloads, -0.0 and subnormals cannot be touched by
any float arithmetic), concatenated with zeros and reinterpreted back.

Compilation is the cost that matters: XLA compiles each program once per
distinct *signature*, and a signature here holds only lengths and shapes.
Slice *offsets* are runtime arguments, so ranks whose slices have the same
lengths (all interior ranks of a parameter in an even split, the same layout on
every restart) share one program. Buffers are *bucketed*: at most
``BUCKET_SIZE`` outputs are fused into one program, so a model with thousands
of parameters compiles a number of programs that grows with the number of
buckets, not with the number of buffers, and repeated layouts compile nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Piece", "Output", "assemble", "kernel_cache_info", "clear_kernel_cache", "BUCKET_SIZE"]

BUCKET_SIZE = 32
_INT32_MAX = 2**31 - 1
# No "xla_backend_optimization_level": 0 here, although it halves XLA:CPU
# compile time: at level 0, XLA:CPU lowers a bitcast to bfloat16 through float
# arithmetic, flushing bf16 subnormals to zero and quieting signalling NaNs
# (tests/test_properties.py::test_special_values_survive_every_path).
_COMPILER_OPTIONS: dict = {}
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
  """``source.reshape(-1)[start:start + length]``; ``source`` is any array."""

  source: Any
  start: int
  length: int


@dataclasses.dataclass(frozen=True, eq=False)
class Output:
  """A target buffer: ``pieces`` concatenated, zero-padded to ``size(shape)``."""

  shape: tuple[int, ...]
  dtype: Any
  pieces: tuple[Piece, ...]


class KernelCacheInfo(NamedTuple):
  programs: int  # distinct compiled kernel programs held in the cache
  traces: int  # times any kernel was traced (== compiled) since the cache was cleared


class _Cache:

  def __init__(self):
    self.lock = threading.Lock()
    self.programs: dict[Any, Any] = {}
    self.traces = 0


_CACHE = _Cache()


def kernel_cache_info() -> KernelCacheInfo:
  """Programs held and traces done by the kernel cache (for tests and benchmarks).

  Examples:
    >>> info = kernel_cache_info()
    >>> info.programs >= 0 and info.traces >= 0
    True
  """
  return KernelCacheInfo(len(_CACHE.programs), _CACHE.traces)


def clear_kernel_cache() -> None:
  """Drops every compiled kernel (the next call compiles afresh)."""
  with _CACHE.lock:
    _CACHE.programs.clear()
    _CACHE.traces = 0


def _make_kernel(signature):
  out_specs, in_specs, static_starts = signature

  def kernel(inputs, starts):
    with _CACHE.lock:
      _CACHE.traces += 1
    chex.assert_equal(len(inputs), len(in_specs))
    flat = []
    for x, (shape, dtype, _) in zip(inputs, in_specs):
      chex.assert_shape(x, shape)
      chex.assert_type(x, dtype)
      uint = _UINT_OF_WIDTH[np.dtype(dtype).itemsize]
      flat.append(lax.bitcast_convert_type(x.reshape(-1), uint))
    outs, j = [], 0
    for shape, dtype, pieces in out_specs:
      uint = _UINT_OF_WIDTH[np.dtype(dtype).itemsize]
      size = int(np.prod(shape, dtype=np.int64))
      parts = []
      for index, length in pieces:
        src = flat[index]
        chex.assert_type(src, uint)  # a source of another width cannot feed this output
        start = static_starts[j] if static_starts is not None else starts[j]
        parts.append(lax.dynamic_slice(src, (start,), (length,)))
        j += 1
      used = sum(length for _, length in pieces)
      if size > used:
        parts.append(jnp.zeros((size - used,), uint))
      buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts) if parts else jnp.zeros((0,), uint)
      chex.assert_shape(buf, (size,))
      outs.append(lax.bitcast_convert_type(buf, dtype).reshape(shape))
    return outs

  return jax.jit(kernel, compiler_options=_COMPILER_OPTIONS)


def _run_bucket(outputs: Sequence[Output]) -> list[jax.Array]:
  inputs, index_of = [], {}
  out_specs, starts = [], []
  for out in outputs:
    pieces = []
    for piece in out.pieces:
      if piece.length == 0:
        continue
      key = id(piece.source)
      if key not in index_of:
        index_of[key] = len(inputs)
        inputs.append(piece.source)
      pieces.append((index_of[key], int(piece.length)))
      starts.append(int(piece.start))
    out_specs.append((tuple(out.shape), np.dtype(out.dtype), tuple(pieces)))
  in_specs = tuple(
      (tuple(np.shape(x)), np.dtype(x.dtype), bool(getattr(x, "weak_type", False))) for x in inputs
  )
  # Offsets beyond int32 (a >2**31-element shard) are compiled in instead.
  static = tuple(starts) if starts and max(starts) > _INT32_MAX else None
  signature = (tuple(out_specs), in_specs, static)
  with _CACHE.lock:
    fn = _CACHE.programs.get(signature)
    if fn is None:
      fn = _CACHE.programs[signature] = _make_kernel(signature)
  dyn = np.asarray(starts if static is None else [], dtype=np.int32)
  return fn(_on_one_device(inputs), dyn)


def _on_one_device(inputs: list[Any]) -> list[Any]:
  """Sources committed to different devices (each rank's archive restored onto
  its own device) cannot feed one jitted program: gather them on the default
  device. Sources on a single device stay there (GPU/TPU arrays stay put)."""
  devices = {d for x in inputs if isinstance(x, jax.Array) for d in x.devices()}
  if len(devices) <= 1:
    return inputs
  target = jax.config.jax_default_device
  if target is None or isinstance(target, str):
    target = jax.devices(target)[0]
  return [jax.device_put(x, target) if isinstance(x, jax.Array) else x for x in inputs]


def assemble(outputs: Sequence[Output]) -> list[jax.Array]:
  """Builds every output buffer with bucketed jitted kernels, in order.

  Args:
    outputs: target buffers; each piece's ``source`` is a jax or numpy array
      whose flattened ``[start, start + length)`` is copied in order.

  Returns:
    One array per output on the default device (or the sources' device), with
    the output's shape and dtype, bit-identical to the slices it was built from
    and zero elsewhere.
  """
  results: list[jax.Array] = []
  for i in range(0, len(outputs), BUCKET_SIZE):
    results.extend(_run_bucket(outputs[i:i + BUCKET_SIZE]))
  return results
